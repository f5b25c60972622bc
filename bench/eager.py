"""Eager-mode speed of the tpu device, each figure as a ratio to PyTorch CPU eager in the same run.

    python bench/eager.py           # well under a minute on a quiet 2-core machine
    python bench/eager.py --quick   # fewer repetitions

(a) tiny op: ``x + y`` on 16 floats, a loop of N ops synchronized once at its end (µs/op);
(b) MLP training step and (c) GPT training step (bench/models.py), each step ending with
``loss.item()``, timed as blocks of BLOCK back-to-back steps ending with
``torch.tpu.synchronize()`` (``.item()`` waits for the loss only: the optimizer update may
still be queued, and would run in the CPU's turn). Times are medians over warm repetitions
after warm-up, CPU and tpu repetitions interleaved so that both see the same load; "first"
is the first step alone (compilation included, unless the programs are already cached). No thresholds: this measures, it does not judge.
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import models  # noqa: E402

import torch_pjrt  # noqa: E402

DEVICES = ("cpu", "tpu")


def sync(device):
    if device != "cpu":
        torch.tpu.synchronize()


def tiny_op(n):
    """Per device: a function timing a loop of ``n`` ``x + y`` ops (µs/op)."""

    def make(device):
        x = torch.randn(16).to(device)
        y = torch.randn(16).to(device)

        def run():
            t = time.perf_counter()
            for _ in range(n):
                x + y
            sync(device)
            return (time.perf_counter() - t) / n * 1e6

        return run

    return make


BLOCK = 3


def train_step(make_step):
    """Per device: a function timing training steps (ms per step): its first call one step,
    later calls BLOCK steps."""

    def make(device):
        step = make_step(device)
        calls = []

        def run():
            n = BLOCK if calls else 1
            calls.append(n)
            t = time.perf_counter()
            for _ in range(n):
                step()
            sync(device)
            return (time.perf_counter() - t) * 1e3 / n

        return run

    return make


def measure(make, warmup, reps):
    """{device: (median, first)}: the first call, ``warmup`` calls, then ``reps`` interleaved."""
    runs, first, times = {}, {}, {d: [] for d in DEVICES}
    for d in DEVICES:
        runs[d] = make(d)
        first[d] = runs[d]()
        for _ in range(warmup):
            runs[d]()
    harness.settle()
    for _ in range(reps):
        for d in DEVICES:
            times[d].append(runs[d]())
    return {d: (statistics.median(times[d]), first[d]) for d in DEVICES}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = p.parse_args()
    n, op_reps, warmup, step_reps = (200, 3, 2, 5) if args.quick else (2000, 7, 5, 20)

    benches = [
        ("tiny x + y", "us/op", tiny_op(n), op_reps),
        ("MLP step", "ms", train_step(models.mlp_step), step_reps),
        ("GPT step", "ms", train_step(models.gpt_step), step_reps),
    ]
    load = os.getloadavg()[0]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, "
        f"tpu = PJRT {torch.tpu.get_device_name()} plugin; "
        f"load average {load:.1f} on {os.cpu_count()} cores"
    )
    header = (
        f"{'config':<12} {'unit':<6} {'CPU eager':>10} {'tpu':>10} {'tpu/CPU':>8}"
        f" {'first step (ms) CPU / tpu':>26} {'fallbacks':>10}"
    )
    print(header)
    print("-" * len(header))
    for name, unit, make, reps in benches:
        torch_pjrt.reset_metrics()
        r = measure(make, warmup, reps)
        fallbacks = torch_pjrt.metrics()["fallback_calls"]
        (cpu, cpu_first), (tpu, tpu_first) = r["cpu"], r["tpu"]
        first = f"{cpu_first:.1f} / {tpu_first:.1f}" if unit == "ms" else "-"
        print(
            f"{name:<12} {unit:<6} {cpu:>10.2f} {tpu:>10.2f} {tpu / cpu:>7.2f}x"
            f" {first:>26} {fallbacks:>10}",
            flush=True,
        )
    if load >= (os.cpu_count() or 1):
        # Contention hurts CPU eager (OpenMP threads wait on each other) far more than tpu.
        print(f"note: load average {load:.1f} at the start: other processes shared the cores")


if __name__ == "__main__":
    main()
