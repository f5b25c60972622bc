"""The three eager modes: API, DeferAndFuse caching, mode switches, Debug errors."""

import os
import subprocess
import sys

import pytest
import torch

import torch_pjrt

EM = torch.tpu.EagerMode


def _mlp(dev, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    ).to(dev)


def _clean_env():
    """The environment without the mode selection the suite may run under."""
    drop = ("TORCH_TPU_LAUNCH_BLOCKING", "TORCH_TPU_DEFER_AND_FUSE")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _train(dev, make_opt, steps, schedule=False, on_step=None):
    m = _mlp(dev)
    opt = make_opt(m.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9) if schedule else None
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 16, generator=g).to(dev)
    y = torch.randint(0, 4, (8,), generator=g).to(dev)
    losses = []
    for i in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        if sched:
            sched.step()
        losses.append(loss.item())
        if on_step:
            on_step(i)
    return losses


def test_api_and_context_manager_restores_after_error():
    # The suite runs once per mode: the starting mode comes from the environment.
    start = torch.tpu.eager_mode
    expected = (EM.DEFER_AND_FUSE if os.environ.get("TORCH_TPU_DEFER_AND_FUSE") == "1"
                else EM.DEFER_NEVER_AND_LAUNCH_BLOCKING
                if os.environ.get("TORCH_TPU_LAUNCH_BLOCKING") == "1" else EM.DEFER_NEVER)
    assert start == expected
    torch.tpu.eager_mode = EM.DEFER_NEVER_AND_LAUNCH_BLOCKING
    assert torch.tpu.eager_mode == EM.DEFER_NEVER_AND_LAUNCH_BLOCKING
    torch.tpu.eager_mode = EM.DEFER_NEVER
    with pytest.raises(ZeroDivisionError):
        with torch.tpu.set_eager_mode(EM.DEFER_AND_FUSE):
            assert torch.tpu.eager_mode == EM.DEFER_AND_FUSE
            raise ZeroDivisionError
    assert torch.tpu.eager_mode == EM.DEFER_NEVER
    with pytest.raises(TypeError):
        torch.tpu.eager_mode = 2
    torch.tpu.eager_mode = start


@pytest.mark.parametrize(
    "env,expected",
    [("TORCH_TPU_LAUNCH_BLOCKING", "DEFER_NEVER_AND_LAUNCH_BLOCKING"),
     ("TORCH_TPU_DEFER_AND_FUSE", "DEFER_AND_FUSE")],
)
def test_environment_selects_mode(env, expected):
    code = "import torch, torch_pjrt; print(torch.tpu.eager_mode.name)"
    out = subprocess.run(
        [sys.executable, "-c", code], env={**_clean_env(), env: "1"},
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() == expected


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.AdamW(p, lr=0.01, foreach=True),
        lambda p: torch.optim.AdamW(p, lr=0.01, foreach=False),
    ],
    ids=["sgd", "adamw-foreach", "adamw-single"],
)
def test_defer_and_fuse_compiles_nothing_after_second_step(make_opt):
    cpu = _train("cpu", make_opt, 6, schedule=True)
    counts, donated = [], []

    def on_step(i):
        torch.tpu.synchronize()  # queued work (split reads) counts its donations when it runs
        m = torch_pjrt.metrics()
        counts.append(m["compilations"])
        donated.append(m["donated_buffers"])

    with torch.tpu.set_eager_mode(EM.DEFER_AND_FUSE):
        torch_pjrt.reset_metrics()
        tpu = _train("tpu", make_opt, 6, schedule=True, on_step=on_step)
        m = torch_pjrt.metrics()
    torch.testing.assert_close(tpu, cpu, rtol=1e-4, atol=1e-6)
    assert counts[2:] == [counts[1]] * 4, counts
    # Every step updates the 4 parameters (and optimizer state) in their own buffers.
    steps = [b - a for a, b in zip(donated, donated[1:], strict=False)]
    assert min(steps) >= 4, donated
    assert m["flushes"] >= 6 and m["ops_per_flush"] > 5
    assert m["fallback_calls"] == 0


