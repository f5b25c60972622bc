"""View semantics, copies, printing, factories and dtype casts: tpu against the CPU."""

import pytest
import torch
from conftest import TPU, compare, fallbacks, to_cpu

import torch_pjrt

ALL_DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
]


def grid(*shape, dtype=torch.float32):
    """0, 1, 2, ... in `shape` on the CPU."""
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.float32).reshape(shape).to(dtype)


def same_error_as_cpu(make):
    """`make(device)` raises on the CPU; on tpu it must raise the same type and message
    (run with the fallback off, so the message is the lowering's own)."""
    errors = []
    for dev in ("cpu", "tpu"):
        with pytest.raises(Exception) as e:
            make(dev)
        errors.append((type(e.value), str(e.value)))
    assert errors[1] == errors[0]


def storage_id(t):
    # A tpu DataPtr holds an opaque handle: equal handles mean the same storage.
    return t.untyped_storage().data_ptr()


# ---------------------------------------------------------------------------
# Views share storage
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("make_view", [
    lambda x: x.view(12),
    lambda x: x[1:],
    lambda x: x.t(),
    lambda x: x[:, ::2],
    lambda x: x.unsqueeze(0),
    lambda x: x.diagonal(),
    lambda x: x.reshape(2, 6),
    lambda x: x.narrow(1, 1, 2),
    lambda x: x.select(0, 1),
    lambda x: x.unbind(1)[2],
    lambda x: x.split(1)[1],
    lambda x: x.view(torch.int32),
], ids=["view", "slice", "t", "step", "unsqueeze", "diagonal", "reshape", "narrow",
        "select", "unbind", "split", "view_dtype"])
def test_view_shares_storage(make_view):
    x = grid(3, 4).to("tpu")
    v = make_view(x)
    c = make_view(grid(3, 4))
    assert v.device.type == "tpu"
    assert v._is_view() == c._is_view()
    if c._is_view():
        assert v._base is x
    assert storage_id(v) == storage_id(x)
    assert (v.shape, v.stride(), v.storage_offset()) == (c.shape, c.stride(), c.storage_offset())
    torch.testing.assert_close(v.cpu(), c)
    # Writing the base shows through the view.
    x.add_(100)
    torch.testing.assert_close(v.cpu(), make_view(grid(3, 4) + 100))


INPLACE_THROUGH_VIEW = {
    "slice_add_": lambda x: x[1:].add_(1),
    "t_mul_": lambda x: x.t().mul_(2),
    "setitem_column": lambda x: x.__setitem__((slice(None), 0), 5),
    "view_setitem": lambda x: x.view(-1).__setitem__(3, 1),
    "step_fill_": lambda x: x[::2, 1::2].fill_(-7),
    "diagonal_zero_": lambda x: x.diagonal().zero_(),
    "transpose_slice_sub_": lambda x: x.transpose(0, 1)[1:, ::2].sub_(3),
    "select_copy_": lambda x: x.select(1, 2).copy_(torch.tensor([9.0, 8.0, 7.0], device=x.device)),
    "nested_views": lambda x: x.view(2, 6)[1].view(3, 2)[:, 1].neg_(),
    "unsqueeze_squeeze": lambda x: x.unsqueeze(0).squeeze(0)[2].mul_(10),
    "setitem_scalar_tensor": lambda x: x.__setitem__((1, 1), torch.tensor(42.0, device=x.device)),
    "setitem_broadcast": lambda x: x.__setitem__(slice(0, 2), torch.tensor([1.0, 2, 3, 4],
                                                                          device=x.device)),
    "view_as_int": lambda x: x.view(torch.int32)[0].fill_(0),
}


@pytest.mark.parametrize("fn", INPLACE_THROUGH_VIEW.values(), ids=INPLACE_THROUGH_VIEW.keys())
def test_inplace_through_view_updates_base(fn):
    def run(x):
        fn(x)
        return x

    compare(run, grid(3, 4))


def test_base_write_shows_in_existing_views():
    x = grid(4, 4).to("tpu")
    views = [x[1], x[:, 2], x.t(), x.view(16)[5:9], x.diagonal()]
    x.mul_(-1)
    x[0, 0] = 99
    c = grid(4, 4) * -1
    c[0, 0] = 99
    for v, e in zip(views, [c[1], c[:, 2], c.t(), c.view(16)[5:9], c.diagonal()], strict=True):
        torch.testing.assert_close(v.cpu(), e)


def test_views_of_views_write_through():
    x = grid(6, 4).to("tpu")
    a = x[1:5]
    b = a.t()[1:3]
    b.add_(1000)
    c = grid(6, 4)
    c[1:5].t()[1:3].add_(1000)
    torch.testing.assert_close(x.cpu(), c)
    torch.testing.assert_close(a.cpu(), c[1:5])


def test_out_into_view():
    x = grid(3, 4).to("tpu")
    torch.add(torch.ones(3, device="tpu"), 1, out=x[:, 1])
    c = grid(3, 4)
    torch.add(torch.ones(3), 1, out=c[:, 1])
    torch.testing.assert_close(x.cpu(), c)


# ---------------------------------------------------------------------------
# Non-contiguous layouts
# ---------------------------------------------------------------------------

STRIDED = {
    "transpose": lambda x: x.transpose(0, 2),
    "step_slice": lambda x: x[::2, 1:, ::3],
    "negative_free_slice": lambda x: x[1:, :, 2:5],
    "expand": lambda x: x[:, :1].expand(2, 5, 6),
    "expand_new_dim": lambda x: x[0, 0].expand(3, 4, 6),
    "permute": lambda x: x.permute(2, 0, 1),
    "unfold": lambda x: x.unfold(2, 3, 2),
    "as_strided": lambda x: x.as_strided((3, 4), (5, 2), 3),
    "as_strided_overlap": lambda x: x.as_strided((4, 4), (1, 1)),
    "diagonal": lambda x: x.diagonal(0, 1, 2),
    "diagonal_offset": lambda x: x.diagonal(1, 0, 2),
    "movedim": lambda x: x.movedim(0, -1),
    "select_t": lambda x: x[1].t(),
    "zero_stride_scalar": lambda x: x[0, 0, 0].expand(2, 2),
}


@pytest.mark.parametrize("fn", STRIDED.values(), ids=STRIDED.keys())
def test_strided_views(fn):
    c = grid(2, 5, 6)
    x = c.to("tpu")
    v, e = fn(x), fn(c)
    assert (v.shape, v.stride(), v.storage_offset()) == (e.shape, e.stride(), e.storage_offset())
    assert v.is_contiguous() == e.is_contiguous()
    torch.testing.assert_close(v.cpu(), e)
    # The views work as op inputs and through .contiguous().
    torch.testing.assert_close((v * 2 + 1).cpu(), e * 2 + 1)
    torch.testing.assert_close(v.sum().cpu(), e.sum())
    vc = v.contiguous()
    assert vc.is_contiguous() and vc.stride() == e.contiguous().stride()
    torch.testing.assert_close(vc.cpu(), e.contiguous())


