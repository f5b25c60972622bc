"""torch.profiler with ProfilerActivity.PrivateUse1 (the shim's Kineto plugin),
torch.tpu.profiler (device tracks next to torch.profiler's host trace), PyTorch's own
per-op device time (torch.autograd.profiler with use_device="tpu"), and
torch.tpu.compiler.custom_compiler_options."""

import json

import pytest
import torch

import torch_pjrt

EM = torch.tpu.EagerMode


def _new_shape_input():
    # A shape no other test compiles, so its first run is not a cache hit.
    return torch.randn(37, 41, device="tpu")


def test_torch_profiler_records_device_runs_through_kineto(tmp_path):
    """The standard API: key_averages() has device time per op, the Chrome trace has the
    device's runs as kernel events (device, stream, program source) on the host's clock."""
    from torch.profiler import ProfilerActivity, profile
    x = torch.randn(29, 43, device="tpu")  # not _new_shape_input's: that one must compile
    torch.tpu.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]) as prof:
        y = torch.tanh(x) @ x.T
        y.cpu()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    host = {e["name"]: e for e in events if e.get("cat") == "cpu_op"}
    assert kernels, "no device activity reached the trace"
    assert all(e["args"]["device"] == "tpu:0" for e in kernels)
    assert {e["args"]["program"] for e in kernels} <= {"cache hit", "compiled", "loaded from disk"}
    names = {e["name"] for e in kernels}
    if torch.tpu.eager_mode == EM.DEFER_AND_FUSE:
        assert any(n.startswith("deferred graph") for n in names)
        return
    assert {"aten::tanh", "aten::mm"} <= names
    mm = next(e for e in kernels if e["name"] == "aten::mm")
    # The device runs the op after the host dispatched it (both on Kineto's clock).
    assert mm["ts"] >= host["aten::mm"]["ts"] - 1000
    assert mm["ts"] <= host["aten::mm"]["ts"] + 10e6
    timed = {e.key: e.self_device_time_total for e in prof.key_averages()
             if e.self_device_time_total > 0}
    assert "aten::mm" in timed and "aten::tanh" in timed
    # Without the PrivateUse1 activity nothing is recorded on the device.
    with profile(activities=[ProfilerActivity.CPU]) as cpu_only:
        (x * 2).cpu()
    assert not [e for e in cpu_only.key_averages() if e.self_device_time_total > 0]


def test_device_runs_are_recorded_per_op(tmp_path):
    if torch.tpu.eager_mode == EM.DEFER_AND_FUSE:
        pytest.skip("DeferAndFuse runs ops as graphs (test_deferred_graph_is_one_run)")
    x = _new_shape_input()
    torch.tpu.synchronize()
    with torch.tpu.profiler.profile() as prof:
        y = torch.tanh(x) * 3
        y = torch.tanh(x) * 3  # the same programs again: cache hits
        y.cpu()
    runs = [e for e in prof.device_events if e["name"] in ("aten::tanh", "aten::mul")]
    assert [e["name"] for e in runs] == ["aten::tanh", "aten::mul"] * 2
    assert runs[0]["program"] in ("compiled", "loaded from disk")
    assert runs[0]["program_seconds"] > 0
    assert {e["program"] for e in runs[2:]} == {"cache hit"}
    for e in runs:
        assert e["device"] == 0 and e["stream"] == 0
        assert e["queued_ns"] <= e["start_ns"] <= e["end_ns"]
    table = prof.device_table()
    assert "aten::tanh" in table and "device ms" in table
    assert prof.device_averages()["aten::mul"]["calls"] == 2


