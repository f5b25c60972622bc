"""Custom kernels in JAX and Pallas, called on tpu tensors and trained with torch.compile.

Two kernels: a fused softmax written in jax.numpy, and a tiled matmul written in Pallas
(on the XLA CPU plugin it runs in Pallas's interpret mode; on TPU it is a Mosaic kernel).
Both are checked against PyTorch, then used in a small classifier trained for a few steps
with ``torch.compile(backend="tpu")``; its losses are compared with the same model in
PyTorch on the CPU.

    python examples/custom_kernel.py          (needs jax: pip install 'torch-pjrt[jax]')
"""

import os
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # jax only traces kernels: keep it on the host

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

import torch_pjrt  # noqa: F401, E402  (registers the tpu device and torch.tpu.pallas)

TILE = 32


@torch.tpu.pallas.custom_jax_kernel
def fused_softmax(x):
    m = jnp.max(x, axis=-1, keepdims=True)
    e = jnp.exp(x - m)
    return e / jnp.sum(e, axis=-1, keepdims=True)


def _matmul_tile(a_ref, b_ref, o_ref):
    # One (TILE, TILE) block of the output; the k loop runs over the grid's last axis.
    @pl.when(pl.program_id(2) == 0)
    def _():
        o_ref[...] = jnp.zeros_like(o_ref)

    o_ref[...] += jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)


def pallas_matmul(a, b):
    (m, k), (_, n) = a.shape, b.shape
    return pl.pallas_call(
        _matmul_tile,
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        grid=(m // TILE, n // TILE, k // TILE),
        in_specs=[
            pl.BlockSpec((TILE, TILE), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((TILE, TILE), lambda i, j, kk: (kk, j)),
        ],
        out_specs=pl.BlockSpec((TILE, TILE), lambda i, j, kk: (i, j)),
    )(a, b)


def _matmul_backward(args, g):
    # JAX cannot differentiate a pallas_call: the gradients are two more tiled matmuls.
    a, b = args
    return pallas_matmul(g, b.T), pallas_matmul(a.T, g)


matmul = torch.tpu.pallas.custom_jax_kernel(
    pallas_matmul, name="pallas_matmul", backward=_matmul_backward
)


class Classifier(torch.nn.Module):
    def __init__(self, use_kernels):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(64, 64) / 8)
        self.w2 = torch.nn.Parameter(torch.randn(64, 32) / 8)
        self.use_kernels = use_kernels

    def forward(self, x):
        mm = matmul if self.use_kernels else torch.matmul
        h = torch.relu(mm(x, self.w1))
        logits = mm(h, self.w2)
        # The kernel's probabilities against the labels (a hand-written NLL on them).
        probs = fused_softmax(logits) if self.use_kernels else torch.softmax(logits, -1)
        return probs


def main():
    warnings.simplefilter("ignore", UserWarning)  # the interpret-mode note on CPU
    torch.manual_seed(0)
    x = torch.randn(64, 96)
    y = torch.randn(96, 64)
    print("softmax  max |tpu - torch|:",
          (fused_softmax(x.to("tpu")).cpu() - torch.softmax(x, -1)).abs().max().item())
    print("matmul   max |tpu - torch|:",
          (matmul(x.to("tpu"), y.to("tpu")).cpu() - x @ y).abs().max().item())

    cpu = Classifier(use_kernels=False)
    tpu = Classifier(use_kernels=True).to("tpu")
    tpu.load_state_dict(cpu.state_dict())
    opt_c = torch.optim.SGD(cpu.parameters(), lr=0.5)
    opt_t = torch.optim.SGD(tpu.parameters(), lr=0.5)
    step = torch.compile(tpu, backend="tpu")

    def loss_of(probs, labels):
        return -torch.log(probs.gather(1, labels[:, None]) + 1e-9).mean()

    data = [(torch.randn(64, 64), torch.randint(0, 32, (64,))) for _ in range(5)]
    for i, (xb, lb) in enumerate(data):
        lt = loss_of(step(xb.to("tpu")), lb.to("tpu"))
        lt.backward()
        opt_t.step()
        opt_t.zero_grad()
        lc = loss_of(cpu(xb), lb)
        lc.backward()
        opt_c.step()
        opt_c.zero_grad()
        print(f"step {i}: loss tpu {lt.item():.5f}  cpu {lc.item():.5f}")
        assert abs(lt.item() - lc.item()) < 1e-4 * max(1.0, abs(lc.item()))
    print("trained with JAX and Pallas kernels inside torch.compile(backend='tpu'): OK")


if __name__ == "__main__":
    main()
