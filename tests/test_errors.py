"""Errors: the same exception types and messages as the CPU, clean failures, the fallback."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from conftest import fallbacks

import torch_pjrt


def ones(*shape, **kw):
    return lambda dev: torch.ones(*shape, device=dev, **kw)


def idx(*vals):
    return lambda dev: torch.tensor(vals, device=dev)


# name: (fn, [argument makers]); every case raises on the CPU.
ERROR_CASES = {
    "add_shape": (lambda a, b: a + b, [ones(3), ones(4)]),
    "mul_broadcast": (lambda a, b: a * b, [ones(2, 3), ones(3, 2)]),
    "mm_shapes": (torch.mm, [ones(2, 3), ones(4, 5)]),
    "matmul_shapes": (torch.matmul, [ones(2, 3), ones(4, 5)]),
    "bmm_batch": (torch.bmm, [ones(2, 2, 3), ones(3, 3, 5)]),
    "mm_dtype": (lambda a, b: torch.mm(a, b.long()), [ones(2, 2), ones(2, 2)]),
    "linear_shapes": (torch.nn.functional.linear, [ones(2, 3), ones(4, 5)]),
    "cat_sizes": (lambda a, b: torch.cat([a, b]), [ones(2, 3), ones(2, 4)]),
    "cat_dim": (lambda a, b: torch.cat([a, b], dim=2), [ones(2, 3), ones(2, 3)]),
    "stack_sizes": (lambda a: torch.stack([a, a[:2]]), [ones(3)]),
    "sum_dim": (lambda a: a.sum(5), [ones(2, 3)]),
    "softmax_dim": (lambda a: a.softmax(3), [ones(3)]),
    "argmax_dim": (lambda a: a.argmax(2), [ones(3)]),
    "transpose_dim": (lambda a: a.transpose(0, 3), [ones(2, 3)]),
    "unsqueeze_dim": (lambda a: a.unsqueeze(4), [ones(3)]),
    "permute_dup": (lambda a: a.permute(0, 0), [ones(3, 3)]),
    "getitem_int": (lambda a: a[5], [ones(3)]),
    "select_index": (lambda a: a.select(0, 7), [ones(3)]),
    "view_size": (lambda a: a.view(5), [ones(2, 3)]),
    "reshape_two_minus_one": (lambda a: a.reshape(-1, -1), [ones(3)]),
    "expand_size": (lambda a: a.expand(2, 4), [ones(3)]),
    "mean_int": (lambda a: a.mean(), [ones(3, dtype=torch.int64)]),
    "add_inplace_broadcast": (lambda a, b: a.add_(b), [ones(3, 1), ones(3, 3)]),
    "mul_inplace_cast": (lambda a: a.mul_(1.5), [ones(3, dtype=torch.int64)]),
    "repeat_interleave_negative": (torch.repeat_interleave, [idx(1, -1)]),
    "repeat_interleave_2d": (torch.repeat_interleave, [lambda d: torch.ones(1, 2, dtype=torch.int64, device=d)]),
    "bincount_negative": (torch.bincount, [idx(1, -2)]),
    "bincount_minlength": (lambda x: torch.bincount(x, minlength=-1), [idx(1, 2)]),
    "bincount_weights": (lambda x: torch.bincount(x, torch.ones(3, device=x.device)), [idx(1, 2)]),
    "addr_vec_dim": (torch.addr, [ones(3, 2), ones(3), ones(2, 2)]),
    "addr_expand": (torch.addr, [ones(4, 2), ones(3), ones(2)]),
    "addr_int_float_beta": (lambda a, u, v: torch.addr(a, u, v, beta=0.5),
                            [ones(3, 2, dtype=torch.int64), ones(3, dtype=torch.int64),
                             ones(2, dtype=torch.int64)]),
    "addr_bool_alpha": (lambda a, u, v: torch.addr(a, u, v, alpha=True), [ones(3, 2), ones(3), ones(2)]),
    # in place, self is the result: not expanded, its shape is checked
    "addr_inplace_0d": (lambda a, u, v: a.addr_(u, v), [ones(()), ones(3), ones(2)]),
    "addr_inplace_shape": (lambda a, u, v: a.addr_(u, v), [ones(1, 2), ones(3), ones(2)]),
    "where_shapes": (lambda a: torch.where(a > 0, a, torch.ones(4, device=a.device)), [ones(3)]),
    # Index values: checked on the device, raised at the op (Debug) or at the next
    # synchronization or host read (Strict, DeferAndFuse).
    "index_select_bounds": (lambda a, i: a.index_select(0, i), [ones(3), idx(5)]),
    "index_select_negative": (lambda a, i: a.index_select(0, i), [ones(3), idx(-1)]),
    "advanced_index_bounds": (lambda a, i: a[i], [ones(3), idx(5)]),
    "advanced_index_negative": (lambda a, i: a[:, i], [ones(2, 3), idx(1, -4)]),
    "index_put_bounds": (lambda a, i: a.index_put_((i,), torch.tensor(1.0, device=a.device)),
                         [ones(3), idx(0, 3)]),
    "gather_bounds": (lambda a, i: torch.gather(a, 0, i), [ones(2, 2), lambda d: torch.tensor([[7]], device=d)]),
    "scatter_bounds": (lambda a, i: a.scatter(1, i, 2.0), [ones(2, 2), lambda d: torch.tensor([[0], [2]], device=d)]),
    "scatter_add_bounds": (lambda a, i: a.scatter_add(0, i, torch.ones(1, 2, device=a.device)),
                           [ones(2, 2), lambda d: torch.tensor([[0, -1]], device=d)]),
    "take_bounds": (lambda a, i: a.take(i), [ones(2, 3), idx(-7)]),
    "put_bounds": (lambda a, i: a.put(i, torch.ones(1, device=a.device)), [ones(2, 3), idx(6)]),
    "index_add_bounds": (lambda a, i: a.index_add(0, i, torch.ones(2, 3, device=a.device)),
                         [ones(2, 3), idx(1, 2)]),
    "index_copy_bounds": (lambda a, i: a.index_copy(1, i, torch.ones(2, 1, device=a.device)),
                          [ones(2, 3), idx(3)]),
    "index_fill_bounds": (lambda a, i: a.index_fill(0, i, 5.0), [ones(2, 3), idx(-3)]),
    "cross_entropy_target": (torch.nn.functional.cross_entropy, [ones(2, 10), idx(12, 1)]),
    "nll_loss_negative_target": (torch.nn.functional.nll_loss, [ones(3, 4), idx(0, -1, 2)]),
    "embedding_bounds": (lambda i, w: torch.nn.functional.embedding(i, w), [idx(9), ones(4, 2)]),
    "embedding_bag_max_bounds": (lambda i, o, w: F.embedding_bag(i, w, o, mode="max"),
                                 [idx(1, 12, 3), idx(0, 1), ones(10, 3)]),
    "embedding_bag_sum_bounds": (lambda i, o, w: F.embedding_bag(i, w, o),
                                 [idx(1, -2, 3), idx(0, 1), ones(10, 3)]),
    "embedding_bag_first_offset": (lambda i, o, w: F.embedding_bag(i, w, o),
                                   [idx(1, 2, 3), idx(1, 2), ones(10, 3)]),
    "embedding_bag_last_offset": (lambda i, o, w: F.embedding_bag(i, w, o, mode="mean"),
                                  [idx(1, 2, 3), idx(0, 7), ones(10, 3)]),
    "embedding_bag_descending_offsets": (lambda i, o, w: F.embedding_bag(i, w, o),
                                         [idx(1, 2, 3, 4), idx(0, 3, 1), ones(10, 3)]),
    "max_unpool2d_bounds": (lambda x, i: F.max_unpool2d(x, i, 2),
                            [ones(1, 1, 2, 2), lambda d: torch.tensor([[[[0, 1], [2, 99]]]], device=d)]),
    "max_unpool1d_negative": (lambda x, i: F.max_unpool1d(x, i, 2),
                              [ones(1, 1, 2), lambda d: torch.tensor([[[0, -3]]], device=d)]),
    "max_unpool3d_bounds": (lambda x, i: F.max_unpool3d(x, i, (1, 1, 2)),
                            [ones(1, 1, 1, 1, 2), lambda d: torch.tensor([[[[[0, 9]]]]], device=d)]),
}

ERROR_XFAIL = {
    "mm_dtype": "message says 'float != long', CPU says 'float != long int'",
    "embedding_bag_sum_bounds": "the CPU's sum/mean message names the index's position too "
    "('Index 1 of input takes value -2 ...'); ours is its max-mode message, naming the value",
}


def _error(fn, args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        if isinstance(e, AssertionError):
            raise
        return e
    return None


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=[pytest.mark.xfail(reason=ERROR_XFAIL[n], strict=True)]
                 if n in ERROR_XFAIL else [])
    for n in ERROR_CASES
])
def test_same_error_as_cpu(name):
    fn, makers = ERROR_CASES[name]
    expected = _error(fn, [m("cpu") for m in makers])
    assert expected is not None, "the case does not raise on the CPU"
    actual = _error(fn, [m("tpu") for m in makers])
    if actual is None:  # found on the device after the op: raised by the next synchronization
        assert torch.tpu.eager_mode != torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
        actual = _error(torch.tpu.synchronize, [])
    assert actual is not None, f"tpu did not raise; CPU raised {type(expected).__name__}: {expected}"
    assert type(actual) is type(expected), f"{type(actual).__name__}: {actual}"
    assert str(actual).split("\n")[0] == str(expected).split("\n")[0]


MIXED_DEVICE_CASES = {
    "add": lambda a, c: a + c,
    "mm": lambda a, c: torch.mm(a, c),
    "mm_cpu_first": lambda a, c: torch.mm(c, a),
    "cat": lambda a, c: torch.cat([a, c]),
    "index_select": lambda a, c: a.index_select(0, c[0].long()),
    "where": lambda a, c: torch.where(c > 0, a, a),
    "tpu0_tpu1": lambda a, c: a + c.to("tpu:1"),
}
MIXED_XFAIL = {}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=[pytest.mark.xfail(reason=MIXED_XFAIL[n], strict=True)]
                 if n in MIXED_XFAIL else [])
    for n in MIXED_DEVICE_CASES
])
def test_mixed_devices_raise(name):
    a = torch.ones(2, 2, device="tpu")
    c = torch.ones(2, 2)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        MIXED_DEVICE_CASES[name](a, c)


def test_mixed_device_message_names_argument():
    a, c = torch.ones(2, 2, device="tpu"), torch.ones(2, 2)
    with pytest.raises(RuntimeError) as e:
        torch.mm(c, a)
    assert str(e.value).startswith(
        "Expected all tensors to be on the same device, but found at least two devices, "
        "cpu and tpu:0! (when checking argument for argument mat2"), str(e.value)


def test_cpu_indices_mix_with_tpu():
    """Advanced indexing takes CPU index tensors, as on CUDA."""
    x = torch.arange(6.0).reshape(3, 2)
    xt = x.to("tpu")
    i = torch.tensor([2, 0])
    assert xt[i].cpu().tolist() == x[i].tolist()
    xt[i] = torch.tensor([[7.0, 8.0], [9.0, 10.0]]).to("tpu")
    x[i] = torch.tensor([[7.0, 8.0], [9.0, 10.0]])
    assert xt.cpu().tolist() == x.tolist()


def test_cpu_scalar_tensor_mixes_with_tpu():
    r = torch.ones(3, device="tpu") + torch.tensor(2.0)
    assert r.device.type == "tpu"
    assert r.cpu().tolist() == [3.0, 3.0, 3.0]


# ---------------------------------------------------------------------------
# A failed op leaves its inputs unchanged
# ---------------------------------------------------------------------------

FAILING_INPLACE = {
    "add_": lambda x: x.add_(torch.ones(4, device=x.device)),
    "mul_cast": lambda x: x.long().mul_(1.5),
    "add_out": lambda x: torch.add(torch.ones(3, device=x.device), torch.ones(4, device=x.device),
                                   out=x),
    "index_put_": lambda x: x.__setitem__(torch.tensor([0, 1], device=x.device),
                                          torch.ones(3, device=x.device)),
    "copy_": lambda x: x.copy_(torch.ones(4, device=x.device)),
    "cat_out": lambda x: torch.cat([torch.ones(2, 3, device=x.device),
                                    torch.ones(2, 4, device=x.device)], out=x),
    "addmm_": lambda x: x.view(3, 1).addmm_(torch.ones(3, 2, device=x.device),
                                            torch.ones(3, 1, device=x.device)),
    "logical_and_": lambda x: x.view(3, 1).logical_and_(torch.ones(3, 3, device=x.device)),
    "clamp_": lambda x: x.clamp_(min=torch.ones(4, device=x.device)),
}
FAILING_XFAIL = {}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=[pytest.mark.xfail(reason=FAILING_XFAIL[n], strict=True)]
                 if n in FAILING_XFAIL else [])
    for n in FAILING_INPLACE
])
def test_failed_op_leaves_inputs_unchanged(name):
    fn = FAILING_INPLACE[name]
    with pytest.raises(RuntimeError):
        fn(torch.arange(3.0))  # the CPU raises too
    x = torch.arange(3.0).to("tpu")
    with pytest.raises(RuntimeError):
        fn(x)
    assert x.shape == (3,)
    assert x.cpu().tolist() == [0.0, 1.0, 2.0]
    # The device still works afterwards.
    assert (x + 1).cpu().tolist() == [1.0, 2.0, 3.0]


BAD_INDEX_INPLACE = {
    "index_put_": lambda x, i: x.index_put_((i,), torch.tensor(9.0, device=x.device)),
    "index_add_": lambda x, i: x.index_add_(0, i, torch.ones(1, device=x.device)),
    "scatter_": lambda x, i: x.scatter_(0, i, 9.0),
    "index_fill_": lambda x, i: x.index_fill_(0, i, 9.0),
}


MODES = ["DEFER_NEVER_AND_LAUNCH_BLOCKING", "DEFER_NEVER", "DEFER_AND_FUSE"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(BAD_INDEX_INPLACE))
def test_bad_index_leaves_inplace_target_unchanged(name, mode):
    """An out-of-range index raises the CPU's exception type and message, the in-place op has
    no effect (even in DeferAndFuse, where the graph would donate the target's buffer: its
    checks run first), and the device keeps working."""
    fn = BAD_INDEX_INPLACE[name]
    bad = torch.tensor([1, 7])
    with pytest.raises((IndexError, RuntimeError)) as cpu_err:
        fn(torch.arange(3.0), bad)
    with torch.tpu.set_eager_mode(getattr(torch.tpu.EagerMode, mode)):
        x = torch.arange(3.0).to("tpu")
        torch.tpu.synchronize()
        with pytest.raises(cpu_err.type) as err:
            fn(x, bad.to("tpu"))
            torch.tpu.synchronize()
        assert str(err.value).split("\n")[0] == str(cpu_err.value)
        assert x.cpu().tolist() == [0.0, 1.0, 2.0]
        assert (x + 1).cpu().tolist() == [1.0, 2.0, 3.0]
        torch.tpu.synchronize()  # the failure was reported once


@pytest.mark.parametrize("mode", MODES[1:])
def test_ops_reading_a_bad_index_result_do_not_run(mode):
    """In the asynchronous modes the op returns; what reads its result raises its error."""
    x = torch.arange(3.0).to("tpu")
    with torch.tpu.set_eager_mode(getattr(torch.tpu.EagerMode, mode)):
        z = x.index_select(0, torch.tensor([2, 5]).to("tpu")) * 2 + 1
        with pytest.raises(IndexError, match="index out of range in self"):
            z.cpu()
        torch.tpu.synchronize()  # reported once, by the read
        assert (x + 1).cpu().tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("mode", MODES[1:])
def test_reading_a_multi_output_result_of_a_bad_index_raises(mode):
    """Ops returning several tensors write into outputs the shim allocates (out= targets):
    reading one after its data check failed raises the error, not the untouched zeros."""
    x = torch.randn(3, 5).to("tpu")
    with torch.tpu.set_eager_mode(getattr(torch.tpu.EagerMode, mode)):
        loss, total = torch.ops.aten.nll_loss_forward(x, torch.tensor([1, 9, 2]).to("tpu"),
                                                      None, 1, -100)
        with pytest.raises(IndexError, match="Target 9 is out of bounds"):
            loss.cpu()
        torch.tpu.synchronize()  # reported once, by the read
        assert (x + 1).cpu().shape == (3, 5)


def test_bad_index_in_a_deferred_training_step_keeps_the_weights():
    """A DeferAndFuse step whose graph updates parameters in place (donating their buffers)
    and looks up an out-of-range token: IndexError, and the weights are those before the
    step, so training can go on with good data."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Flatten(),
                                torch.nn.Linear(8, 3)).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    good = torch.tensor([[1, 2], [3, 4]]).to("tpu")
    target = torch.tensor([0, 2]).to("tpu")

    def step(tokens):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(tokens), target)
        loss.backward()
        opt.step()
        return loss.item()

    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        for _ in range(3):
            step(good)
        before = [p.detach().cpu().clone() for p in model.parameters()]
        d0 = torch_pjrt.metrics()["donated_buffers"]
        with pytest.raises(IndexError, match="index out of range in self"):
            step(torch.tensor([[1, 2], [3, 12]]).to("tpu"))
            torch.tpu.synchronize()
        for p, b in zip(model.parameters(), before, strict=True):
            torch.testing.assert_close(p.detach().cpu(), b, rtol=0, atol=0)
        step(good)
        # The update may still be pending (with shape buckets on, `loss.item()` reads a
        # bucketed loss computed outside the graph): it runs, donating, at the flush.
        torch.tpu.synchronize()
        assert torch_pjrt.metrics()["donated_buffers"] > d0