def test_chrome_trace_has_device_tracks_aligned_with_host_calls(tmp_path):
    if torch.tpu.eager_mode == EM.DEFER_AND_FUSE:
        pytest.skip("DeferAndFuse runs ops as graphs (test_deferred_graph_is_one_run)")
    x = _new_shape_input()
    side = torch.tpu.Stream()
    with torch.tpu.profiler.profile() as prof:
        a = x @ x.T
        with torch.tpu.stream(side):
            b = torch.exp(x)
        a.cpu(), b.cpu()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    dev = {e["name"]: e for e in events if e.get("cat") == "tpu_program"}
    host = {e["name"]: e for e in events if e.get("cat") == "cpu_op"}
    assert dev["aten::mm"]["tid"] == 0 and dev["aten::exp"]["tid"] == side.stream_id
    names = {(e["pid"], e["tid"], e["args"]["name"]) for e in events
             if e.get("ph") == "M" and e["name"] in ("process_name", "thread_name")}
    pid = dev["aten::mm"]["pid"]
    assert (pid, 0, "tpu:0") in names and (pid, side.stream_id, f"stream {side.stream_id}") in names
    # The device runs the op after the host dispatched it (both on the wall clock).
    assert dev["aten::mm"]["ts"] >= host["aten::mm"]["ts"] - 1000
    assert dev["aten::mm"]["ts"] <= host["aten::mm"]["ts"] + 10e6


def test_deferred_graph_is_one_run():
    x = _new_shape_input()
    with torch.tpu.set_eager_mode(EM.DEFER_AND_FUSE), torch.tpu.profiler.profile() as prof:
        (torch.sin(x) + 1).sum().item()
    graphs = [e for e in prof.device_events if e["name"].startswith("deferred graph")]
    assert len(graphs) == 1 and "3 ops" in graphs[0]["name"]


def test_pytorch_profiler_shows_device_time_per_op():
    if torch.tpu.eager_mode == EM.DEFER_AND_FUSE:
        pytest.skip("DeferAndFuse: ops run fused at the flush, their own device time is ~0")
    x = torch.randn(256, 256, device="tpu")
    (x @ x).cpu()
    with torch.autograd.profiler.profile(use_device="tpu", use_kineto=False) as prof:
        (x @ x).cpu()
    mm = [e for e in prof.key_averages() if e.key == "aten::mm"][0]
    assert mm.self_device_time_total > 0
    assert "TPU total" in prof.key_averages().table()


def test_custom_compiler_options_recompile_and_restore():
    x = torch.arange(16.0, device="tpu")
    torch.tpu.synchronize()  # DeferAndFuse: x is an input of the graphs below, not part of them
    want = (x * 3 + 1).cpu()
    torch_pjrt.reset_metrics()
    with torch.tpu.compiler.custom_compiler_options(xla_cpu_enable_fast_math=False):
        got = (x * 3 + 1).cpu()
        inner = torch_pjrt.metrics()["cache_misses"]
        with torch.tpu.compiler.custom_compiler_options({"xla_cpu_max_isa": "AVX2"}):
            assert torch.tpu.compiler._current() == {"xla_cpu_enable_fast_math": False,
                                                    "xla_cpu_max_isa": "AVX2"}
        assert torch.tpu.compiler._current() == {"xla_cpu_enable_fast_math": False}
    assert torch.tpu.compiler._current() == {}
    assert torch.equal(got, want)
    assert inner >= 1  # programs of their own under the options (DeferAndFuse: one graph)
    (x * 3 + 1).cpu()
    assert torch_pjrt.metrics()["cache_misses"] == inner  # the earlier programs again


def test_custom_compiler_options_errors():
    x = torch.arange(4.0, device="tpu")
    torch.tpu.synchronize()
    with pytest.raises(RuntimeError, match="no_such_xla_option"):
        with torch.tpu.compiler.custom_compiler_options(no_such_xla_option=1):
            (x * 7).cpu()
    assert torch.tpu.compiler._current() == {}
    with pytest.raises(TypeError, match="expected a bool, int, float or str"):
        with torch.tpu.compiler.custom_compiler_options(xla_cpu_enable_fast_math=[1]):
            pass
    assert (x * 7).sum().item() == 42.0


def test_a_deferred_graph_that_fails_to_compile_fails_its_values_only():
    with torch.tpu.set_eager_mode(EM.DEFER_AND_FUSE):
        x = torch.arange(4.0, device="tpu")  # recorded in the graph that will fail
        with torch.tpu.compiler.custom_compiler_options(no_such_xla_option=1):
            with pytest.raises(RuntimeError, match="no_such_xla_option"):
                (x * 7).cpu()
        with pytest.raises(RuntimeError, match="no_such_xla_option"):
            x.cpu()  # computed in the failed graph: raises, never hangs
        y = torch.ones(2, device="tpu")
        assert y.sum().item() == 2.0
