"""The torch.tpu module, devices, seeds and torch_pjrt's metrics."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torch_pjrt
from torch_pjrt import _C

METRIC_KEYS = {
    "compilations", "cache_hits", "cache_misses", "compile_seconds", "executions",
    "host_to_device_bytes", "device_to_host_bytes", "native_calls", "fallback_calls",
    "cached_programs", "ops",
}


def test_is_available_and_count():
    assert torch.tpu.is_available()
    assert torch.tpu.is_initialized()
    n = torch.tpu.device_count()
    assert n == _C.device_count() >= 1
    if torch.tpu.get_device_name() == "cpu":
        assert n == 4  # the XLA CPU plugin exposes 4 devices here


def test_device_name_and_properties():
    assert torch.tpu.get_device_name() == _C.platform_name()
    if "xla_cpu" in _C.plugin_path() or "cpu" in _C.plugin_path().lower():
        assert torch.tpu.get_device_name() == "cpu"
    props = torch.tpu.get_device_properties(0)
    assert props["index"] == 0 and props["name"] == torch.tpu.get_device_name()


def test_accelerator_api():
    assert torch.accelerator.is_available()
    assert torch.accelerator.current_accelerator().type == "tpu"
    assert torch.accelerator.device_count() == torch.tpu.device_count()


def test_current_and_set_device():
    assert torch.tpu.current_device() == 0
    torch.tpu.set_device(1)
    try:
        assert torch.tpu.current_device() == 1
        x = torch.ones(2, device="tpu")
        assert x.device == torch.device("tpu", 1)
        assert (x + 1).device == torch.device("tpu", 1)
        torch.tpu.set_device("tpu:2")
        assert torch.tpu.current_device() == 2
        torch.tpu.set_device(torch.device("tpu", 3))
        assert torch.tpu.current_device() == 3
    finally:
        torch.tpu.set_device(0)
    assert torch.tpu.current_device() == 0


def test_set_device_rejects_bad_index():
    with pytest.raises(RuntimeError):
        torch.tpu.set_device(torch.tpu.device_count())
    with pytest.raises(ValueError):
        torch.tpu.set_device("cpu")
    assert torch.tpu.current_device() == 0


def test_device_context_manager():
    with torch.tpu.device(2):
        assert torch.tpu.current_device() == 2
        assert torch.ones(1, device="tpu").device == torch.device("tpu", 2)
        with torch.tpu.device("tpu:1"):
            assert torch.tpu.current_device() == 1
        assert torch.tpu.current_device() == 2
    assert torch.tpu.current_device() == 0
    with pytest.raises(KeyError):
        with torch.tpu.device(3):
            raise KeyError("inside")
    assert torch.tpu.current_device() == 0


def test_torch_device_context_manager():
    with torch.device("tpu:1"):
        x = torch.ones(2)
    assert x.device == torch.device("tpu", 1)


def test_synchronize():
    x = torch.randn(100, 100, device="tpu")
    y = x @ x
    torch.tpu.synchronize()
    torch.tpu.synchronize(0)
    torch.tpu.synchronize("tpu:0")
    torch.testing.assert_close(y.cpu(), x.cpu() @ x.cpu(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("index", [1, 3])
def test_tensors_on_other_devices(index):
    dev = torch.device("tpu", index)
    c = torch.arange(6.0).reshape(2, 3)
    x = c.to(dev)
    assert x.device == dev
    y = (x * 2).sum(0)
    assert y.device == dev
    torch.testing.assert_close(y.cpu(), (c * 2).sum(0))
    z = torch.zeros(3, device=dev)
    z.copy_(y)
    assert z.device == dev
    torch.testing.assert_close(z.cpu(), (c * 2).sum(0))
    assert x.untyped_storage().device == dev


def test_invalid_device_index():
    with pytest.raises(RuntimeError):
        torch.ones(2, device=f"tpu:{torch.tpu.device_count()}")


def test_generated_methods():
    x = torch.ones(2)
    assert x.tpu().device.type == "tpu" and x.tpu().is_tpu
    m = torch.nn.Linear(2, 2).tpu()
    assert m.weight.device.type == "tpu"
    assert not x.is_tpu


# ---------------------------------------------------------------------------
# Seeds
# ---------------------------------------------------------------------------


def test_manual_seed_and_initial_seed():
    torch.tpu.manual_seed(1234)
    assert torch.tpu.initial_seed() == 1234
    a = torch.rand(50, device="tpu").cpu()
    torch.tpu.manual_seed(1234)
    b = torch.rand(50, device="tpu").cpu()
    assert torch.equal(a, b)
    torch.tpu.manual_seed(4321)
    assert not torch.equal(torch.rand(50, device="tpu").cpu(), a)


def test_manual_seed_all_seeds_every_device():
    torch.tpu.manual_seed_all(99)
    for i in range(torch.tpu.device_count()):
        with torch.tpu.device(i):
            assert torch.tpu.initial_seed() == 99
    a = torch.randn(20, device="tpu:1").cpu()
    torch.tpu.manual_seed_all(99)
    assert torch.equal(torch.randn(20, device="tpu:1").cpu(), a)


def test_torch_manual_seed_seeds_tpu():
    torch.manual_seed(77)
    assert torch.tpu.initial_seed() == 77
    a = torch.randn(10, device="tpu").cpu()
    torch.manual_seed(77)
    assert torch.equal(torch.randn(10, device="tpu").cpu(), a)


def test_seed_changes_stream():
    torch.tpu.seed()
    s = torch.tpu.initial_seed()
    torch.tpu.seed()
    assert torch.tpu.initial_seed() != s


@pytest.mark.filterwarnings("ignore:TPU reports that you have")
def test_rng_state_roundtrip():
    torch.tpu.manual_seed(5)
    state = torch.tpu.get_rng_state()
    a = torch.rand(10, device="tpu").cpu()
    torch.tpu.set_rng_state(state)
    assert torch.equal(torch.rand(10, device="tpu").cpu(), a)
    with torch.random.fork_rng(device_type="tpu"):
        torch.rand(10, device="tpu")
    b = torch.rand(10, device="tpu").cpu()
    torch.tpu.set_rng_state(state)
    torch.rand(10, device="tpu")
    assert torch.equal(torch.rand(10, device="tpu").cpu(), b)


# ---------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------


def test_metrics_keys():
    m = torch_pjrt.metrics()
    assert METRIC_KEYS <= set(m), METRIC_KEYS - set(m)
    for k in METRIC_KEYS - {"ops"}:
        assert isinstance(m[k], (int, float)), k
    assert isinstance(m["ops"], dict)


def test_metrics_count_ops_and_bytes():
    x = torch.ones(4, 3)
    torch_pjrt.reset_metrics()
    m = torch_pjrt.metrics()
    assert m["ops"] == {} and m["native_calls"] == 0 and m["fallback_calls"] == 0
    t = x.to("tpu")
    y = t + 1
    y.cpu()
    m = torch_pjrt.metrics()
    assert m["ops"]["aten::add"] == (1, 0)
    assert m["native_calls"] >= 1 and m["executions"] >= 1
    assert m["host_to_device_bytes"] >= 48 and m["device_to_host_bytes"] >= 48
    assert m["cache_hits"] + m["cache_misses"] >= 1


def test_metrics_cache_hit_on_repeat():
    a = torch.ones(7, 5, device="tpu")
    torch.tpu.synchronize()
    _ = (a * 3.0).cpu()
    torch_pjrt.reset_metrics()
    _ = (a * 3.0).cpu()
    m = torch_pjrt.metrics()
    assert m["compilations"] == 0 and m["cache_hits"] >= 1


def test_metrics_report(capsys):
    torch_pjrt.reset_metrics()
    (torch.ones(3, device="tpu") * 2).cpu()
    text = torch_pjrt.metrics_report()
    out = capsys.readouterr().out
    assert text.strip() == out.strip()
    for k in METRIC_KEYS - {"ops"}:
        assert k in text
    assert "aten::mul" in text and "native" in text and "fallback" in text


def test_lowered_ops():
    ops = torch_pjrt.lowered_ops()
    assert len(ops) == len(set(ops)) > 50
    assert "aten::add" in ops and "aten::mm" in ops
    assert all("::" in o for o in ops)


# ---------------------------------------------------------------------------
# DeferAndFuse mode (TORCH_TPU_DEFER_AND_FUSE=1) regressions, each in a fresh process
# ---------------------------------------------------------------------------

DEFER_CASES = {
    "failed_op_then_new_tensor": """
        try:
            torch.arange(3.0).add_(torch.ones(4, device="tpu"))
        except RuntimeError:
            pass
        x = torch.arange(3.0).to("tpu")
        assert (x + 1).cpu().tolist() == [1.0, 2.0, 3.0], (x + 1).cpu()
    """,
    "same_program_on_two_devices": """
        a = (torch.ones(3, device="tpu:1") * 2).cpu()
        b = (torch.ones(3, device="tpu:3") * 2).cpu()
        assert b.tolist() == [2.0, 2.0, 2.0]
    """,
    "freed_storage_then_empty": """
        a = torch.ones(2, device="tpu")
        del a
        x = torch.empty(3, 4, device="tpu")
        x.fill_(1.0)
        assert x.cpu().sum().item() == 12.0
    """,
}
DEFER_XFAIL = {}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=[pytest.mark.xfail(reason=DEFER_XFAIL[n], strict=True)]
                 if n in DEFER_XFAIL else [])
    for n in DEFER_CASES
])
def test_defer_and_fuse(name):
    code = "import torch, torch_pjrt\n" + textwrap.dedent(DEFER_CASES[name]) + "\nprint('OK')\n"
    env = dict(os.environ, TORCH_TPU_DEFER_AND_FUSE="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-2000:]


def test_moving_a_module_keeps_its_parameters_and_their_ties():
    # PyTorch replaces the Parameters of a module moved to a PrivateUse1 device (they are not
    # "shallow-copy compatible" with CPU tensors), which unties shared weights; CUDA keeps
    # them. So does tpu: each move swaps the tensors into the same Parameter objects.
    emb = torch.nn.Embedding(10, 4)
    model = torch.nn.ModuleDict({"emb": emb, "head": torch.nn.Linear(4, 10, bias=False)})
    model["head"].weight = emb.weight
    before = list(model.parameters())
    emb.weight.grad = torch.ones(10, 4)
    for move in (lambda m: m.to("tpu"), lambda m: m.cpu(), lambda m: m.tpu(),
                 lambda m: m.to(torch.float64), lambda m: m.to("cpu", torch.float32)):
        move(model)
        assert model["head"].weight is model["emb"].weight
        assert all(a is b for a, b in zip(before, model.parameters(), strict=True))
    assert emb.weight.grad.device.type == "cpu" and emb.weight.device.type == "cpu"
    model.to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = model["head"](model["emb"](torch.tensor([1, 2], device="tpu")))
    out.sum().backward()
    opt.step()
    assert model["head"].weight is model["emb"].weight and emb.weight.device.type == "tpu"


# --- host memory shared with the CPU plugin's buffers (the c10d backend's Gloo hand-off) ------


def test_host_alias_reads_the_buffer_in_place():
    t = torch.randn(6, 5, device="tpu")
    ref = t.cpu()
    whole = torch.ops.torch_pjrt.host_alias(t)
    view = torch.ops.torch_pjrt.host_alias(t[1:, 2:])
    assert whole.device.type == "cpu" and torch.equal(whole, ref)
    assert torch.equal(view, ref[1:, 2:])
    assert view.data_ptr() == whole.data_ptr() + (5 + 2) * 4  # the same memory


def test_a_writable_alias_waits_for_earlier_readers_and_refuses_shared_buffers():
    for mode in (torch.tpu.EagerMode.DEFER_NEVER, torch.tpu.EagerMode.DEFER_AND_FUSE):
        with torch.tpu.set_eager_mode(mode):
            x = torch.randn(16, device="tpu") + 1
            old = x.cpu()
            doubled = x * 2  # queued or deferred: must read the old value
            a = torch.ops.torch_pjrt.host_alias(x, True)
            assert a is not None
            a.fill_(7.0)  # an in-place write, as Gloo's all_reduce makes
            assert torch.equal(doubled.cpu(), old * 2)
            assert torch.equal(x.cpu(), torch.full((16,), 7.0))
            del a
            held = torch.ops.torch_pjrt.host_alias(x)
            assert torch.ops.torch_pjrt.host_alias(x, True) is None  # `held` still reads it
            del held
            fresh = torch.empty(4, device="tpu")  # never written: nothing to write into
            assert torch.ops.torch_pjrt.host_alias(fresh, True) is None


def test_adopt_host_makes_host_memory_a_tensors_value_without_a_copy():
    dst = torch.empty(3, 4, device="tpu")
    src = torch.arange(12.0).reshape(3, 4)
    assert torch.ops.torch_pjrt.adopt_host(dst, src)
    assert torch.ops.torch_pjrt.host_alias(dst).data_ptr() == src.data_ptr()
    expect = src.clone()
    del src  # the device keeps the memory alive
    assert torch.equal((dst * 2).cpu(), expect * 2)
    dst.add_(1)  # later ops (in place too) work on it as on any buffer
    assert torch.equal(dst.cpu(), expect + 1)
    # A view, another dtype or shape: refused, the destination unchanged (callers copy).
    before = dst.cpu()
    assert not torch.ops.torch_pjrt.adopt_host(dst[1], torch.zeros(4))
    assert not torch.ops.torch_pjrt.adopt_host(dst, torch.zeros(3, 4, dtype=torch.float64))
    assert not torch.ops.torch_pjrt.adopt_host(dst, torch.zeros(12))
    assert torch.equal(dst.cpu(), before)
