"""Complex numbers and FFTs on tpu, against the CPU: creation and copies, view_as_real /
view_as_complex as views sharing storage, the lazy conjugate bit, complex math, products,
reductions, every torch.fft function with its norm modes, stft/istft, gradients, and a
Llama-style RoPE (view_as_complex) trained with no CPU fallback. The OpInfo sweep
(tests/test_opinfo.py, complex64) covers the ops one by one."""

import pytest
import torch
import torch.nn as nn
from conftest import fallbacks

import torch_pjrt


def close(actual, expected, rtol=1e-5, atol=1e-5):
    torch.testing.assert_close(actual.cpu(), expected, rtol=rtol, atol=atol)


def rand(*shape, dtype=torch.complex64, seed=0):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_creation_copies_and_conversions(dtype):
    x = rand(3, 4, dtype=dtype)
    t = x.to("tpu")
    assert t.dtype == dtype and t.device.type == "tpu"
    close(t, x)
    close(torch.zeros(2, 3, dtype=dtype, device="tpu"), torch.zeros(2, 3, dtype=dtype))
    close(torch.full((2,), 1 - 2j, device="tpu"), torch.full((2,), 1 - 2j))
    close(x.real.to("tpu").to(dtype), x.real.to(dtype))  # real -> complex
    close(t.to(torch.complex128 if dtype == torch.complex64 else torch.complex64),
          x.to(torch.complex128 if dtype == torch.complex64 else torch.complex64))
    close(t * 1j + 2, x * 1j + 2)
    assert t[1, 2].item() == x[1, 2].item()


def test_complex32_is_refused_clearly():
    with pytest.raises(NotImplementedError, match="ComplexHalf"):
        torch.zeros(2, dtype=torch.complex32, device="tpu")


def test_view_as_real_and_complex_share_storage():
    x = rand(4, 3)
    t = x.to("tpu")
    r = torch.view_as_real(t)
    assert r.shape == (4, 3, 2) and r.dtype == torch.float32
    assert r.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    r[..., 1].mul_(-2)  # writes through the view
    expected = x.clone()
    torch.view_as_real(expected)[..., 1].mul_(-2)
    close(t, expected)
    c = torch.view_as_complex(r)
    assert c.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    c.add_(1 + 1j)
    expected.add_(1 + 1j)
    close(t, expected)
    close(t.real, expected.real)
    close(t.imag, expected.imag)
    t.imag.zero_()
    expected.imag.zero_()
    close(t, expected)


def test_lazy_conjugate_bit():
    x, y = rand(3, 4), rand(4, 5, seed=1)
    t, u = x.to("tpu"), y.to("tpu")
    c = t.conj()
    assert c.is_conj()
    close(c, x.conj())
    close(c @ u, x.conj() @ y)  # mm sees the bit
    close(c + 1, x.conj() + 1)
    close(c.resolve_conj(), x.conj().resolve_conj())
    close(torch.conj_physical(t), torch.conj_physical(x))
    close(torch.vdot(t[0], t[1]), torch.vdot(x[0], x[1]))
    close(torch.dot(t[0], t[1].conj()), torch.dot(x[0], x[1].conj()))
    d = torch.empty_like(t).conj()  # a conjugate destination
    d.copy_(t)
    close(d, x)


@pytest.mark.parametrize("f", [
    torch.exp, torch.log, torch.sqrt, torch.rsqrt, torch.sin, torch.cos, torch.tan,
    torch.tanh, torch.sigmoid, torch.reciprocal, torch.abs, torch.angle, torch.sgn,
    torch.isnan, torch.isfinite, lambda z: z * z.conj(), lambda z: z / (z + 1),
    lambda z: z ** 2.5, lambda z: torch.polar(z.abs(), z.angle()),
    lambda z: torch.complex(z.real.contiguous(), z.imag.contiguous()),
], ids=lambda f: getattr(f, "__name__", "lambda"))
def test_elementwise(f):
    x = rand(5, 6)
    close(f(x.to("tpu")), f(x))


def test_products_and_reductions():
    a, b, v = rand(2, 3, 4), rand(2, 4, 5, seed=1), rand(4, seed=2)
    ta, tb, tv = a.to("tpu"), b.to("tpu"), v.to("tpu")
    close(ta @ tb, a @ b)
    close(ta @ tv, a @ v)
    close(torch.addmm(ta[0] @ tb[0], ta[1], tb[1], beta=0.5j, alpha=2 - 1j),
          torch.addmm(a[0] @ b[0], a[1], b[1], beta=0.5j, alpha=2 - 1j))
    close(torch.einsum("bij,bjk->bik", ta, tb), torch.einsum("bij,bjk->bik", a, b))
    for f in (lambda z: z.sum(), lambda z: z.sum(1), lambda z: z.mean(-1), lambda z: z.prod(0),
              lambda z: z.cumsum(2), lambda z: z.var(1), lambda z: z.std(),
              lambda z: torch.linalg.vector_norm(z, dim=-1), lambda z: z.norm()):
        close(f(ta), f(a), rtol=1e-4, atol=1e-4)