@pytest.mark.parametrize(
    "make_opt",
    [lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), lambda p: torch.optim.AdamW(p, lr=0.01)],
    ids=["sgd", "adamw"],
)
@pytest.mark.parametrize("how", ["eager", "compiled"])
def test_defer_and_fuse_loop_without_reads_flushes_on_steps(make_opt, how):
    """A loop that reads no value per step (the losses are read at the end) runs every two
    optimizer steps, one structure compiled once, instead of at the size limit. Also with
    torch.compile'd model and optimizer step, whose Python step hooks Dynamo traced away:
    the compiled update graph's replay ends the step."""
    m = _mlp("cpu")
    opt = make_opt(m.parameters())
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    counts = []
    with torch.tpu.set_eager_mode(EM.DEFER_AND_FUSE):
        torch.tpu.synchronize()
        torch_pjrt.reset_metrics()
        mt = _mlp("tpu")
        opt_t = make_opt(mt.parameters())
        xt, yt = x.to("tpu"), y.to("tpu")
        model_t, step_t = mt, opt_t.step
        if how == "compiled":
            model_t = torch.compile(mt, backend="tpu")
            step_t = torch.compile(opt_t.step, backend="tpu")
        losses, losses_t = [], []
        for model, o, step, a, b, out in ((m, opt, opt.step, x, y, losses),
                                          (model_t, opt_t, step_t, xt, yt, losses_t)):
            for _ in range(12):  # CPU first: its own step hooks would end the tpu steps
                o.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(a), b)
                loss.backward()
                step()
                out.append(loss.detach())
                if out is losses_t:
                    counts.append(torch_pjrt.metrics()["compilations"])
        met = torch_pjrt.metrics()
        got = [v.item() for v in losses_t]
    torch.testing.assert_close(got, [v.item() for v in losses], rtol=1e-4, atol=1e-6)
    # Every second step: the step end finds the previous step still pending.
    assert 5 <= met["flush_reasons"].get("optimizer step", 0) <= 7, met["flush_reasons"]
    assert "size limit" not in met["flush_reasons"], met["flush_reasons"]
    assert counts[5:] == [counts[5]] * 7, counts


@pytest.fixture
def from_strict():
    """Mode-switch tests start in Strict whatever mode the suite runs in."""
    with torch.tpu.set_eager_mode(EM.DEFER_NEVER):
        yield


def test_mode_switch_mid_program_flushes_and_stays_correct(from_strict):
    a = torch.randn(32, 32)
    b = torch.randn(32, 32)
    ref = ((a @ b).relu() * 2 + a).sum(0)
    x, y = a.to("tpu"), b.to("tpu")
    torch_pjrt.reset_metrics()
    with torch.tpu.set_eager_mode(EM.DEFER_AND_FUSE):
        z = (x @ y).relu()
        assert torch_pjrt.metrics()["flushes"] == 0
    # Leaving DeferAndFuse ran the pending graph.
    assert torch_pjrt.metrics()["flush_reasons"].get("mode change") == 1
    z = z * 2
    with torch.tpu.set_eager_mode(EM.DEFER_NEVER_AND_LAUNCH_BLOCKING):
        z = z + x
    with torch.tpu.set_eager_mode(EM.DEFER_AND_FUSE):
        out = z.sum(0)
        torch.testing.assert_close(out.cpu(), ref)


def test_defer_and_fuse_views_and_inplace():
    base = torch.arange(12.0).reshape(3, 4)
    t = base.to("tpu")
    with torch.tpu.set_eager_mode(EM.DEFER_AND_FUSE):
        v = t[1:, ::2]
        v.mul_(10)
        t.t()[0].add_(1)
        w = t.clone()
        t.zero_()
    base[1:, ::2].mul_(10)
    base.t()[0].add_(1)
    torch.testing.assert_close(w.cpu(), base)
    assert t.cpu().abs().sum().item() == 0


