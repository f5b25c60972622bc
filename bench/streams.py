"""Streams: a training loop that copies its next batch on a side stream while the current
step runs (the prefetch idiom), against the same loop copying on the default stream.

Strict mode. The batch is large next to the model, so that its copy is a sizeable part of
the step. Reports per step: the copy alone, the step on device-resident data, the loop
copying on the default stream ("serial"), the loop prefetching on a side stream, and the
share of the copy time the prefetch hides: (serial - prefetch) / copy. Medians over blocks,
with their range. Prints ratios; no thresholds.
"""

import argparse
import os
import statistics
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import torch_pjrt  # noqa: E402, F401

BATCH, FEATURES, HIDDEN = 256, 8192, 64
STEPS = 8  # steps per block


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    warmup, reps = (2, 5) if a.quick else (3, 15)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10)).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    # Distinct host batches (a data loader's output), pinned as a loader would pin them.
    host = [(torch.randn(BATCH, FEATURES).pin_memory(), torch.randint(0, 10, (BATCH,)))
            for _ in range(STEPS + 1)]
    side = torch.tpu.Stream()
    sync = torch.tpu.synchronize

    def train_step(x, y):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    def copies():
        for x, y in host[:STEPS]:
            x.to("tpu"), y.to("tpu")

    resident = [(x.to("tpu"), y.to("tpu")) for x, y in host[:STEPS]]

    def compute():
        for x, y in resident:
            train_step(x, y)

    def serial():
        for x, y in host[:STEPS]:
            train_step(x.to("tpu"), y.to("tpu"))

    def prefetch():
        with torch.tpu.stream(side):
            nxt = (host[0][0].to("tpu", non_blocking=True), host[0][1].to("tpu", non_blocking=True))
        for i in range(STEPS):
            torch.tpu.current_stream().wait_stream(side)
            cur = nxt
            with torch.tpu.stream(side):
                hx, hy = host[i + 1]
                nxt = (hx.to("tpu", non_blocking=True), hy.to("tpu", non_blocking=True))
            train_step(*cur)

    res = {}
    for name, fn in (("copy", copies), ("step", compute), ("serial", serial),
                     ("prefetch", prefetch)):
        t = harness.block_times(fn, sync, warmup, reps, 1)
        res[name] = [v / STEPS for v in t]
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"prefetch on a side stream, Strict ({harness.describe()})")
    print(f"batch {BATCH}x{FEATURES} float32 ({BATCH * FEATURES * 4 / 2**20:.0f} MiB), "
          f"MLP {FEATURES}-{HIDDEN}-10, SGD")
    print(f"{'per step':<22} {'ms':>8} {'range':>15}")
    labels = {"copy": "copy alone", "step": "step, data on device",
              "serial": "loop, default stream", "prefetch": "loop, side-stream prefetch"}
    for k, v in res.items():
        print(f"{labels[k]:<22} {med[k]:>8.2f} {min(v):>7.2f}-{max(v):<7.2f}")
    hidden = (med["serial"] - med["prefetch"]) / med["copy"]
    print(f"copy / step: {med['copy'] / med['serial']:.2f}; prefetch hides {hidden:.0%} of the "
          f"copy time; prefetch loop {med['serial'] / med['prefetch']:.2f}x faster")


if __name__ == "__main__":
    main()
