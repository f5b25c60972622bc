"""Streams and events: torch.tpu.Stream/Event, current/default streams, stream contexts,
non_blocking copies on side streams, in every eager mode.

A stream is an ordered queue of device work with its own executor thread (Strict); ops on
different streams may run concurrently. A job that reads a tensor another stream is still
computing waits for it, so results never depend on a missing wait_stream.
"""

import gc
import threading

import pytest
import torch
import torch.nn as nn

EM = torch.tpu.EagerMode
def test_api_surface():
    s = torch.tpu.Stream()
    assert isinstance(s, torch.Stream) and s.device == torch.device("tpu", 0)
    assert s.stream_id != 0
    assert torch.tpu.default_stream().stream_id == 0
    assert torch.tpu.current_stream() == torch.tpu.default_stream()
    plain = torch.Stream(device="tpu")
    assert plain.device_type == s.device_type and plain.stream_id != 0
    with torch.tpu.stream(s):
        assert torch.tpu.current_stream() == s
        assert torch.accelerator.current_stream().stream_id == s.stream_id
    assert torch.tpu.current_stream().stream_id == 0
    torch.tpu.set_stream(s)
    assert torch.tpu.current_stream() == s
    torch.tpu.set_stream(torch.tpu.default_stream())
    with torch.tpu.stream(None):
        assert torch.tpu.current_stream().stream_id == 0
    ev = torch.tpu.Event(enable_timing=True)
    assert isinstance(ev, torch.Event) and ev.query()  # never recorded: nothing to wait for
    x = torch.ones(2, device="tpu:1")
    with torch.tpu.device_of(x):
        assert torch.tpu.current_device() == 1
    assert torch.tpu.current_device() == 0


def test_current_stream_is_per_thread():
    s = torch.tpu.Stream()
    seen = []
    with torch.tpu.stream(s):
        t = threading.Thread(target=lambda: seen.append(torch.tpu.current_stream().stream_id))
        t.start()
        t.join()
        assert torch.tpu.current_stream() == s
    assert seen == [0]


def test_wait_stream_orders_work(eager_mode):
    x = torch.randn(64, 64)
    s = torch.tpu.Stream()
    a = x.to("tpu")
    with torch.tpu.stream(s):
        s.wait_stream(torch.tpu.default_stream())
        b = a @ a + 1
    torch.tpu.current_stream().wait_stream(s)
    c = b.relu().sum(0)
    torch.testing.assert_close(c.cpu(), (x @ x + 1).relu().sum(0), rtol=1e-5, atol=1e-5)


def test_reading_another_streams_result_without_a_wait_is_still_right(eager_mode):
    x = torch.arange(1000.0)
    s = torch.tpu.Stream()
    with torch.tpu.stream(s):
        a = x.to("tpu") * 3
        for _ in range(20):
            a = a + 1
    b = a * 2  # default stream, no wait_stream: the job waits for a's producer
    assert torch.equal(b.cpu(), (x * 3 + 20) * 2)


def test_events_query_synchronize_wait_and_time(eager_mode):
    s = torch.tpu.Stream()
    start, end = torch.tpu.Event(enable_timing=True), torch.tpu.Event(enable_timing=True)
    x = torch.randn(128, 128, device="tpu")
    start.record()
    for _ in range(5):
        x = torch.tanh(x @ x)
    end.record()
    end.synchronize()
    assert end.query() and start.query()
    assert start.elapsed_time(end) >= 0.0
    with pytest.raises(RuntimeError, match="must be recorded"):
        start.elapsed_time(torch.tpu.Event())
    ev = end
    ev.wait(s)  # s's later work waits for the default stream's
    with torch.tpu.stream(s):
        y = x.sum()
    s.synchronize()
    assert s.query()
    torch.testing.assert_close(y.cpu(), x.cpu().sum(), rtol=1e-5, atol=1e-4)


def test_streams_run_concurrently():
    """A short op on one stream finishes while a long chain on another is still running
    (Strict: each stream has its thread; Debug and DeferAndFuse run work as they issue or
    flush it)."""
    if torch.tpu.eager_mode != EM.DEFER_NEVER:
        pytest.skip("only Strict runs streams on their own threads")
    busy, quick = torch.tpu.Stream(), torch.tpu.Stream()
    assert busy != quick
    x = torch.randn(512, 512, device="tpu")
    (x @ x).sum().item()  # compiled before timing
    with torch.tpu.stream(busy):
        y = x
        for _ in range(300):
            y = y @ x / 512
        busy_done = busy.record_event()
    with torch.tpu.stream(quick):
        z = torch.ones(4, device="tpu") + 1
        quick_done = quick.record_event()
    quick_done.synchronize()
    overlapped = not busy_done.query()
    busy_done.synchronize()
    assert z.sum().item() == 8.0
    assert overlapped, "the quick stream waited for the busy one"
    assert torch.isfinite(y).all().item()


def test_nonblocking_copy_on_a_side_stream(eager_mode):
    s = torch.tpu.Stream()
    batches = [torch.randn(256, 64) for _ in range(3)]
    want = [b.clone() for b in batches]
    got = []
    for b in batches:
        with torch.tpu.stream(s):
            d = b.to("tpu", non_blocking=True)
        torch.tpu.current_stream().wait_stream(s)
        got.append(d * 1.0)
    del batches, b  # the queued uploads keep their sources alive
    gc.collect()
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.cpu(), w)
    dst = torch.zeros(4, device="tpu")
    dst.copy_(torch.arange(4.0), non_blocking=True)  # into a written tensor: copies now
    assert dst.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_failure_on_a_side_stream_is_raised_by_synchronize():
    s = torch.tpu.Stream()
    x = torch.arange(4.0, device="tpu")
    torch.tpu.synchronize()  # computed before (DeferAndFuse: not part of the failing graph)
    with pytest.raises(IndexError, match="out of bounds"):  # Debug raises at the op
        with torch.tpu.stream(s):
            y = x[torch.tensor([7], device="tpu")]
        torch.tpu.synchronize()
        y.cpu()
    assert x.sum().item() == 6.0


def test_backward_on_a_side_stream_matches_cpu(eager_mode):
    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    tpu = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).to("tpu")
    tpu.load_state_dict(cpu.state_dict())
    x = torch.randn(4, 8)
    cpu(x).pow(2).sum().backward()
    s = torch.tpu.Stream()
    with torch.tpu.stream(s):
        loss = tpu(x.to("tpu")).pow(2).sum()
        loss.backward()
    torch.tpu.current_stream().wait_stream(s)
    for p, q in zip(tpu.parameters(), cpu.parameters(), strict=True):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-5, atol=1e-6)


def test_record_stream_is_accepted():
    s = torch.tpu.Stream()
    a = torch.ones(8, device="tpu")
    with torch.tpu.stream(s):
        b = a * 2
    b.record_stream(s)
    a.record_stream(torch.tpu.current_stream())
    del a
    assert b.sum().item() == 16.0
    with pytest.raises(RuntimeError, match="expected a tpu stream"):
        b.record_stream(torch.Stream(device="cpu"))


def test_cross_stream_in_place_chains(eager_mode):
    """Streams reading and rewriting each other's tensors without waits: each job waits for
    the writers queued before it, never for later ones (which would deadlock here)."""
    s = torch.tpu.Stream()
    acc = torch.ones(256, device="tpu")
    want = torch.ones(256)
    for _ in range(30):
        with torch.tpu.stream(s):
            t = acc * 2  # side stream reads acc, written last on the default stream
        acc.add_(t)  # default stream reads t (side) and rewrites acc
        want += want * 2
    torch.testing.assert_close(acc.cpu(), want)