@pytest.mark.parametrize("buckets", [False, True])
def test_bad_index_keeps_the_pending_update_of_the_step_before(buckets):
    """With no host read between steps, the last good step's optimizer update is still
    pending in DeferAndFuse's graph when the next step's lookup fails: the update takes
    effect (as op by op), only the failed step is lost; the weights then follow a CPU run
    that skipped the bad step (before, the update was dropped with the failed graph)."""
    import copy

    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Flatten(),
                              torch.nn.Linear(8, 3))
    tpu = copy.deepcopy(cpu).to("tpu")
    good = torch.tensor([[1, 2], [3, 4]])

    def stepper(model, dev):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        target = torch.tensor([0, 2], device=dev)

        def step(tokens):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(tokens.to(dev)), target)
            loss.backward()
            opt.step()
            return loss.detach()
        return step

    on_cpu, on_tpu = stepper(cpu, "cpu"), stepper(tpu, "tpu")
    was = torch_pjrt.set_shape_buckets(buckets)
    try:
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
            for n in (3, 5):  # the loss's sizes vary: with buckets on, nll_loss is bucketed
                torch.nn.functional.cross_entropy(
                    torch.randn(n, 3, device="tpu"), torch.zeros(n, dtype=torch.long,
                                                                 device="tpu")).item()
            for _ in range(3):  # no host read between steps: the last update stays pending
                on_cpu(good)
                on_tpu(good)
            with pytest.raises(IndexError, match="index out of range in self"):
                on_tpu(torch.tensor([[1, 2], [3, 12]]))
                torch.tpu.synchronize()
            for _ in range(2):
                torch.testing.assert_close(on_tpu(good).cpu(), on_cpu(good))
    finally:
        torch_pjrt.set_shape_buckets(was)
    for p, q in zip(tpu.parameters(), cpu.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach())