NORMS = [None, "forward", "backward", "ortho"]


@pytest.mark.parametrize("norm", NORMS)
def test_fft_family(norm):
    x = rand(4, 6, 8)
    r = x.real.contiguous()
    t, tr = x.to("tpu"), r.to("tpu")
    fft = torch.fft
    cases = [
        (fft.fft, t, x, {}), (fft.ifft, t, x, {}), (fft.fft, t, x, {"n": 5, "dim": 1}),
        (fft.fft2, t, x, {}), (fft.ifft2, t, x, {}), (fft.fftn, t, x, {}),
        (fft.ifftn, t, x, {"dim": (0, 2)}), (fft.rfft, tr, r, {}), (fft.rfft, tr, r, {"n": 11}),
        (fft.irfft, t, x, {}), (fft.irfft, t, x, {"n": 9}), (fft.rfft2, tr, r, {}),
        (fft.irfft2, t, x, {}), (fft.rfftn, tr, r, {}), (fft.irfftn, t, x, {"s": (4, 6, 10)}),
        (fft.hfft, t, x, {}), (fft.ihfft, tr, r, {}), (fft.hfft2, t, x, {}),
        (fft.ihfftn, tr, r, {}),
    ]
    for f, dev, cpu, kw in cases:
        close(f(dev, norm=norm, **kw), f(cpu, norm=norm, **kw), rtol=1e-4, atol=1e-4)
    close(fft.fftshift(t), fft.fftshift(x))
    close(fft.ifftshift(t, dim=1), fft.ifftshift(x, dim=1))
    close(fft.fftfreq(8, device="tpu"), fft.fftfreq(8))


def test_fft_gradients():
    x = rand(3, 8)
    r = x.real.contiguous()

    def grads(dev):
        a = x.to(dev).requires_grad_()
        b = r.to(dev).requires_grad_()
        y = (torch.fft.fft(a, norm="ortho") * torch.fft.rfft(b, n=14).sum()).abs().sum()
        y = y + torch.fft.irfft(a, n=10).pow(2).sum() + torch.fft.fft2(a).real.sum()
        return torch.autograd.grad(y, (a, b))

    for g, e in zip(grads("tpu"), grads("cpu"), strict=True):
        close(g, e, rtol=1e-4, atol=1e-4)


def test_stft_and_istft():
    sig = torch.randn(2, 400, generator=torch.Generator().manual_seed(0))
    win = torch.hann_window(64)
    kw = {"n_fft": 64, "hop_length": 16, "window": win, "return_complex": True}
    spec = torch.stft(sig, **kw)
    tspec = torch.stft(sig.to("tpu"), **{**kw, "window": win.to("tpu")})
    close(tspec, spec, rtol=1e-4, atol=1e-4)
    back = torch.istft(spec, n_fft=64, hop_length=16, window=win, length=400)
    tback = torch.istft(tspec, n_fft=64, hop_length=16, window=win.to("tpu"), length=400)
    close(tback, back, rtol=1e-4, atol=1e-4)


def rope(x, freqs):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs[None, :, None, :]).flatten(3).type_as(x)


class RopeAttention(nn.Module):
    """Llama's rotary attention as its reference code writes it (view_as_complex)."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, freqs):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k = rope(q, freqs), rope(k, freqs)
        y = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def freqs_cis(t, head_dim):
    f = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return torch.polar(torch.ones(t, head_dim // 2), torch.outer(torch.arange(t).float(), f))


def test_rope_model_trains_without_fallback():
    def train(dev):
        torch.manual_seed(0)
        m = RopeAttention().to(dev)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1)).to(dev)
        fc = freqs_cis(8, 8).to(dev)
        losses = []
        for _ in range(10):
            loss = m(x, fc).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [p.detach().cpu() for p in m.parameters()]

    cpu_losses, cpu_params = train("cpu")
    torch_pjrt.reset_metrics()
    tpu_losses, tpu_params = train("tpu")
    assert not fallbacks(), f"fell back: {fallbacks()}"
    torch.testing.assert_close(torch.tensor(tpu_losses), torch.tensor(cpu_losses), rtol=1e-4,
                               atol=1e-6)
    # Adam divides by the gradient's own scale: the rounding of near-zero gradients moves a
    # weight by a fraction of lr (1e-2), hence atol 1e-4.
    for p, q in zip(tpu_params, cpu_params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4)
