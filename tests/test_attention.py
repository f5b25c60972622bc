"""scaled_dot_product_attention and rms_norm as one op each on tpu (PyTorch's fused entry
for backends, `_fused_rms_norm`), forward and backward against the CPU, and the cases that
keep PyTorch's math path with PyTorch's errors."""

import pytest
import torch
import torch.nn.functional as F

import torch_pjrt

FUSED = "aten::_scaled_dot_product_fused_attention_overrideable"


def _calls(op):
    return torch_pjrt.metrics()["ops"].get(op, (0, 0))[0]


def _sdpa_both(shapes, dtype=torch.float32, grad=True, mask=None, **kw):
    """Runs sdpa on the CPU and on tpu from the same values; returns (cpu, tpu) outputs and
    the gradients of q, k, v (and of the mask when it requires them)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=gen, dtype=dtype) for s in shapes)
    res = []
    for dev in ("cpu", "tpu"):
        xs = [x.detach().to(dev).requires_grad_(grad) for x in (q, k, v)]
        m = None
        if mask is not None:
            m = mask.to(dev)
            if mask.requires_grad:
                m = m.detach().requires_grad_()
        out = F.scaled_dot_product_attention(*xs, attn_mask=m, **kw)
        grads = []
        if grad:
            g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
            out.backward(g.to(dev))
            grads = [x.grad.cpu() for x in xs] + ([m.grad.cpu()] if m is not None and
                                                  m.requires_grad else [])
        res.append((out.detach().cpu(), grads))
    return res


CASES = {
    "plain": dict(shapes=[(2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 8)]),
    "causal": dict(shapes=[(2, 4, 5, 8)] * 3, is_causal=True),
    "causal_longer_keys": dict(shapes=[(2, 4, 3, 8), (2, 4, 7, 8), (2, 4, 7, 8)],
                               is_causal=True),
    "bool_mask": dict(shapes=[(2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 8)],
                      mask=torch.rand(5, 7, generator=torch.Generator().manual_seed(2)) > 0.3),
    "float_mask_3d": dict(shapes=[(2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 8)],
                          mask=torch.randn(1, 5, 7)),
    "mask_grad": dict(shapes=[(2, 4, 5, 8)] * 3,
                      mask=torch.randn(2, 1, 5, 5).requires_grad_()),
    "grouped_heads": dict(shapes=[(2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8)], enable_gqa=True),
    "scale": dict(shapes=[(2, 4, 5, 8)] * 3, scale=0.3),
    "three_dims": dict(shapes=[(4, 5, 8), (4, 7, 8), (4, 7, 8)]),
    "bfloat16": dict(shapes=[(2, 4, 5, 8)] * 3, dtype=torch.bfloat16),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_sdpa_runs_fused_and_matches_cpu(name):
    case = dict(CASES[name])
    torch_pjrt.reset_metrics()
    (want, wgrads), (got, ggrads) = _sdpa_both(**case)
    tol = dict(atol=2e-2, rtol=2e-2) if case.get("dtype") == torch.bfloat16 else {}
    torch.testing.assert_close(got, want, **tol)
    for g, w in zip(ggrads, wgrads, strict=True):
        torch.testing.assert_close(g, w, **tol)
    assert _calls(FUSED) == 1 and _calls(FUSED + "_backward") == 1
    assert torch_pjrt.metrics()["fallback_calls"] == 0


@pytest.mark.parametrize("kw", [
    dict(dropout_p=0.5),                                    # no random state in the fused op
    dict(shapes=[(2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 16)]),  # value head size differs
    dict(dtype=torch.float64),
])
def test_sdpa_outside_the_fused_entry_takes_the_math_path(kw):
    kw = dict(kw)
    shapes = kw.pop("shapes", [(2, 4, 5, 8)] * 3)
    dtype = kw.pop("dtype", torch.float32)
    torch_pjrt.reset_metrics()
    q, k, v = (torch.randn(s, dtype=dtype, device="tpu") for s in shapes)
    torch.manual_seed(0)
    F.scaled_dot_product_attention(q, k, v, **kw).cpu()
    assert _calls(FUSED) == 0
    assert torch_pjrt.metrics()["fallback_calls"] == 0


@pytest.mark.parametrize("shapes, kw", [
    # Grouped heads without enable_gqa. (Key and value lengths that differ raise on tpu; the
    # CPU's flash kernel reads past the shorter one and returns a result.)
    ([(2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8)], {}),
    ([(2, 4, 5, 8)] * 3, dict(is_causal=True, attn_mask=torch.ones(5, 5, dtype=torch.bool))),
])
def test_sdpa_bad_input_raises_the_cpus_error(shapes, kw):
    def call(dev):
        xs = [torch.zeros(s, device=dev) for s in shapes]
        args = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        with pytest.raises(Exception) as e:
            F.scaled_dot_product_attention(*xs, **args).cpu()
        return e

    cpu, tpu = call("cpu"), call("tpu")
    assert type(tpu.value) is type(cpu.value)
    assert str(tpu.value).splitlines()[0] == str(cpu.value).splitlines()[0]


def test_sdpa_math_backend_context_is_respected():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(2, 4, 5, 8, device="tpu")
    torch_pjrt.reset_metrics()
    with sdpa_kernel([SDPBackend.MATH]):
        F.scaled_dot_product_attention(q, q, q).cpu()
    assert _calls(FUSED) == 0


def test_sdpa_compiled_graph_holds_the_fused_op():
    f = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True).sum(),
                      backend="tpu")
    q = torch.randn(2, 4, 6, 8)
    torch.testing.assert_close(f(q.to("tpu")).cpu(),
                               F.scaled_dot_product_attention(q, q, q, is_causal=True).sum())
    text = torch_pjrt.export_stablehlo(
        lambda q: F.scaled_dot_product_attention(q, q, q), q.to("tpu"))
    # One attention op lowered whole: the math path's safe-softmax checks are absent.
    assert "stablehlo.dot_general" in text and text.count("func.func") <= 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight", [True, False])
def test_rms_norm_is_one_op_and_matches_cpu(dtype, weight):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, dtype=dtype)
    w = torch.randn(16, dtype=dtype) if weight else None
    xt = x.to("tpu").requires_grad_()
    wt = w.to("tpu").requires_grad_() if weight else None
    torch_pjrt.reset_metrics()
    got = F.rms_norm(xt, (16,), wt, eps=1e-6)
    got.sum().backward()
    assert _calls("aten::_fused_rms_norm") == 1
    assert _calls("aten::_fused_rms_norm_backward") == 1
    xc = x.clone().requires_grad_()
    wc = w.clone().requires_grad_() if weight else None
    want = F.rms_norm(xc, (16,), wc, eps=1e-6)
    want.sum().backward()
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(got.detach().cpu(), want.detach(), **tol)
    torch.testing.assert_close(xt.grad.cpu(), xc.grad, **tol)
    if weight:
        torch.testing.assert_close(wt.grad.cpu(), wc.grad, **tol)


@pytest.mark.usefixtures("shape_buckets")
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_under_dynamic_shapes_stays_fused(causal):
    """torch.compile(dynamic=True): symbolic lengths keep the fused entry where the shapes fit
    for every length (the same symbol for q's and k's length). With shape buckets on, the
    lengths after the first run the graph's ops eagerly, which the op counts show."""

    def f(q, k):
        return F.scaled_dot_product_attention(q, k, k, is_causal=causal)

    cf = torch.compile(f, backend="tpu", dynamic=True)
    torch_pjrt.reset_metrics()
    for t in (5, 6, 7):
        gen = torch.Generator().manual_seed(t)
        q, k = (torch.randn(2, 4, t, 8, generator=gen) for _ in range(2))
        qt, kt = (x.to("tpu").requires_grad_() for x in (q, k))
        qc, kc = (x.clone().requires_grad_() for x in (q, k))
        out, want = cf(qt, kt), f(qc, kc)
        torch.testing.assert_close(out.cpu(), want.detach())
        out.sum().backward()
        want.sum().backward()
        torch.testing.assert_close(qt.grad.cpu(), qc.grad)
        torch.testing.assert_close(kt.grad.cpu(), kc.grad)
    assert torch_pjrt.metrics()["compile"]["bucketed_graph_calls"] == 4
    assert _calls(FUSED) >= 2 and _calls("aten::isneginf") == 0
