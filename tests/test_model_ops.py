"""Ops that real models call and the zoo found running on the CPU fallback or failing:
each native, against the CPU."""

import copy

import pytest
import torch
from conftest import assert_close, fallbacks

import torch_pjrt


@pytest.mark.parametrize("dim,shape", [(0, (6, 4, 3)), (2, (5, 4, 7)), (1, (8, 3)), (0, (9,))])
def test_weight_norm_trains_like_the_cpu(eager_mode, dim, shape, seed):
    # torch.nn.utils.parametrizations.weight_norm (wav2vec2's positional convolution)
    # reaches _weight_norm_interface and its backward on any device.
    v = torch.randn(shape, requires_grad=True)
    g_shape = [1] * len(shape)
    g_shape[dim] = shape[dim]
    g = (torch.rand(g_shape) + 0.5).requires_grad_()
    w_out = torch.randn(shape)

    def run(v, g):
        w = torch._weight_norm(v, g, dim)
        (w * w_out.to(w.device)).sum().backward()
        return w.detach(), v.grad, g.grad

    vt, gt = (t.detach().to("tpu").requires_grad_() for t in (v, g))
    torch_pjrt.reset_metrics()
    got = run(vt, gt)
    assert not fallbacks(), fallbacks()
    assert torch_pjrt.metrics()["ops"].get("aten::_weight_norm_interface", (0, 0))[0] == 1
    assert_close(got, run(v, g), atol=1e-5, rtol=1e-5)


def test_weight_norm_norms_are_float32_for_bfloat16(seed):
    v = torch.randn(4, 3, dtype=torch.bfloat16)
    g = torch.rand(4, 1, dtype=torch.bfloat16) + 0.5
    w, n = torch._weight_norm_interface(v.to("tpu"), g.to("tpu"), 0)
    ew, en = torch._weight_norm_interface(v, g, 0)
    assert (w.dtype, n.dtype) == (ew.dtype, en.dtype) == (torch.bfloat16, torch.float32)
    assert_close((w, n), (ew, en), atol=1e-2, rtol=1e-2)


def test_weight_norm_module_in_a_conv(eager_mode, seed):
    conv = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(4, 4, 3, padding=1), dim=2)
    x = torch.randn(2, 4, 9)
    tconv = copy.deepcopy(conv).to("tpu")
    torch_pjrt.reset_metrics()
    tconv(x.to("tpu")).sum().backward()
    assert not fallbacks(), fallbacks()
    conv(x).sum().backward()
    assert_close([p.grad for p in tconv.parameters()], [p.grad for p in conv.parameters()],
                 atol=1e-5, rtol=1e-5)


def _mha_case(mask, need_weights, average, seed=0):
    torch.manual_seed(seed)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(3, 5, 16)
    kw = {"need_weights": need_weights, "average_attn_weights": average}
    if mask == "padding":
        kw["key_padding_mask"] = torch.tensor([[False] * 5, [False] * 3 + [True] * 2,
                                               [True] * 5])
    elif mask == "causal":
        kw["attn_mask"] = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
    elif mask == "both":
        kw["key_padding_mask"] = torch.tensor([[False] * 4 + [True]] * 3)
        kw["attn_mask"] = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
    return mha, x, kw