def test_defer_and_fuse_input_overwritten_from_the_host():
    """A pending graph reads x, then x is replaced by a copy from the host (not a graph op):
    ops before see the old x, ops after the new one (the graph used to bind x once and give
    later readers its old value)."""
    x = torch.ones(4, device="tpu")
    torch.tpu.synchronize()
    with torch.tpu.set_eager_mode(EM.DEFER_AND_FUSE):
        before = x * 2
        x.copy_(torch.full((4,), 5.0))
        after = x + 1
    assert before.cpu().tolist() == [2.0] * 4
    assert after.cpu().tolist() == [6.0] * 4


def test_intermediates_are_not_written_out():
    x = torch.randn(64, device="tpu")
    with torch.tpu.set_eager_mode(EM.DEFER_AND_FUSE):
        torch_pjrt.reset_metrics()
        y = x
        for _ in range(10):
            y = y * 1.5 + 1.0
        out = y.sum()
        del y
        before = torch_pjrt.metrics()["flushes"]
        val = out.item()
        assert torch_pjrt.metrics()["flushes"] == before + 1
    ref = x.cpu()
    for _ in range(10):
        ref = ref * 1.5 + 1.0
    assert abs(val - ref.sum().item()) < 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("how", ["defer_and_fuse", "compile"])
def test_fused_half_precision_rounds_like_eager(dtype, how):
    """A chain of half-precision ops fused into one program rounds every intermediate to the
    dtype, as eager PyTorch (and Strict) does: the same bits as the CPU, not XLA's excess
    f32 precision inside a fusion."""
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(4096, generator=g).to(dtype) for _ in range(2))

    def f(a, b):
        return ((a * b + a) * b - a).exp() * 0.5 + (a / (b.abs() + 1)).sqrt()

    ref = f(x, y)
    xt, yt = x.to("tpu"), y.to("tpu")
    if how == "compile":
        torch._dynamo.reset()
        got = torch.compile(f, backend="tpu")(xt, yt).cpu()
    else:
        with torch.tpu.set_eager_mode(EM.DEFER_AND_FUSE):
            got = f(xt, yt).cpu()
    torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)


def _run_subprocess(code, **env):
    return subprocess.run(
        [sys.executable, "-c", code], env={**_clean_env(), **env}, capture_output=True, text=True
    )


def test_debug_mode_nan_check_names_the_op():
    code = (
        "import torch, torch_pjrt\n"
        "x = torch.tensor([1.0, -1.0], device='tpu')\n"
        "y = x * 2\n"
        "try:\n"
        "    z = y.log()\n"
        "except RuntimeError as e:\n"
        "    print('ERR', e)\n"
    )
    out = _run_subprocess(code, TORCH_TPU_LAUNCH_BLOCKING="1", TORCH_TPU_CHECK_NANS="1")
    assert "ERR aten::log produced NaN or Inf" in out.stdout, out.stdout + out.stderr
    assert "[2]" in out.stdout


def test_debug_mode_raises_at_the_op():
    with torch.tpu.set_eager_mode(EM.DEFER_NEVER_AND_LAUNCH_BLOCKING):
        a = torch.ones(3, device="tpu")
        with pytest.raises(RuntimeError, match="must match the size"):
            a + torch.ones(4, device="tpu")
        assert (a + 1).sum().item() == 6


def _async_failure(body, dependent, last):
    """A script: `body` issues ops (one fails on the device), then the next synchronization,
    a read of `dependent` (computed from the failed op) and `last` report what they see."""
    return (
        "import torch, torch_pjrt\n" + body + "print('DISPATCHED')\n"
        "try:\n"
        "    torch.tpu.synchronize()\n"
        "    print('NO ERROR')\n"
        "except RuntimeError as e:\n"
        "    print('SYNC', e)\n"
        "try:\n"
        f"    {dependent}.cpu()\n"
        "except RuntimeError as e:\n"
        "    print('READ', e)\n" + last
    )


