"""Mixed precision: the GPT training step with and without bf16 autocast, tpu and PyTorch CPU.

Each configuration runs in its own fresh process after an unmeasured priming process that
fills the compilation cache. A figure is the median over blocks of BLOCK steps (each block
ends with ``torch.tpu.synchronize()``), with the range over the blocks. On the XLA CPU
plugin bfloat16 has no native matrix units: expect autocast to be slower there; on a TPU or
GPU plugin it is the faster path. Prints ratios; no thresholds.
"""

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402

BLOCK = 5
CONFIGS = [  # (device, eager mode, autocast)
    ("cpu", None, False), ("cpu", None, True),
    ("tpu", "DEFER_NEVER", False), ("tpu", "DEFER_NEVER", True),
    ("tpu", "DEFER_AND_FUSE", False), ("tpu", "DEFER_AND_FUSE", True),
]


def worker(device, mode, amp, warmup, reps):
    import models
    import torch

    if device == "tpu":
        import torch_pjrt  # noqa: F401

        torch.tpu.eager_mode = getattr(torch.tpu.EagerMode, mode)
    step = models.gpt_step(device, autocast=torch.bfloat16 if amp else None)
    sync = torch.tpu.synchronize if device == "tpu" else (lambda: None)
    times = harness.block_times(step, sync, warmup, reps, BLOCK)
    if times:
        print(json.dumps({"ms": statistics.median(times), "lo": min(times), "hi": max(times)}))


def run(cfg, warmup, reps):
    device, mode, amp = cfg
    cmd = [sys.executable, __file__, "--worker", device, str(mode), str(int(amp))]
    return harness.primed_run(cmd, warmup, reps)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        device, mode, amp, warmup, reps = a.worker
        worker(device, mode, amp == "1", int(warmup), int(reps))
        return
    warmup, reps = (3, 5) if a.quick else (5, 15)
    print(f"GPT step, bf16 autocast vs float32 ({harness.describe()})")
    print(f"{'config':<24} {'ms/step':>9} {'range':>15} {'amp vs fp32':>12} {'vs CPU fp32':>12}")
    res = {cfg: run(cfg, warmup, reps) for cfg in CONFIGS}
    cpu = res[("cpu", None, False)]["ms"]
    for (device, mode, amp), r in res.items():
        name = f"{device} {mode or 'eager'}{' +amp' if amp else ''}"
        base = res[(device, mode, False)]["ms"]
        print(f"{name:<24} {r['ms']:>9.2f} {r['lo']:>7.2f}-{r['hi']:<7.2f} "
              f"{base / r['ms']:>11.2f}x {cpu / r['ms']:>11.2f}x")


if __name__ == "__main__":
    main()