def test_bad_index_in_a_compiled_graph_raises_at_the_next_read():
    emb = torch.nn.Embedding(10, 4).to("tpu")
    f = torch.compile(lambda i: emb(i).sum(), backend="tpu")
    ok = f(torch.tensor([1, 2]).to("tpu")).item()
    assert ok == pytest.approx(emb.weight[1:3].sum().item(), rel=1e-6)
    with pytest.raises(IndexError, match="index out of range in self"):
        f(torch.tensor([3, 40]).to("tpu")).item()
    assert f(torch.tensor([1, 2]).to("tpu")).item() == ok
    torch.tpu.synchronize()


def test_failed_op_in_a_sequence_does_not_poison_later_ops():
    x = torch.ones(3, device="tpu")
    y = x * 2
    with pytest.raises(RuntimeError):
        y + torch.ones(4, device="tpu")
    z = y + 1
    torch.tpu.synchronize()
    assert z.cpu().tolist() == [3.0, 3.0, 3.0]


# ---------------------------------------------------------------------------
# Plugin loading
# ---------------------------------------------------------------------------


def run_python(code, **env):
    e = dict(os.environ)
    e.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e,
                          capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(__file__))


def test_import_torch_pjrt_first():
    r = run_python("import torch_pjrt, torch; print(torch.ones(2, device='tpu').sum().item())")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "2.0"