def _failure_lines(out, first, op):
    """Checks an `_async_failure` script's output: `first` lines, then the synchronization and
    the dependent read raising `op`'s failure; returns the lines after them."""
    lines = out.stdout.splitlines()
    n = len(first)
    assert lines[:n] == first, out.stdout + out.stderr
    assert lines[n].startswith(f"SYNC {op} failed on the tpu device"), out.stdout
    assert lines[n + 1].startswith(f"READ {op} failed"), out.stdout
    return lines[n + 2:]


ASYNC_FAILURE = _async_failure(
    "a = torch.ones(3, device='tpu')\n"
    "b = a * 2\n"  # fails on the device (injected)
    "c = b + 1\n"  # depends on the failed op: must not run on garbage
    "d = a + 1\n",  # independent: fine
    "c",
    "print('D', d.cpu().tolist())\n"
    "torch.tpu.synchronize()\n"
    "print('CLEAN')\n",
)


def test_strict_async_failure_surfaces_at_next_sync():
    out = _run_subprocess(ASYNC_FAILURE, TORCH_PJRT_INJECT_FAILURE="aten::mul",
                          TORCH_TPU_DEFER_AND_FUSE="0", TORCH_TPU_LAUNCH_BLOCKING="0")
    rest = _failure_lines(out, ["DISPATCHED"], "aten::mul")
    assert rest == ["D [2.0, 2.0, 2.0]", "CLEAN"], out.stdout


COMPILED_ASYNC_FAILURE = _async_failure(
    "f = torch.compile(lambda x: (x * 2).sum(), backend='tpu')\n"
    "x = torch.ones(3, device='tpu')\n"
    "print('FIRST', f(x).item())\n"  # captured and run at once: not a replay
    "y = f(x)\n"  # a replay: queued on the worker, fails there (injected)
    "z = y + 1\n",
    "z",
    "print('X', x.cpu().tolist())\n",
)


def test_strict_compiled_replay_is_queued_and_its_failure_surfaces_at_sync():
    out = _run_subprocess(COMPILED_ASYNC_FAILURE, TORCH_PJRT_INJECT_FAILURE="compiled graph",
                          TORCH_TPU_DEFER_AND_FUSE="0", TORCH_TPU_LAUNCH_BLOCKING="0")
    rest = _failure_lines(out, ["FIRST 6.0", "DISPATCHED"], "compiled graph")
    assert rest == ["X [1.0, 1.0, 1.0]"], out.stdout


def test_debug_failure_raises_at_the_op():
    code = (
        "import torch, torch_pjrt\n"
        "a = torch.ones(3, device='tpu')\n"
        "try:\n"
        "    b = a * 2\n"
        "    print('NO ERROR')\n"
        "except RuntimeError as e:\n"
        "    print('OP', e)\n"
    )
    out = _run_subprocess(code, TORCH_PJRT_INJECT_FAILURE="aten::mul",
                          TORCH_TPU_DEFER_AND_FUSE="0", TORCH_TPU_LAUNCH_BLOCKING="1")
    assert out.stdout.startswith("OP aten::mul failed on the tpu device"), out.stdout + out.stderr