def test_contiguous_of_contiguous_is_self():
    x = grid(3, 4).to("tpu")
    assert x.contiguous() is x
    y = x.t()
    assert not y.is_contiguous()
    z = y.contiguous()
    assert z is not y and z.is_contiguous()
    assert storage_id(z) != storage_id(x)
    z.add_(1)  # a copy: the base is unchanged
    torch.testing.assert_close(x.cpu(), grid(3, 4))


def test_channels_last():
    c = grid(2, 3, 4, 5)
    x = c.to("tpu").to(memory_format=torch.channels_last)
    e = c.to(memory_format=torch.channels_last)
    assert x.stride() == e.stride()
    assert x.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(x.cpu(), e)
    torch.testing.assert_close((x + 1).cpu(), e + 1)


def test_to_preserves_strides():
    c = grid(3, 4).t()
    x = c.to("tpu")
    assert x.stride() == c.to(torch.float64).stride()
    torch.testing.assert_close(x.cpu(), c)


# ---------------------------------------------------------------------------
# Tensor type
# ---------------------------------------------------------------------------


def test_tpu_tensors_are_plain_tensors():
    x = torch.ones(3, device="tpu")
    for t in (x, x + 1, x[1:], x.t(), torch.zeros(2, device="tpu"), torch.ones(1).to("tpu"),
              torch.nn.Parameter(torch.ones(2, device="tpu")).detach()):
        assert type(t) is torch.Tensor
        assert t.device == torch.device("tpu", 0) and t.is_tpu
    assert isinstance(torch.nn.Parameter(x), torch.nn.Parameter)


# ---------------------------------------------------------------------------
# Copies between devices
# ---------------------------------------------------------------------------


def test_copy_cpu_to_tpu_with_dtype_and_broadcast():
    dst = torch.zeros(3, 4, device="tpu")
    src = torch.tensor([1.5, -2.25, 3.0, 4.125], dtype=torch.float64)
    dst.copy_(src)
    assert dst.dtype == torch.float32 and dst.device.type == "tpu"
    torch.testing.assert_close(dst.cpu(), torch.zeros(3, 4).copy_(src))


def test_copy_tpu_to_cpu_with_dtype_and_broadcast():
    src = torch.tensor([[1.7], [-2.2], [3.9]], device="tpu")
    dst = torch.zeros(3, 4, dtype=torch.int64)
    dst.copy_(src)
    torch.testing.assert_close(dst, torch.zeros(3, 4, dtype=torch.int64).copy_(src.cpu()))


def test_copy_tpu_to_tpu_into_strided_view():
    x = torch.zeros(4, 6, device="tpu")
    src = torch.arange(4, dtype=torch.int32, device="tpu")
    x.t()[::2].copy_(src)
    c = torch.zeros(4, 6)
    c.t()[::2].copy_(torch.arange(4, dtype=torch.int32))
    torch.testing.assert_close(x.cpu(), c)


def test_copy_cpu_noncontiguous_into_tpu_view():
    x = torch.zeros(5, 5, device="tpu")
    src = grid(5, 5).t()[1:4]
    x[1:4].copy_(src)
    c = torch.zeros(5, 5)
    c[1:4].copy_(src)
    torch.testing.assert_close(x.cpu(), c)


def test_copy_tpu_view_to_cpu_view():
    x = grid(4, 5).to("tpu")
    dst = torch.zeros(5, 4)
    dst[:, 1:3].copy_(x[1:3].t())
    c = torch.zeros(5, 4)
    c[:, 1:3].copy_(grid(4, 5)[1:3].t())
    torch.testing.assert_close(dst, c)


def test_copy_between_tpu_devices():
    a = grid(3, 3).to("tpu:0")
    b = torch.zeros(3, 3, device="tpu:1", dtype=torch.float64)
    b.copy_(a)
    assert b.device == torch.device("tpu", 1)
    torch.testing.assert_close(b.cpu(), grid(3, 3).double())
    c = a.to("tpu:1")
    assert c.device == torch.device("tpu", 1)
    torch.testing.assert_close((c + 1).cpu(), grid(3, 3) + 1)


@pytest.mark.parametrize("non_blocking", [False, True])
def test_to_and_cpu_roundtrip(non_blocking):
    c = torch.randn(7, 3)
    x = c.to("tpu", non_blocking=non_blocking)
    assert x.device == torch.device("tpu", 0)
    assert x.to("tpu") is x
    y = x.cpu()
    assert y.device.type == "cpu"
    assert y.cpu() is y
    torch.testing.assert_close(y, c, rtol=0, atol=0)
    z = c.to(x)  # device and dtype of another tensor
    assert z.device == x.device
    w = x.to("tpu", torch.float64)
    assert w.dtype == torch.float64 and w.device.type == "tpu"
    torch.testing.assert_close(w.cpu(), c.double())


def test_empty_and_zero_size_copies():
    for shape in [(0,), (3, 0), (0, 4, 2)]:
        c = torch.empty(shape)
        x = c.to("tpu")
        assert x.shape == c.shape
        assert x.cpu().shape == c.shape
        torch.testing.assert_close((x + 1).cpu(), c + 1)


def test_scalar_tensor_roundtrip():
    c = torch.tensor(3.5)
    x = c.to("tpu")
    assert x.dim() == 0
    torch.testing.assert_close(x.cpu(), c)


# ---------------------------------------------------------------------------
# Printing and item()
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", [
    torch.tensor([1.5, -2.0, 3.25]),
    torch.arange(6).reshape(2, 3),
    torch.tensor([True, False]),
    torch.tensor(7.0),
    torch.zeros(0),
    torch.tensor([1.0, float("nan"), float("inf")]),
    torch.linspace(0, 1, 2000),  # summarized
    torch.tensor([1.5, 2.5], dtype=torch.float16),
], ids=["float", "int", "bool", "scalar", "empty", "nonfinite", "summarized", "half"])
def test_repr_matches_cpu(value, no_fallback):
    t = value.to("tpu")
    r = repr(t)
    cpu = repr(value)
    # CPU prints no device; tpu adds it before dtype=, or last.
    if ", dtype=" in cpu:
        expected = cpu.replace(", dtype=", ", device='tpu:0', dtype=", 1)
    else:
        expected = cpu[:-1] + ", device='tpu:0')"
    assert r == expected
    assert str(t) == r


def test_repr_of_view_and_grad(no_fallback, capsys):
    x = grid(3, 4).to("tpu").requires_grad_()
    y = (x * 2)[1:, ::2]
    print(y)
    out = capsys.readouterr().out.strip()
    e = repr((grid(3, 4).requires_grad_() * 2)[1:, ::2])
    assert out == e.replace("grad_fn=<SliceBackward0>", "device='tpu:0', grad_fn=<SliceBackward0>")


@pytest.mark.parametrize("value,kind", [
    (torch.tensor(2.5), float), (torch.tensor(-3), int), (torch.tensor(True), bool),
    (torch.tensor([4.25], dtype=torch.float64), float), (torch.tensor(2**40), int),
    (torch.tensor(1.5, dtype=torch.bfloat16), float), (torch.tensor(200, dtype=torch.uint8), int),
])
def test_item(value, kind):
    v = value.to("tpu").item()
    assert type(v) is kind and v == value.item()