def test_import_torch_autoloads_the_device():
    r = run_python("import torch; print(torch.ones(2, device='tpu').sum().item())")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "2.0"


@pytest.mark.parametrize("code", [
    pytest.param("import torch_pjrt", id="import_torch_pjrt"),
    pytest.param("import torch, torch_pjrt", id="import_torch_then_torch_pjrt"),
])
def test_missing_plugin_error_is_clear(code):
    r = run_python(code, TORCH_PJRT_PLUGIN="/nonexistent.so")
    assert r.returncode != 0
    assert "/nonexistent.so" in r.stderr and "does not exist" in r.stderr, r.stderr[-2000:]


# ---------------------------------------------------------------------------
# The CPU fallback
# ---------------------------------------------------------------------------

# Ops very unlikely to get a lowering; the tests use the first one without a rule.
UNLOWERED = [
    ("aten::_standard_gamma_grad", lambda x: torch._standard_gamma_grad(x.abs() + 1, x.abs() + 1)),
    ("aten::_dirichlet_grad",
     lambda x: torch._dirichlet_grad(x.abs() + 0.1, x.abs() + 1, x.abs() + 2)),
    ("aten::linalg_qr", lambda x: torch.linalg.qr(x)),
    ("aten::linalg_cholesky_ex", lambda x: torch.linalg.cholesky(x @ x.mT + torch.eye(3).to(x))),
    ("aten::histc", lambda x: torch.histc(x, bins=4)),
]


