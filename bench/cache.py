"""Time to the first finished GPT training step in a fresh process, cold vs warm disk cache.

    python bench/cache.py                 # per-op (Strict) and DeferAndFuse, about a minute
    python bench/cache.py --mode strict   # one mode only

For each mode, two fresh processes run one GPT training step (bench/models.py, AdamW, ending
with ``loss.item()``, then ``torch.tpu.synchronize()``: Strict compiles on a pool and queues
the backward and the update, which ``loss.item()`` does not wait for) against the same empty TORCH_TPU_CACHE_DIR: the first compiles every
program and stores it (cold), the second loads them all from disk (warm). "first step" is the
time from after ``import torch_pjrt`` (which the cache does not change) to the finished step:
model and optimizer creation, the uploads and the step itself. Target: warm <= 10% of cold.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import torch, torch_pjrt
sys.path.insert(0, os.environ["BENCH_DIR"])
import models
if os.environ["BENCH_MODE"] == "defer":
    torch.tpu.eager_mode = torch.tpu.EagerMode.DEFER_AND_FUSE
t1 = time.perf_counter()
loss = models.gpt_step("tpu")()
torch.tpu.synchronize()  # the whole step: backward and update too (Strict queues them)
t2 = time.perf_counter()
m = torch_pjrt.metrics()
print(json.dumps({
    "import_s": t1 - t0, "step_s": t2 - t1, "loss": loss,
    "compilations": m["compilations"], "compile_s": m["compile_seconds"],
    "disk_hits": m["disk_hits"], "load_s": m["load_seconds"],
}))
"""


def run(cache_dir, mode):
    env = {
        **os.environ,
        "TORCH_TPU_CACHE_DIR": cache_dir,
        "BENCH_DIR": os.path.dirname(os.path.abspath(__file__)),
        "BENCH_MODE": mode,
    }
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["strict", "defer", "both"], default="both")
    args = p.parse_args()
    modes = ["strict", "defer"] if args.mode == "both" else [args.mode]
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    header = (
        f"{'mode':<7} {'cache':<5} {'first step s':>12} {'import s':>9} {'compiles':>9}"
        f" {'compile s':>10} {'loads':>6} {'load s':>7} {'loss':>9}"
    )
    print(header)
    print("-" * len(header))
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix="torch_pjrt_bench_cache_") as d:
            r = {"cold": run(d, mode), "warm": run(d, mode)}
        for kind, x in r.items():
            print(
                f"{mode:<7} {kind:<5} {x['step_s']:>12.3f} {x['import_s']:>9.3f}"
                f" {x['compilations']:>9} {x['compile_s']:>10.3f} {x['disk_hits']:>6}"
                f" {x['load_s']:>7.3f} {x['loss']:>9.5f}"
            )
        ratio = r["warm"]["step_s"] / r["cold"]["step_s"]
        same = "same loss" if r["warm"]["loss"] == r["cold"]["loss"] else "LOSS DIFFERS"
        print(f"{mode:<7} warm/cold first step: {ratio:.1%} (target <= 10%), {same}", flush=True)
    load = os.getloadavg()[0]
    if load > 1.5:
        print(f"note: load average {load:.1f}: other processes share the cores, figures are noisy")


if __name__ == "__main__":
    main()