def test_item_of_view_and_result():
    x = grid(3, 4).to("tpu")
    assert x[2, 1].item() == 9.0
    assert x.t()[3, 2].item() == 11.0
    assert (x.sum()).item() == 66.0
    with pytest.raises(RuntimeError, match="cannot be converted to Scalar"):
        x.item()


def test_tolist_and_numpy():
    c = grid(2, 3)
    x = c.to("tpu")
    assert x.tolist() == c.tolist()
    assert (x.cpu().numpy() == c.numpy()).all()
    with pytest.raises(TypeError):
        x.numpy()


# ---------------------------------------------------------------------------
# Factories
# ---------------------------------------------------------------------------

DETERMINISTIC_FACTORIES = {
    "zeros": lambda d, **k: torch.zeros(2, 3, device=d, **k),
    "ones": lambda d, **k: torch.ones(4, device=d, **k),
    "full": lambda d, **k: torch.full((2, 2), 7, device=d, **k),
    "arange": lambda d, **k: torch.arange(10, device=d, **k),
    "arange_step": lambda d, **k: torch.arange(1, 20, 3, device=d, **k),
    "linspace": lambda d, **k: torch.linspace(-2, 6, 9, device=d, **k),
    "logspace": lambda d, **k: torch.logspace(-1.3, 2.6, 11, base=3.0, device=d, **k),
    "eye": lambda d, **k: torch.eye(3, 4, device=d, **k),
    "tensor": lambda d, **k: torch.tensor([[1, 2], [3, 4]], device=d, **k),
    "scalar_tensor": lambda d, **k: torch.scalar_tensor(5, device=d, **k),
    "zeros_like": lambda d, **k: torch.zeros_like(torch.ones(2, 3, device=d), **k),
    "ones_like": lambda d, **k: torch.ones_like(torch.ones(2, 3, device=d), **k),
    "full_like": lambda d, **k: torch.full_like(torch.ones(3, device=d), 2, **k),
    "new_zeros": lambda d, **k: torch.ones(2, device=d).new_zeros(3, 2, **k),
    "new_ones": lambda d, **k: torch.ones(2, device=d).new_ones(2, **k),
    "new_full": lambda d, **k: torch.ones(2, device=d).new_full((2, 3), 4, **k),
    "new_tensor": lambda d, **k: torch.ones(2, device=d).new_tensor([1, 2, 3], **k),
}


# Factories that still run on the CPU fallback: {name: reason}.
FACTORY_FALLBACKS = {}


@pytest.mark.parametrize("dtype", [None, torch.float32, torch.int64, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("fn", DETERMINISTIC_FACTORIES.values(), ids=DETERMINISTIC_FACTORIES.keys())
def test_factory(fn, dtype):
    kw = {} if dtype is None else {"dtype": dtype}
    x = fn("tpu", **kw)
    e = fn("cpu", **kw)
    assert x.device == torch.device("tpu", 0)
    assert type(x) is torch.Tensor
    torch.testing.assert_close(x.cpu(), e)


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=[pytest.mark.xfail(reason=FACTORY_FALLBACKS[n], strict=True)]
                 if n in FACTORY_FALLBACKS else [])
    for n in DETERMINISTIC_FACTORIES
])
def test_factory_is_native(name):
    torch_pjrt.reset_metrics()
    DETERMINISTIC_FACTORIES[name]("tpu")
    assert not fallbacks()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("args", [(3, 4, 1), (3, 4, -1), (0, 3, 0), (3, 3, 10), (5, 2, -2)])
@pytest.mark.parametrize("fn", [torch.tril_indices, torch.triu_indices])
def test_triangle_indices(fn, args, dtype, no_fallback):
    x = fn(*args, dtype=dtype, device="tpu")
    assert x.device == torch.device("tpu", 0) and x.dtype == dtype
    torch.testing.assert_close(x.cpu(), fn(*args, dtype=dtype))


def test_efficient_zero_tensor_is_a_device_zero_tensor(no_fallback):
    # autograd's zero gradients (sgn's backward on real inputs) are made on the device
    z = torch._efficientzerotensor((2, 3), dtype=torch.bfloat16, device="tpu:1")
    assert z.device == torch.device("tpu", 1) and z.dtype == torch.bfloat16
    assert z.cpu().equal(torch.zeros(2, 3, dtype=torch.bfloat16))
    x = torch.randn(4).to("tpu").requires_grad_()
    assert torch.autograd.grad(torch.sgn(x).sum(), x)[0].cpu().equal(torch.zeros(4))


def test_factory_device_argument_places_the_result():
    # A factory that reaches the backend with its device argument (no tensor input).
    assert torch.tril_indices(3, 3, device="tpu:1").device == torch.device("tpu", 1)
    with torch.tpu.device(1):
        assert torch.triu_indices(3, 3, device="tpu").device == torch.device("tpu", 1)


@pytest.mark.parametrize("make", [
    lambda: torch.empty(3, 4, device="tpu"),
    lambda: torch.empty_like(torch.ones(3, 4, device="tpu")),
    lambda: torch.ones(1, device="tpu").new_empty(3, 4),
    lambda: torch.empty_strided((3, 4), (1, 3), device="tpu"),
], ids=["empty", "empty_like", "new_empty", "empty_strided"])
def test_empty(make):
    x = make()
    assert x.shape == (3, 4) and x.dtype == torch.float32 and x.device.type == "tpu"
    x.fill_(1.0)
    assert x.cpu().eq(1).all()