def unlowered():
    lowered = set(torch_pjrt.lowered_ops())
    for name, fn in UNLOWERED:
        if name not in lowered:
            return name, fn
    pytest.skip("every candidate op has a lowering now: update UNLOWERED")


def matrix(dev):
    return (torch.arange(9.0).reshape(3, 3) ** 1.5 + torch.eye(3) * 4).to(dev)


def test_fallback_disabled_raises_not_implemented(fallback_off):
    name, fn = unlowered()
    x = matrix("tpu")
    with pytest.raises(NotImplementedError, match=name.split("::")[1]) as info:
        fn(x)
    assert "fallback" in str(info.value)
    assert x.cpu().equal(matrix("cpu"))  # the input survives
    torch_pjrt.enable_cpu_fallback = True
    torch.testing.assert_close(fn(x), fn(matrix("cpu")), check_device=False)


def test_declined_rule_names_its_reason(fallback_off):
    # addbmm_ has a rule, which declines a self it would have to resize.
    x = torch.ones(1, 3, device="tpu")
    b1, b2 = torch.ones(2, 2, 4, device="tpu"), torch.ones(2, 4, 3, device="tpu")
    with pytest.raises(NotImplementedError, match=r"addbmm.*\(addbmm_ on a self of another shape\)"):
        x.addbmm_(b1, b2)
    # an op without a rule carries no reason
    _, fn = unlowered()
    with pytest.raises(NotImplementedError) as info:
        fn(matrix("tpu"))
    assert "tpu device, and" in str(info.value)