@pytest.mark.parametrize("mask", [None, "padding", "causal", "both"])
@pytest.mark.parametrize("need_weights,average", [(False, True), (True, True), (True, False)])
def test_multihead_attention_fast_path(eager_mode, mask, need_weights, average):
    # In eval mode without grad nn.MultiheadAttention calls _native_multi_head_attention on
    # tpu, as on CUDA (torchvision's ViT, nn.TransformerEncoder users).
    mha, x, kw = _mha_case(mask, need_weights, average)
    tmha = copy.deepcopy(mha).to("tpu")
    tkw = {k: v.to("tpu") if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    with torch.no_grad():
        torch_pjrt.reset_metrics()
        xt = x.to("tpu")
        got = tmha(xt, xt, xt, **tkw)
        assert not fallbacks(), fallbacks()
        assert torch_pjrt.metrics()["ops"].get("aten::_native_multi_head_attention", (0, 0))[0]
        want = mha(x, x, x, **kw)
    assert (got[1] is None) == (want[1] is None)
    assert_close([t for t in got if t is not None], [t for t in want if t is not None],
                 atol=1e-5, rtol=1e-5)


def test_torchvision_style_encoder_block(seed):
    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True,
                                             norm_first=True).eval()
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        got = copy.deepcopy(layer).to("tpu")(x.to("tpu"))
        assert_close(got, layer(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask_type,shape", [(0, (5, 5)), (1, (3, 5)), (2, (3, 4, 5, 5))])
def test_native_multi_head_attention_with_a_bool_mask(mask_type, shape, seed):
    mha, x, _ = _mha_case(None, True, True)
    mask = torch.rand(shape) > 0.6
    mask[..., 0] = False  # no row masked entirely (the CPU kernel's result there is its own)
    args = (x, x, x, 16, 4, mha.in_proj_weight.detach(), mha.in_proj_bias.detach(),
            mha.out_proj.weight.detach(), mha.out_proj.bias.detach(), mask, True, False, mask_type)
    torch_pjrt.reset_metrics()
    got = torch._native_multi_head_attention(
        *[a.to("tpu") if isinstance(a, torch.Tensor) else a for a in args])
    assert not fallbacks(), fallbacks()
    assert_close(got, torch._native_multi_head_attention(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "value,msg,want",
    [
        (torch.tensor(True), None, None),
        (torch.tensor(2.5), "unused", None),
        (torch.tensor(0), None, "Expected Tensor with single nonzero value, but got zero"),
        (torch.tensor([0.0]), "grid not divisible", "grid not divisible"),
        (torch.tensor(False), "", "Assertion is failed"),
        (torch.ones(2), None, "with more than one value is ambiguous"),
        (torch.ones(0), None, "with no values is ambiguous"),
    ],
)
def test_assert_async_raises_as_on_the_cpu(eager_mode, value, msg, want):
    # timm's gemma4 ViT asserts a property of its grid with torch._assert_async.
    args = () if msg is None else (msg,)
    torch_pjrt.reset_metrics()
    for x in (value, value.to("tpu")):
        if want is None:
            torch._assert_async(x, *args)
        else:
            with pytest.raises(RuntimeError, match=want):
                torch._assert_async(x, *args)
    assert fallbacks() == {}


# torch._grouped_mm's four layouts (mixture-of-experts layers: tokens sorted by expert,
# `offs` the cumulative ends of each expert's rows), with empty and full groups.
GROUPED = {
    "2d-3d": ((10, 8), (3, 8, 8), [2, 7, 10]),
    "2d-3d-empty-groups": ((10, 8), (4, 8, 8), [0, 6, 6, 10]),
    "3d-2d": ((3, 4, 8), (8, 16), [4, 8, 16]),
    "2d-2d": ((4, 16), (16, 8), [5, 5, 16]),
    "3d-3d": ((3, 4, 8), (3, 8, 8), None),
}


@pytest.mark.parametrize("case", GROUPED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_forward_and_backward(eager_mode, case, dtype, seed):
    sa, sb, offs = GROUPED[case]
    a, b = torch.randn(sa).to(dtype), torch.randn(sb).to(dtype)
    offs = None if offs is None else torch.tensor(offs, dtype=torch.int32)
    w_out = torch.randn(torch._grouped_mm(a, b, offs=offs).shape).to(dtype)

    def run(a, b, offs):
        a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
        y = torch._grouped_mm(a, b, offs=offs)
        (y.float() * w_out.to(y.device).float()).sum().backward()
        return y.detach(), a.grad, b.grad

    want = run(a, b, offs)
    torch_pjrt.reset_metrics()
    got = run(a.to("tpu"), b.to("tpu"), None if offs is None else offs.to("tpu"))
    m = torch_pjrt.metrics()
    assert not fallbacks(), fallbacks()
    # Native: no per-group slicing on the host, so no read of the offsets (shape buckets may
    # stage the inputs of other ops through the host: bucket_host_bytes).
    read = m["device_to_host_bytes"] - m["bucket_host_bytes"]
    assert m["ops"]["aten::_grouped_mm"][0] == 3 and read == 0, (read, m["ops"])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "sa,sb,offs,kw,want",
    [
        ((4, 8), (2, 8, 8), None, {}, "Have to provide offsets if there is a 2d matrix"),
        ((2, 4, 8), (2, 8, 8), [4, 8], {}, "Have to provide offsets if there is a 2d matrix"),
        ((4, 8), (2, 8, 8), [[2, 4]], {}, "offs has to be 1D"),
        ((4, 8), (2, 8, 8), "long", {}, "Offsets have to be int32"),
        ((4, 8), (3, 8, 8), [2, 4], {}, "matrix batch sizes have to match"),
        ((4, 8), (2, 16, 8), [2, 4], {}, "contraction dimension of mat_a and mat_b must match"),
        ((4,), (2, 8, 8), [2, 4], {}, "mat_a has to be 2 or 3d"),
        ((4, 8), (2, 8, 8), [2, 4], {"out_dtype": torch.bfloat16}, "output dtype must match"),
        ((4, 8), (2, 8, 8), [2, 4], {"bias": "zeros"}, "Bias not supported yet"),
    ],
)
def test_grouped_mm_errors_match_the_cpu(sa, sb, offs, kw, want):
    a, b = torch.randn(sa), torch.randn(sb)
    if offs == "long":
        offs = torch.tensor([2, 4])
    elif offs is not None:
        offs = torch.tensor(offs, dtype=torch.int32)
    kw = dict(kw)
    if kw.get("bias") == "zeros":
        kw["bias"] = torch.zeros(8)
    for dev in ("cpu", "tpu"):
        args = {"offs": offs, **kw}
        args = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        with pytest.raises(RuntimeError, match=want):
            torch._grouped_mm(a.to(dev), b.to(dev), **args)


def test_lapack_style_results_are_column_major_as_on_the_cpu(eager_mode, seed):
    # PyTorch lays these results out column-major; torch.compile plans views on that.
    a = torch.randn(2, 5, 5).triu() + 5 * torch.eye(5)
    b = torch.randn(2, 5, 3)
    calls = {
        "solve_triangular": lambda a, b: torch.linalg.solve_triangular(a, b, upper=True),
        "lstsq": lambda a, b: torch.linalg.lstsq(a, b).solution,
        "geqrf": lambda a, b: torch.geqrf(a)[0],
        "householder_product": lambda a, b: torch.linalg.householder_product(a, b[..., 0]),
    }
    for name, fn in calls.items():
        want = fn(a, b)
        got = fn(a.to("tpu"), b.to("tpu"))
        assert got.stride() == want.stride(), (name, got.stride(), want.stride())
        assert_close(got, want, atol=1e-4, rtol=1e-4)