def test_empty_strided_layout():
    x = torch.empty_strided((3, 4), (1, 3), device="tpu")
    assert x.stride() == (1, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_random_factories(dtype, seed):
    shape = (64, 32)
    r = torch.rand(shape, device="tpu", dtype=dtype)
    n = torch.randn(shape, device="tpu", dtype=dtype)
    for t in (r, n):
        assert t.shape == shape and t.dtype == dtype and t.device.type == "tpu"
    rc, nc = r.float().cpu(), n.float().cpu()
    assert rc.min() >= 0 and rc.max() < 1
    assert 0.4 < rc.mean() < 0.6
    assert abs(nc.mean()) < 0.1 and 0.9 < nc.std() < 1.1
    assert rc.unique().numel() > 100  # not a constant (bfloat16 has few values in [0, 1))


def test_randint_and_likes(seed):
    x = torch.randint(3, 9, (1000,), device="tpu")
    assert x.dtype == torch.int64 and x.device.type == "tpu"
    xc = x.cpu()
    assert xc.min() >= 3 and xc.max() <= 8 and xc.unique().numel() == 6
    base = torch.ones(50, 20, device="tpu", dtype=torch.float64)
    for t in (torch.rand_like(base), torch.randn_like(base), torch.randint_like(base, 10)):
        assert t.shape == base.shape and t.dtype == base.dtype and t.device == base.device
    ri = torch.randint_like(base, 10).cpu()
    assert ri.min() >= 0 and ri.max() <= 9 and (ri == ri.round()).all()


def test_manual_seed_reproduces_random_streams():
    torch.manual_seed(123)
    a = torch.rand(100, device="tpu").cpu()
    b = torch.rand(100, device="tpu").cpu()
    torch.manual_seed(123)
    a2 = torch.rand(100, device="tpu").cpu()
    assert torch.equal(a, a2)
    assert not torch.equal(a, b)


# ---------------------------------------------------------------------------
# Dtype casts
# ---------------------------------------------------------------------------


def cast_source(src, dst):
    """Values representable in `src` whose conversion to `dst` is defined in C++."""
    vals = [0.0, 1.0, 2.5, 3.75, 0.5, 100.0, 127.0, 0.25]
    if src.is_signed and dst.is_signed and src is not torch.bool and dst is not torch.bool:
        vals += [-1.0, -2.5, -100.0, -0.75]
    if src is torch.bool:
        return torch.tensor([True, False, True])
    return torch.tensor(vals).to(src)


@pytest.mark.parametrize("dst", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("src", ALL_DTYPES, ids=str)
def test_dtype_cast(src, dst):
    c = cast_source(src, dst)
    x = c.to("tpu")
    assert x.dtype == src
    y = x.to(dst)
    assert y.dtype == dst and y.device.type == "tpu"
    torch.testing.assert_close(y.cpu(), c.to(dst), rtol=0, atol=0)
    # Casting on the way in and on the way out.
    torch.testing.assert_close(c.to("tpu", dst).cpu(), c.to(dst), rtol=0, atol=0)
    torch.testing.assert_close(x.to("cpu", dst), c.to(dst), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_dtype_roundtrip_exact(dtype):
    if dtype.is_floating_point:
        c = torch.randn(100).to(dtype)
        c[:3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    elif dtype is torch.bool:
        c = torch.rand(100) > 0.5
    else:
        info = torch.iinfo(dtype)
        c = torch.randint(max(info.min, -2**62), min(info.max, 2**62), (100,), dtype=dtype)
        c[:2] = torch.tensor([info.min, info.max], dtype=dtype)
    torch.testing.assert_close(c.to("tpu").cpu(), c, rtol=0, atol=0, equal_nan=True)


def test_float_to_int_truncates_like_cpu():
    c = torch.tensor([-2.7, -0.2, 0.2, 2.7, 1e6])
    for dst in (torch.int32, torch.int64):
        torch.testing.assert_close(c.to("tpu").to(dst).cpu(), c.to(dst))


def test_nan_to_bool():
    c = torch.tensor([float("nan"), 0.0, -0.0, 1e-30])
    torch.testing.assert_close(c.to("tpu").bool().cpu(), c.bool())


def test_type_promotion_results():
    pairs = [(torch.int32, torch.float16), (torch.uint8, torch.int8), (torch.bool, torch.int64),
             (torch.bfloat16, torch.float16), (torch.int64, torch.float32)]
    for a, b in pairs:
        ca = torch.ones(3, dtype=a)
        cb = torch.ones(3, dtype=b)
        r = ca.to("tpu") + cb.to("tpu")
        assert r.dtype == (ca + cb).dtype
        torch.testing.assert_close(to_cpu(r), ca + cb)
    r = torch.ones(2, dtype=torch.int32, device="tpu") * 2.5
    assert r.dtype == torch.float32 and r.cpu().tolist() == [2.5, 2.5]
    assert (torch.ones(2, dtype=torch.int64, device="tpu") + torch.tensor(1.5, device=TPU)).dtype \
        == torch.float32


def _mask_put(x, m, v, accumulate=False):
    return x.index_put_((m,), v, accumulate=accumulate)


# Boolean (and uint8) masks: read back and turned into index tensors, then indexed on tpu.
MASK_CASES = {
    "rows": lambda x, m: x[m[:, 0, 0]],
    "two_dims": lambda x, m: x[m[..., 0]],
    "all_dims": lambda x, m: x[m],
    "after_slice": lambda x, m: x[:, m[0, :, 0]],
    "with_long_index": lambda x, m: x[m[:, 0, 0], 1],
    "uint8": lambda x, m: x[m[..., 0].to(torch.uint8)],
    "none_true": lambda x, m: x[torch.zeros_like(m[..., 0])],
    "put_scalar": lambda x, m: _mask_put(x, m, torch.tensor(0.5, device=x.device)),
    "put_rows": lambda x, m: _mask_put(x, m[..., 0], torch.arange(5.0, device=x.device)),
    "put_accumulate": lambda x, m: _mask_put(x, m[..., 0], torch.ones(5, device=x.device), True),
    "setitem": lambda x, m: x.__setitem__(m, -1.0) or x,
}


@pytest.mark.filterwarnings("ignore:indexing with dtype torch.uint8")
@pytest.mark.parametrize("name", list(MASK_CASES))
def test_boolean_mask_indexing(name, seed):
    x = torch.randn(4, 3, 5)
    compare(MASK_CASES[name], x, x > 0.2, check_fallback=True)


def test_boolean_mask_gradient_and_cpu_mask(seed, no_fallback):
    x = torch.randn(4, 3, requires_grad=True)
    m = x.detach() > 0
    g = torch.autograd.grad((x[m] ** 2).sum(), x)[0]
    xt = x.detach().to("tpu").requires_grad_()
    gt = torch.autograd.grad((xt[m.to("tpu")] ** 2).sum(), xt)[0]
    torch.testing.assert_close(gt.cpu(), g)
    # a CPU mask may index a tpu tensor, as on CUDA
    torch.testing.assert_close(xt.detach()[m].cpu(), x.detach()[m])


def test_boolean_mask_shape_mismatch_raises_like_cpu():
    x = torch.randn(4, 3)
    for bad in (torch.ones(3, dtype=torch.bool), torch.ones(4, 4, dtype=torch.bool)):
        with pytest.raises(IndexError) as cpu:
            x[bad]
        with pytest.raises(IndexError) as tpu:
            x.to("tpu")[bad.to("tpu")]
        assert str(tpu.value) == str(cpu.value)


UNIQUE_CASES = {
    "sorted_all": lambda x: torch.unique(x, return_inverse=True, return_counts=True),
    "unsorted": lambda x: torch.unique(x, sorted=False, return_inverse=True),
    "values_only": lambda x: torch.unique(x),
    "private": lambda x: torch.ops.aten._unique(x, False, True),
    "consecutive": lambda x: torch.unique_consecutive(x, return_inverse=True, return_counts=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
@pytest.mark.parametrize("name", list(UNIQUE_CASES))
def test_unique_on_the_host_without_fallback(name, dtype, seed):
    # NaNs sort last, each its own value; -0.0 and 0.0 are one value; the inverse keeps the
    # input's shape.
    x = torch.tensor([[3.0, float("nan"), 1.0, 3.0], [-0.0, 0.0, float("nan"), 3.0]])
    if dtype in (torch.int64, torch.bool):
        x = torch.randint(0, 3, (2, 6))
    compare(UNIQUE_CASES[name], x.to(dtype), check_fallback=True)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_repeat_interleave_with_tensor_repeats_without_fallback(dtype, seed):
    x = torch.randn(3, 4)
    r = torch.tensor([2, 0, 3], dtype=dtype)
    compare(lambda x, r: (torch.repeat_interleave(r), x.repeat_interleave(r, dim=0),
                          x.repeat_interleave(torch.cat([r, r[:1]]), dim=1, output_size=7)),
            x, r, check_fallback=True)


@pytest.mark.parametrize("weights", [None, torch.float32, torch.float64, torch.int64])
def test_bincount_on_the_host_without_fallback(weights, seed):
    x = torch.tensor([1, 3, 3, 0, 7, 3])
    args = (x,) if weights is None else (x, (torch.randn(6) * 4).to(weights))
    compare(lambda *a: (torch.bincount(*a), torch.bincount(*a, minlength=10),
                        torch.bincount(a[0][:0], *a[1:2])), *args, check_fallback=True)


def test_int64_convolution_without_fallback(seed):
    F = torch.nn.functional
    x = torch.randint(-5, 5, (2, 4, 9, 9))
    w = torch.randint(-3, 3, (6, 2, 3, 3))
    compare(lambda x, w: (F.conv2d(x, w, stride=2, padding=1, groups=2),
                          F.conv_transpose2d(x, w[:4, :3], stride=2),
                          F.conv2d(x * 2 ** 20, w[:1, :1].expand(1, 4, 3, 3) * 2 ** 41)),  # wraps
            x, w, check_fallback=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_histc_of_half_tensors(dtype, seed):
    x = (torch.randn(200) * 2).to(dtype)
    compare(lambda x: (torch.histc(x, 7, -2.3, 3.1), torch.histc(x, 4)), x, check_fallback=True)
    # Past 2048 (float16) or 256 (bfloat16) per bin the CPU's half-precision counts stop
    # growing; tpu counts exactly and rounds once, like the float32 histogram.
    big = torch.zeros(5000, dtype=dtype)
    torch.testing.assert_close(torch.histc(big.to("tpu"), 2, -1, 1).cpu(),
                               torch.histc(big.float(), 2, -1, 1).to(dtype))


def test_histogram_density_of_no_values_is_nan_as_on_the_cpu(eager_mode, no_fallback):
    # 0 / 0 in every bin (OpInfo's sample 162 of histogram, past the first 8).
    compare(lambda x: (torch.histogram(x, 3, density=True),
                       torch.histogramdd(x.reshape(-1, 2), [2, 2], density=True),
                       torch.histogram(x, 3)), torch.empty(5, 0, 4))


def _int_histc_reference(x, bins, lo, hi):
    """CUDA's integer histc: bounds from the data when equal, widened when still equal, bin
    (x - lo) * bins // (hi - lo) in integers, values outside [lo, hi] dropped."""
    x = x.long().flatten()
    if lo == hi and x.numel():
        lo, hi = int(x.min()), int(x.max())
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    inside = x[(x >= lo) & (x <= hi)]
    pos = ((inside - lo) * bins // (hi - lo)).clamp(max=bins - 1)
    return torch.bincount(pos, minlength=bins)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_integer_histc_has_cudas_semantics(eager_mode, dtype, no_fallback):
    # The CPU raises "histogram_cpu not implemented for 'Int'"; CUDA counts, and
    # mixture-of-experts routers count their expert ids with it.
    g = torch.Generator().manual_seed(0)
    lo = 0 if dtype == torch.uint8 else -9
    x = torch.randint(lo, 40, (3, 50), generator=g).to(dtype)
    for bins, mn, mx in [(8, 0, 7), (5, 0, 0), (7, 3, 30), (3, -2, 100), (13, 2.7, 20.2)]:
        got = torch.histc(x.to("tpu"), bins=bins, min=mn, max=mx)
        assert got.dtype == dtype and got.device.type == "tpu"
        # Bounds convert to the input's type as C++ converts (-2 is 254 in uint8).
        lo_, hi_ = (int(torch.tensor(int(v)).to(dtype)) for v in (mn, mx))
        want = _int_histc_reference(x, bins, lo_, hi_)
        assert torch.equal(got.cpu().long(), want), (bins, mn, mx)
    ids = torch.randint(0, 6, (64, 2), generator=g).int()
    counts = torch.histc(ids.to("tpu"), bins=6, min=0, max=5)
    assert torch.equal(counts.cpu(), torch.bincount(ids.flatten(), minlength=6).int())
    same = torch.full((4,), 3, dtype=dtype)
    assert torch.equal(torch.histc(same.to("tpu"), bins=4).cpu().long(),
                       _int_histc_reference(same, 4, 0, 0))
    assert torch.histc(x[:0].to("tpu"), bins=3).cpu().tolist() == [0, 0, 0]
    with pytest.raises(RuntimeError, match="bins must be > 0"):
        torch.histc(x.to("tpu"), bins=0)


def _fractional(n, x, k, out, u):
    pool = torch.ops.aten.fractional_max_pool2d if n == 2 else torch.ops.aten.fractional_max_pool3d
    return pool(x, k, out, u)


FRACTIONAL_CASES = [  # (n, input shape, kernel, output): with and without a batch dim
    (2, (2, 3, 9, 11), [2, 3], [4, 5]),
    (2, (3, 7, 7), [3, 2], [5, 6]),  # last windows end at the edge (2-d allows it)
    (2, (1, 2, 6, 40), [1, 4], [1, 20]),
    (3, (2, 2, 5, 6, 7), [2, 2, 3], [3, 2, 4]),
    (3, (3, 6, 5, 8), [1, 2, 2], [1, 3, 2]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(FRACTIONAL_CASES)))
def test_fractional_max_pool_with_given_samples(case, dtype, seed):
    """Window starts from the samples as the CPU kernel computes them (in the input dtype),
    first index among ties, NaN wins; the gradient goes to the chosen elements."""
    n, shape, k, out = FRACTIONAL_CASES[case]
    x = torch.randint(-3, 4, shape).to(dtype)  # many ties
    x.view(-1)[::7] = float("nan")
    x.view(-1)[3::11] = float("-inf")
    planes = shape[-n - 1]
    u = torch.rand(shape[0] if len(shape) == n + 2 else 1, planes, n).to(dtype)
    compare(lambda x, u: _fractional(n, x, k, out, u), x, u, check_fallback=True)

    def grad(x, u):
        x = x.clone().requires_grad_()
        y, _ = _fractional(n, x, k, out, u)
        (y * torch.arange(y.numel(), device=y.device).reshape(y.shape)).nansum().backward()
        return x.grad

    compare(grad, torch.randn(shape).to(dtype), u, check_fallback=True)


FRACTIONAL_ERRORS = {
    "kernel zero": (2, (1, 1, 5, 5), [0, 2], [2, 2], (1, 1, 2)),
    "rank": (2, (5, 5), [2, 2], [2, 2], (1, 1, 2)),
    "empty plane": (2, (1, 0, 5, 5), [2, 2], [2, 2], (1, 0, 2)),
    "pool height": (2, (1, 1, 5, 5), [3, 3], [4, 2], (1, 1, 2)),
    "pool width": (2, (1, 1, 5, 5), [2, 3], [2, 4], (1, 1, 2)),
    "samples rank": (2, (1, 1, 5, 5), [2, 2], [2, 2], (1, 2)),
    "samples batch": (2, (2, 1, 5, 5), [2, 2], [2, 2], (1, 1, 2)),
    "samples planes": (2, (1, 3, 5, 5), [2, 2], [2, 2], (1, 1, 2)),
    "samples count": (2, (1, 1, 5, 5), [2, 2], [2, 2], (1, 1, 3)),
    "3d kernel zero": (3, (1, 1, 5, 5, 5), [0, 2, 2], [2, 2, 2], (1, 1, 3)),
    "3d rank": (3, (5, 5, 5), [2, 2, 2], [2, 2, 2], (1, 1, 3)),
    "3d pool time": (3, (1, 1, 5, 5, 5), [2, 2, 2], [4, 2, 2], (1, 1, 3)),
    "3d pool width first": (3, (1, 1, 5, 5, 5), [2, 2, 2], [2, 4, 4], (1, 1, 3)),
    "3d samples count": (3, (1, 1, 5, 5, 5), [2, 2, 2], [2, 2, 2], (1, 1, 2)),
}


@pytest.mark.parametrize("name", list(FRACTIONAL_ERRORS))
def test_fractional_max_pool_errors_like_cpu(name, fallback_off):
    n, shape, k, out, ushape = FRACTIONAL_ERRORS[name]
    x, u = torch.randn(shape), torch.rand(ushape)
    same_error_as_cpu(lambda d: _fractional(n, x.to(d), k, out, u.to(d)))
    with pytest.raises(RuntimeError, match="same dtype as input"):
        _fractional(2, torch.randn(1, 1, 5, 5, device="tpu"), [2, 2], [2, 2],
                    torch.rand(1, 1, 2, dtype=torch.float64, device="tpu"))



def test_fractional_max_pool_huge_samples_raise():
    """Samples in [0, 1) keep every window inside the input; a huge one (where i + u rounds
    in float32) would not, and raises a RuntimeError at the next read instead of reading
    clamped positions (the CPU kernel's int casts overflow there)."""
    x = torch.randn(1, 1, 6, 200, device="tpu")
    u = torch.full((1, 1, 2), 2.0 ** 30, device="tpu")
    with pytest.raises(RuntimeError, match="outside the input"):
        torch.ops.aten.fractional_max_pool2d(x, [2, 2], [3, 100], u)[0].cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_rrelu_training_draws_slopes_on_the_device(dtype, no_fallback):
    """Training-mode rrelu: positive elements pass, the others are scaled by a slope drawn
    from [lower, upper) that the noise records (1 where x > 0); the gradient is the noise.
    The draws come from the tpu generator (reproducible with manual_seed), so only these
    properties, not the CPU's values, can be compared. Evaluation mode uses the mean slope."""
    lower, upper = 0.1, 0.3
    x = torch.randn(4000).to(dtype)
    x[:5] = 0.0
    xt = x.to("tpu").requires_grad_()
    torch.manual_seed(3)
    y = torch.nn.functional.rrelu(xt, lower, upper, training=True)
    y.sum().backward()
    noise = xt.grad.cpu().double()
    yc, xc = y.detach().cpu().double(), x.double()
    pos = xc > 0
    assert torch.equal(yc[pos], xc[pos]) and torch.equal(noise[pos], torch.ones_like(noise[pos]))
    neg = ~pos
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert noise[neg].min() >= lower - tol and noise[neg].max() < upper + tol
    torch.testing.assert_close(yc[neg & (xc != 0)], (xc * noise)[neg & (xc != 0)],
                               rtol=tol, atol=0)
    assert noise[neg].std() > 0.04  # drawn, not one slope
    torch.manual_seed(3)
    again = torch.nn.functional.rrelu(x.to("tpu"), lower, upper, training=True)
    assert torch.equal(again.cpu(), y.detach().cpu())
    # In place, and evaluation mode (deterministic: compared with the CPU).
    z = x.to("tpu")
    torch.nn.functional.rrelu_(z, lower, upper, training=True)
    assert torch.equal(z.cpu()[pos], x[pos])
    compare(lambda x: torch.nn.functional.rrelu(x, lower, upper, training=False), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matrix_sqrth_and_polar_without_fallback(dtype, seed):
    """matrix_sqrth reads the lower triangle and counts negative eigenvalues as zero; polar
    gives U orthonormal and H symmetric with U H = A, for tall and batched matrices."""
    a = torch.randn(3, 5, 5, dtype=dtype)
    spd = a @ a.mT + torch.eye(5, dtype=dtype)
    lower_only = spd.tril() + torch.randn(5, 5, dtype=dtype).triu(1)
    indefinite = torch.tensor([[1.0, 2.0], [2.0, 1.0]], dtype=dtype)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-9, rtol=1e-8)
    compare(lambda s, lo, ind: (torch.linalg.matrix_sqrth(s), torch.linalg.matrix_sqrth(lo),
                                torch.linalg.matrix_sqrth(ind),
                                torch.linalg.matrix_sqrth(s[:0])),
            spd, lower_only, indefinite, check_fallback=True, **tol)
    compare(lambda a, t: (*torch.linalg.polar(a), *torch.linalg.polar(t),
                          *torch.linalg.polar(a[:0])),
            a, torch.randn(2, 7, 4, dtype=dtype), check_fallback=True, **tol)


MATRIX_FN_ERRORS = {
    "sqrth rank": lambda: torch.linalg.matrix_sqrth(torch.ones(3)),
    "sqrth square": lambda: torch.linalg.matrix_sqrth(torch.ones(2, 3)),
    "sqrth long": lambda: torch.linalg.matrix_sqrth(torch.ones(2, 2, dtype=torch.long)),
    "sqrth half": lambda: torch.linalg.matrix_sqrth(torch.ones(2, 2, dtype=torch.half)),
    "polar rank": lambda: torch.linalg.polar(torch.ones(3)),
    "polar wide": lambda: torch.linalg.polar(torch.ones(2, 3)),
    "polar long": lambda: torch.linalg.polar(torch.ones(2, 2, dtype=torch.long)),
    "polar half": lambda: torch.linalg.polar(torch.ones(2, 2, dtype=torch.half)),
}


@pytest.mark.parametrize("name", list(MATRIX_FN_ERRORS))
def test_matrix_sqrth_and_polar_errors_like_cpu(name, fallback_off):
    def make(dev):
        with torch.device(dev):
            MATRIX_FN_ERRORS[name]()

    same_error_as_cpu(make)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ormqr_without_fallback(dtype, seed):
    """Q or Q^T from geqrf's reflectors, on either side, for tall, wide and batched inputs."""
    tall, wide, bat = (torch.randn(6, 4, dtype=dtype), torch.randn(3, 5, dtype=dtype),
                       torch.randn(2, 5, 3, dtype=dtype))

    def run(tall, wide, bat):
        outs = []
        for a in (tall, wide, bat):
            qa, tau = torch.geqrf(a)
            m = a.shape[-2]
            c_left = torch.ones(*a.shape[:-2], m, 3, dtype=dtype, device=a.device).cumsum(-2)
            c_right = c_left.mT.contiguous()
            for tr in (False, True):
                outs.append(torch.ormqr(qa, tau, c_left, left=True, transpose=tr))
                outs.append(torch.ormqr(qa, tau, c_right, left=False, transpose=tr))
        return outs

    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-9)
    compare(run, tall, wide, bat, check_fallback=True, **tol)


ORMQR_ERRORS = {
    "input rank": ((5,), (3,), (5, 4), True),
    "other rank": ((5, 3), (3,), (5,), True),
    "other rows": ((5, 3), (3,), (4, 4), True),
    "other cols right": ((5, 3), (3,), (4, 4), False),
    "tau length": ((5, 3), (2,), (5, 4), True),
    "tau rank": ((2, 5, 3), (3,), (2, 5, 4), True),
    "other ndim": ((2, 5, 3), (2, 3), (5, 4), True),
    "tau batch": ((2, 5, 3), (3, 3), (2, 5, 4), True),
    "other batch": ((2, 5, 3), (2, 3), (3, 5, 4), True),
}


@pytest.mark.parametrize("name", list(ORMQR_ERRORS) + ["dtype", "long"])
def test_ormqr_errors_like_cpu(name, fallback_off):
    if name == "dtype":
        args = (torch.randn(5, 3), torch.rand(3, dtype=torch.float64), torch.randn(5, 4))
        kw = {}
    elif name == "long":
        args = tuple(torch.ones(s, dtype=torch.long) for s in ((5, 3), (3,), (5, 4)))
        kw = {}
    else:
        a, t, o, left = ORMQR_ERRORS[name]
        args, kw = (torch.randn(a), torch.rand(t), torch.randn(o)), {"left": left}
    same_error_as_cpu(lambda d: torch.ormqr(*(x.to(d) for x in args), **kw))


@pytest.mark.parametrize("driver", [None, "gels", "gelsy", "gelss", "gelsd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lstsq_drivers_without_fallback(driver, dtype, seed):
    """Every output of each driver: tall, square, wide, batched with a broadcast rhs, a
    vector rhs, an explicit rcond; rank-deficient inputs get the minimum-norm solution
    and their rank from gelsy/gelss/gelsd."""
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-9, rtol=1e-9)
    cases = [
        (torch.randn(6, 4, dtype=dtype), torch.randn(6, 2, dtype=dtype)),
        (torch.randn(4, 4, dtype=dtype), torch.randn(4, 3, dtype=dtype)),
        (torch.randn(3, 5, dtype=dtype), torch.randn(3, 2, dtype=dtype)),
        (torch.randn(2, 3, 5, 3, dtype=dtype), torch.randn(1, 3, 5, 2, dtype=dtype)),
        (torch.randn(5, 3, dtype=dtype), torch.randn(5, dtype=dtype)),
        (torch.randn(2, 5, 3, dtype=dtype), torch.randn(2, 5, dtype=dtype)),
        (torch.randn(0, 5, 3, dtype=dtype), torch.randn(0, 5, 2, dtype=dtype)),
    ]
    if driver not in ("gelss", "gelsd"):  # their m > n residuals need the rank on the host
        cases.append((torch.randn(5, 0, dtype=dtype), torch.randn(5, 2, dtype=dtype)))
    if driver != "gels":
        deficient = torch.randn(3, 5, dtype=dtype)
        deficient[2] = deficient[0] + deficient[1]
        cases.append((deficient.mT if driver in ("gelss", "gelsd") else deficient,
                      torch.randn(3 if driver not in ("gelss", "gelsd") else 5, 2, dtype=dtype)))
    for a, b in cases:
        if driver in ("gelss", "gelsd") and a.shape[-2] > a.shape[-1]:
            continue
        compare(lambda a, b: tuple(torch.linalg.lstsq(a, b, driver=driver)), a, b,
                check_fallback=True, **tol)
    # An rcond that cuts a nonzero singular value: gelsd/gelss truncate the SVD (so does
    # tpu); gelsy truncates through a pivoted QR and runs on the CPU fallback.
    a, b = torch.randn(3, 5, dtype=dtype), torch.randn(3, 2, dtype=dtype)
    compare(lambda a, b: tuple(torch.linalg.lstsq(a, b, rcond=0.3, driver=driver)), a, b,
            check_fallback=driver in ("gels", "gelss", "gelsd"), **tol)


LSTSQ_ERRORS = {
    "input rank": lambda d: torch.linalg.lstsq(torch.ones(4, device=d), torch.ones(4, device=d)),
    "other rank": lambda d: torch.linalg.lstsq(torch.ones(4, 3, device=d), torch.tensor(1.0, device=d)),
    "rows": lambda d: torch.linalg.lstsq(torch.ones(4, 3, device=d), torch.ones(5, 2, device=d)),
    "dims": lambda d: torch.linalg.lstsq(torch.ones(2, 4, 3, device=d), torch.ones(4, device=d)),
    "dtype": lambda d: torch.linalg.lstsq(torch.ones(4, 3, device=d),
                                          torch.ones(4, 2, dtype=torch.float64, device=d)),
    "long": lambda d: torch.linalg.lstsq(torch.ones(4, 3, dtype=torch.long, device=d),
                                         torch.ones(4, 2, dtype=torch.long, device=d)),
    "driver": lambda d: torch.linalg.lstsq(torch.ones(4, 3, device=d), torch.ones(4, 2, device=d),
                                           driver="foo"),
}


@pytest.mark.parametrize("name", list(LSTSQ_ERRORS))
def test_lstsq_errors_like_cpu(name, fallback_off):
    same_error_as_cpu(LSTSQ_ERRORS[name])


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_unique_along_a_dim_without_fallback(dtype, seed):
    """unique(dim=) and unique_consecutive(dim=): whole slices compared, on the host."""
    x = torch.randint(0, 2, (7, 3, 2)).to(dtype)
    x[4] = x[1]
    f = torch.tensor([[1.0, float("nan")], [1.0, float("nan")], [0.0, 2.0], [-0.0, 2.0]])

    def run(x, f):
        outs = []
        for d in (0, 1, -1):
            outs += [*torch.unique(x, dim=d, return_inverse=True, return_counts=True),
                     *torch.unique_consecutive(x, dim=d, return_inverse=True,
                                               return_counts=True),
                     torch.unique(x, dim=d, sorted=False)]
        outs += [*torch.unique(f, dim=0, return_counts=True), torch.unique(x[:0], dim=0)]
        return outs

    compare(run, x, f, check_fallback=True)


@pytest.mark.parametrize("case", ["scalar", "range", "two empty dims", "empty other dim"])
def test_unique_along_a_dim_errors_like_cpu(case, fallback_off):
    make = {"scalar": lambda d: (torch.tensor(3.0, device=d), 0),
            "range": lambda d: (torch.ones(2, 3, device=d), 2),
            "two empty dims": lambda d: (torch.ones(0, 0, device=d), 0),
            "empty other dim": lambda d: (torch.ones(3, 0, device=d), 0)}[case]
    def run(dev):
        x, dim = make(dev)
        torch.unique(x, dim=dim)

    same_error_as_cpu(run)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_histogramdd_without_fallback(dtype, seed):
    """Equal-width bins over the data's range or a given one, given edges, weights,
    density, a constant column (its range widens by 0.5), rows outside the range or
    holding NaN (skipped), no rows."""
    x = torch.randn(50, 3, dtype=dtype)
    x[:, 2] = 1.5
    x[7, 0] = float("nan")
    w = torch.rand(50, dtype=dtype)
    edges = [torch.tensor([-2.0, -0.5, 0.0, 3.0], dtype=dtype),
             torch.linspace(-1, 1, 6, dtype=dtype), torch.tensor([1.0, 2.0], dtype=dtype)]
    y = torch.randn(5, 4, 2, dtype=dtype)

    def run(x, w, e0, e1, e2, y):
        outs = []
        for kw in ({"bins": [4, 3, 2], "range": [-1.0, 1.0, -2.0, 2.0, 0.0, 3.0]},
                   {"bins": [4, 3, 2], "range": [-1.0, 1.0, -2.0, 2.0, 0.0, 3.0],
                    "weight": w, "density": True},
                   {"bins": [e0, e1, e2], "weight": w}, {"bins": [e0, e1, e2], "density": True}):
            h, bins = torch.histogramdd(x, **kw)
            outs += [h, *bins]
        xf = torch.nan_to_num(x)  # the data's own range needs finite data
        outs += [*torch.histogramdd(xf, bins=[3, 5, 2])[0:1], *torch.histogramdd(xf, bins=4)[1]]
        outs += [torch.histogramdd(y, bins=[3, 2], density=True)[0],
                 torch.histogramdd(y[:0], bins=[3, 2])[0]]
        return outs

    compare(run, x, w, *edges, y, check_fallback=True, atol=1e-5, rtol=1e-5)


HISTOGRAMDD_ERRORS = {
    "rank": lambda d: torch.histogramdd(torch.ones(4, device=d), bins=[2]),
    "range length": lambda d: torch.histogramdd(torch.ones(4, 2, device=d), bins=[2, 2],
                                                range=[0.0, 1.0]),
    "range not finite": lambda d: torch.histogramdd(torch.ones(4, 2, device=d), bins=[2, 2],
                                                    range=[0.0, 1.0, 0.0, float("inf")]),
    "min above max": lambda d: torch.histogramdd(torch.ones(4, 2, device=d), bins=[2, 2],
                                                 range=[0.0, 1.0, 2.5, 1e-7]),
    "edge count": lambda d: torch.histogramdd(torch.ones(4, 2, device=d),
                                              bins=[torch.ones(3, device=d)]),
    "edge dims": lambda d: torch.histogramdd(torch.ones(4, 1, device=d),
                                             bins=[torch.ones(3, 1, device=d)]),
    "no edges": lambda d: torch.histogramdd(torch.ones(4, 1, device=d),
                                            bins=[torch.ones(0, device=d)]),
}


@pytest.mark.parametrize("name", list(HISTOGRAMDD_ERRORS))
def test_histogramdd_errors_like_cpu(name, fallback_off):
    same_error_as_cpu(HISTOGRAMDD_ERRORS[name])


def test_histogramdd_of_non_finite_data_raises():
    """Bins taken from the data's range need finite data: the CPU raises at once, tpu at the
    next read (the check runs on the device), naming the first such dimension."""
    x = torch.ones(6, 3)
    x[2, 1] = float("inf")
    with pytest.raises(RuntimeError, match="dimension 1's range"):
        torch.histogramdd(x, bins=2)
    with pytest.raises(RuntimeError, match="dimension 1's range is not finite"):
        torch.histogramdd(x.to("tpu"), bins=2)[0].cpu()
    # Its two ops (edges, counts) found the same error: it was raised once.
    torch.tpu.synchronize()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ldl_factor_and_solve_without_fallback(dtype, seed):
    """Bunch-Kaufman pivots as LAPACK picks them (2x2 blocks included), zero columns
    reported in info, solves with broadcast batches; only the lower triangle is read."""
    a = torch.randn(4, 6, 6, dtype=dtype)
    a = a + a.mT
    a[1, 0, 0] = a[1, 1, 1] = 0.0  # forces a 2x2 pivot first
    a[2] = 0.0
    a[2, 3, 3] = 1.0  # zero columns: info
    big = torch.randn(16, 16, dtype=dtype)
    big = big + big.T + torch.randn(16, 16, dtype=dtype).triu(1)  # upper part ignored
    b = torch.randn(1, 6, 2, dtype=dtype)  # (the CPU crashes broadcasting LD's batch)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)

    def run(a, big, b):
        ld, piv, info = torch.linalg.ldl_factor_ex(a)
        ld2, piv2 = torch.linalg.ldl_factor(big)
        good = torch.cat([a[:2], a[3:]])
        gld, gpiv = torch.linalg.ldl_factor(good)
        return (ld, piv, info, ld2, piv2,
                torch.linalg.ldl_solve(gld, gpiv, b),
                torch.linalg.ldl_solve(ld2, piv2, torch.ones(16, 1, dtype=dtype, device=a.device)))

    compare(run, a, big, b, check_fallback=True, **tol)


def test_ldl_factor_of_large_matrices_uses_the_fallback():
    """Past 16 x 16 the unrolled program would take long to compile: the CPU computes it."""
    a = torch.randn(17, 17)
    a = a + a.T
    torch_pjrt.reset_metrics()
    got = torch.linalg.ldl_factor_ex(a.to("tpu"))
    assert "aten::linalg_ldl_factor_ex" in fallbacks()
    torch.testing.assert_close(got.LD.cpu(), torch.linalg.ldl_factor_ex(a).LD)


LDL_ERRORS = {
    "rank": lambda d: torch.linalg.ldl_factor_ex(torch.ones(3, device=d)),
    "square": lambda d: torch.linalg.ldl_factor_ex(torch.ones(2, 3, device=d)),
    "long": lambda d: torch.linalg.ldl_factor_ex(torch.ones(2, 2, dtype=torch.long, device=d)),
    "solve pivots": lambda d: torch.linalg.ldl_solve(
        torch.eye(3, device=d), torch.ones(2, dtype=torch.int32, device=d),
        torch.ones(3, 1, device=d)),
    "solve rows": lambda d: torch.linalg.ldl_solve(
        torch.eye(3, device=d), torch.ones(3, dtype=torch.int32, device=d),
        torch.ones(2, 1, device=d)),
    "solve dtype": lambda d: torch.linalg.ldl_solve(
        torch.eye(3, device=d), torch.ones(3, dtype=torch.int32, device=d),
        torch.ones(3, 1, dtype=torch.float64, device=d)),
}


@pytest.mark.parametrize("name", list(LDL_ERRORS))
def test_ldl_errors_like_cpu(name, fallback_off):
    same_error_as_cpu(LDL_ERRORS[name])


def test_ldl_solve_broadcasts_the_factorization(seed):
    """One factorization against a batch of right-hand sides (the CPU kernel crashes on
    this broadcast, so the reference is linalg.solve)."""
    a = torch.randn(6, 6, dtype=torch.float64)
    a = a + a.T
    b = torch.randn(3, 6, 2, dtype=torch.float64)
    ld, piv = torch.linalg.ldl_factor(a.to("tpu"))
    x = torch.linalg.ldl_solve(ld[None], piv[None], b.to("tpu"))
    torch.testing.assert_close(x.cpu(), torch.linalg.solve(a, b), atol=1e-10, rtol=1e-10)
