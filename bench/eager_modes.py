"""Eager modes: GPT and MLP training steps in Strict, Debug and DeferAndFuse, vs PyTorch CPU.

Each configuration runs in its own fresh process (so its peak host memory, ru_maxrss, is its
own), all in one run of this script, after one unmeasured priming process that fills the
persistent compilation cache (peak memory is then that of running, not of compiling). Step
times are warm throughput: the median over blocks of BLOCK back-to-back steps of the block's
time divided by BLOCK, each block ending with ``torch.tpu.synchronize()`` (a step's
``.item()`` waits for the loss only; Strict may still be running the optimizer update). Loops of pointwise ops compare Strict with Debug at
two sizes: "tiny" (16 elements: the device work is negligible, both modes are bound by host
dispatch) and "small" (16K elements: device work comparable to dispatch, which Strict
overlaps). Prints ratios; no thresholds.
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
MODES = {"strict": "DEFER_NEVER", "debug": "DEFER_NEVER_AND_LAUNCH_BLOCKING",
         "defer_and_fuse": "DEFER_AND_FUSE"}


def worker(model, mode, warmup, reps):
    import resource

    import torch

    sys.path.insert(0, HERE)
    import models

    device = "cpu"
    if mode != "cpu":
        import torch_pjrt  # noqa: F401

        torch.tpu.eager_mode = getattr(torch.tpu.EagerMode, MODES[mode])
        device = "tpu"
    if model in ("tiny_ops", "small_ops"):
        x = torch.ones(16 if model == "tiny_ops" else 16384, device=device)

        def step():
            y = x
            for _ in range(200):
                y = y * 1.0001 + 0.0001
            return y.sum().item()
    else:
        step = getattr(models, f"{model}_step")(device)
    sync = torch.tpu.synchronize if device == "tpu" else (lambda: None)
    times = harness.block_times(step, sync, warmup, reps, BLOCK)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if times:
        print(json.dumps({"ms": statistics.median(times), "rss_mb": rss}))


def run(model, mode, warmup, reps):
    # Priming: the same warm-up steps, so that every program the measured run needs (a
    # training loop's first steps build different graphs) is in the disk cache.
    return harness.primed_run([sys.executable, __file__, "--worker", model, mode], warmup, reps)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        model, mode, warmup, reps = a.worker
        worker(model, mode, int(warmup), int(reps))
        return
    warmup, reps = (3, 5) if a.quick else (5, 15)
    load = os.getloadavg()[0]
    print(f"eager modes ({harness.describe()})")
    print(f"{'step':<10} {'config':<16} {'ms/step':>9} {'steps/s':>8} {'vs Strict':>10} "
          f"{'vs CPU':>7} {'peak RSS MB':>12}")
    for model in ("gpt", "mlp", "tiny_ops", "small_ops"):
        res = {m: run(model, m, warmup, reps) for m in ("cpu", "strict", "debug", "defer_and_fuse")}
        strict = res["strict"]["ms"]
        for m, r in res.items():
            print(f"{model:<10} {m:<16} {r['ms']:>9.2f} {1e3 / r['ms']:>8.1f} "
                  f"{strict / r['ms']:>9.2f}x {res['cpu']['ms'] / r['ms']:>6.2f}x {r['rss_mb']:>12.0f}")
    if load >= (os.cpu_count() or 1):
        print(f"note: load average {load:.1f} at the start: other processes shared the cores")


if __name__ == "__main__":
    main()
