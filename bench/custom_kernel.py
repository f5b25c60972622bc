"""Custom kernels: what calling an already traced JAX kernel costs, against the same
computation written with ATen ops on tpu, and a fused softmax kernel against torch.softmax.

Strict mode (each call one queued program). Per call, medians over blocks with their range:
- a trivial kernel (x + 1) against ``x + 1`` (one ATen op): the call overhead;
- a softmax written in JAX against ``torch.softmax`` on tpu and on the CPU.
Prints ratios; no thresholds. Target: a traced kernel's call costs no more than one ATen op.
"""

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

import torch_pjrt  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    warmup, reps, block = (20, 5, 200) if a.quick else (50, 15, 500)
    import jax
    import jax.numpy as jnp

    P = torch.tpu.pallas

    @P.custom_jax_kernel
    def plus_one(x):
        return x + 1

    @P.custom_jax_kernel
    def softmax(x):
        m = jnp.max(x, axis=-1, keepdims=True)
        e = jnp.exp(x - m)
        return e / jnp.sum(e, axis=-1, keepdims=True)

    del jax
    small = torch.randn(8, device="tpu")
    big = torch.randn(256, 1024)
    big_t = big.to("tpu")
    assert torch.allclose(softmax(big_t).cpu(), torch.softmax(big, -1), atol=1e-6)
    sync = torch.tpu.synchronize

    def cpu_sync():
        pass

    cases = [
        ("kernel x + 1", lambda: plus_one(small), sync),
        ("aten x + 1", lambda: small + 1, sync),
        ("kernel softmax 256x1024", lambda: softmax(big_t), sync),
        ("torch.softmax tpu", lambda: torch.softmax(big_t, -1), sync),
        ("torch.softmax cpu", lambda: torch.softmax(big, -1), cpu_sync),
    ]
    # Warm: every program compiled (and its optimized tier swapped in) before measuring.
    for _, fn, s in cases:
        for _ in range(warmup):
            fn()
        s()
    harness.settle()
    torch_pjrt.reset_metrics()
    # Blocks of the cases interleaved, so that load changes hit them alike.
    res = {name: [] for name, _, _ in cases}
    for _ in range(reps):
        for name, fn, s in cases:
            res[name].extend(harness.block_times(fn, s, 0, 1, block))
    med = {k: statistics.median(v) * 1e3 for k, v in res.items()}
    print(f"custom kernels, Strict ({harness.describe()})")
    print(f"{'per call':<26} {'us':>8} {'range':>17}")
    for k, v in res.items():
        print(f"{k:<26} {med[k]:>8.1f} {min(v) * 1e3:>8.1f}-{max(v) * 1e3:<8.1f}")
    print(f"kernel call / ATen op: {med['kernel x + 1'] / med['aten x + 1']:.2f}x; "
          f"softmax kernel / torch.softmax on tpu: "
          f"{med['kernel softmax 256x1024'] / med['torch.softmax tpu']:.2f}x, "
          f"/ on the CPU: {med['kernel softmax 256x1024'] / med['torch.softmax cpu']:.2f}x")
    print(f"compilations after warm-up: {torch_pjrt.metrics()['compilations']} "
          "(0: no JAX or XLA work per call)")


if __name__ == "__main__":
    main()