def test_fallback_switch_reads_back():
    assert torch_pjrt.enable_cpu_fallback is True
    torch_pjrt.enable_cpu_fallback = False
    assert torch_pjrt.enable_cpu_fallback is False
    torch_pjrt.enable_cpu_fallback = True


def test_fallback_result_warning_and_metrics():
    name, _ = unlowered()
    fn_src = {n: i for i, (n, _) in enumerate(UNLOWERED)}[name]
    # A fresh process: the warning is issued once per op and process.
    r = run_python(f"""
        import warnings, torch, torch_pjrt
        from test_errors import UNLOWERED, matrix
        name, fn = UNLOWERED[{fn_src}]
        x = matrix("tpu")
        torch_pjrt.reset_metrics()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            outs = [fn(x) for _ in range(3)]
        msgs = [str(m.message) for m in w if name.split("::")[1] in str(m.message)]
        assert len(msgs) == 1, msgs
        assert "not lowered" in msgs[0] and "fallback" in msgs[0], msgs[0]
        expected = fn(matrix("cpu"))
        for out in outs:
            torch.testing.assert_close(out, expected, check_device=False)
            for t in (out if isinstance(out, tuple) else (out,)):
                assert t.device.type == "tpu", t.device
        native, fallback = torch_pjrt.metrics()["ops"][name]
        assert (native, fallback) == (0, 3), (native, fallback)
        assert torch_pjrt.metrics()["fallback_calls"] >= 3
        print("OK")
    """)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]