SPLIT_READS = """
import torch, torch_pjrt
torch.manual_seed(0)
cpu = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
tpu = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
tpu.load_state_dict(cpu.state_dict())
tpu = tpu.to('tpu')
x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
xt, yt = x.to('tpu'), y.to('tpu')
def steps(m, x, y, n, on_step=lambda: None):
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    out = []
    for _ in range(n):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        sched.step()
        out.append(loss.item())
        on_step()
    return out
compiles = []
ref = steps(cpu, x, y, 6)
got = steps(tpu, xt, yt, 6, lambda: compiles.append(torch_pjrt.metrics()['compilations']))
torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)
m = torch_pjrt.metrics()
print('SPLIT', m['split_flushes'] >= 6, 'COMPILES', compiles[2:] == [compiles[1]] * 4,
      'DONATED', m['donated_buffers'] >= 6 * 4)
# The read returned before the queued update ran: a recorded op reads the weight later,
# and a host write in between does not change what it recorded.
w = tpu[0].weight
z = w * 2
w.data.copy_(torch.zeros(32, 16))
torch.testing.assert_close(z.cpu(), cpu[0].weight.detach() * 2, rtol=1e-4, atol=1e-6)
torch.testing.assert_close(w.cpu(), torch.zeros(32, 16))
for p, q in zip(tpu.parameters(), cpu.parameters()):
    if p is not w:
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-6)
# A bad target fails the read part's check: nothing is queued, the weights keep their values.
before = [p.detach().cpu() for p in tpu.parameters()]
try:
    steps(tpu, xt, torch.tensor([0, 1, 2, 9, 0, 1, 2, 3]).to('tpu'), 1)
except IndexError as e:
    print('INDEX', str(e).splitlines()[0])
after = [p.detach().cpu() for p in tpu.parameters()]
print('KEPT', all(torch.equal(a, b) for a, b in zip(before, after)))
# A good step left pending (no read), then a read whose part fails (a bad target): the
# pending update is work the read does not need (split off), and it still takes effect.
for p, q in zip(tpu.parameters(), cpu.parameters()):
    q.data.copy_(p.detach().cpu())
opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (cpu, tpu)]
for m, opt, a, b in ((cpu, opts[0], x, y), (tpu, opts[1], xt, yt)):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(m(a), b).backward()
    opt.step()
split = torch_pjrt.metrics()['split_flushes']
try:
    logits = xt @ torch.ones(16, 4, device='tpu')  # reads no weight: the update is not needed
    torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 2, 9, 0, 1, 2, 3]).to('tpu')).item()
except IndexError as e:
    print('INDEX', str(e).splitlines()[0])
print('PENDING', torch_pjrt.metrics()['split_flushes'] > split, all(
    torch.allclose(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-6)
    for p, q in zip(tpu.parameters(), cpu.parameters())))
"""


def test_split_reads_run_only_what_the_read_needs():
    out = _run_subprocess(SPLIT_READS, TORCH_TPU_DEFER_AND_FUSE="1",
                          TORCH_TPU_DEFER_SPLIT_READS="1")
    lines = out.stdout.splitlines()
    assert lines[:1] == ["SPLIT True COMPILES True DONATED True"], out.stdout + out.stderr
    assert lines[1:] == ["INDEX Target 9 is out of bounds.", "KEPT True",
                         "INDEX Target 9 is out of bounds.", "PENDING True True"], out.stdout


SPLIT_READ_FAILURE = _async_failure(
    "m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))\n"
    "m = m.to('tpu')\n"
    "opt = torch.optim.AdamW(m.parameters(), lr=0.1)\n"
    "x = torch.ones(2, 4, device='tpu')\n"
    "loss = m(x).square().mean()\n"
    "loss.backward()\n"
    "opt.step()\n"
    "print('LOSS', loss.item() >= 0)\n",  # runs the forward; the update is queued and fails
    "m[0].weight",
    "",
)


def test_split_read_queued_part_failure_surfaces_at_sync():
    out = _run_subprocess(SPLIT_READ_FAILURE, TORCH_PJRT_INJECT_FAILURE="deferred graph",
                          TORCH_TPU_DEFER_AND_FUSE="1", TORCH_TPU_DEFER_SPLIT_READS="1")
    assert _failure_lines(out, ["LOSS True", "DISPATCHED"], "deferred graph") == [], out.stdout