# In-place (or out=) calls into views of a (2, 4) tensor, for ops without a lowering; the
# test uses the first that falls back.
INPLACE_UNLOWERED = [
    ("aten::igamma", lambda t: t[:, 1:].igamma_(torch.full_like(t[:, 1:], 2.0))),
    ("aten::mvlgamma", lambda t: t[:, 1:].add_(2).mvlgamma_(1)),
    ("aten::linalg_qr", lambda t: torch.linalg.qr(
        t[:, :2].t() @ t[:, :2] + torch.eye(2, device=t.device), out=(t[:, :2], t[:, 2:]))),
    ("aten::_standard_gamma_grad", lambda t: torch.ops.aten._standard_gamma_grad.out(
        t[:, 1:] + 1, t[:, 1:] + 1, out=t[:, :3])),
]


def test_fallback_writes_inplace_results_back():
    # An in-place or out= op run by the CPU fallback must update the tpu view and its base.
    base = torch.arange(1.0, 9.0).reshape(2, 4) / 7
    for name, op in INPLACE_UNLOWERED:
        torch_pjrt.reset_metrics()
        op(base.to("tpu"))
        if name in fallbacks():
            break
    else:
        pytest.skip("every candidate op runs natively now: update INPLACE_UNLOWERED")
    x = base.to("tpu")
    op(x)
    e = base.clone()
    op(e)
    torch.testing.assert_close(x.cpu(), e)
