"""Shared helpers for the torch_pjrt test suite.

PyTorch on the CPU is the oracle: `compare(fn, *args)` runs `fn` on tpu copies of the
arguments and on the CPU arguments and checks that results (and arguments mutated in
place) agree.

Useful command lines (from the repository root, with the venv active):

    python -m pytest tests -q                      # everything
    python -m pytest tests -q -m "not slow"        # skip the slow OpInfo directions
    python -m pytest tests/test_opinfo.py -q -k "float32 and forward"
    python -m pytest tests/test_opinfo.py --opinfo-record=/tmp/failures.txt
        # writes one expected_failures.txt line per failing OpInfo test (for triage)

OpInfo outcomes of every run are merged into .torch_pjrt_coverage/opinfo.json (git-ignored);
`python -m torch_pjrt.coverage` reports pass rates from it.
"""

import copy
import datetime
import json
import os
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_map

import torch_pjrt

TPU = torch.device("tpu")

# Where the device run of a test writes a fallback warning; tests that look for the
# warning run in a subprocess (it is issued once per op and process).
FALLBACK_WARNING = r"The operator .* is not lowered for the tpu device"


def opinfo_samples(text):
    """TORCH_PJRT_OPINFO_SAMPLES / --opinfo-samples: a count, or "all"."""
    return 1 << 30 if str(text).strip().lower() == "all" else int(text)


def pytest_addoption(parser):
    parser.addoption(
        "--opinfo-samples",
        type=opinfo_samples,
        default=opinfo_samples(os.environ.get("TORCH_PJRT_OPINFO_SAMPLES", "8")),
        help="samples per OpInfo and dtype (the first N of op.sample_inputs; 'all': every one)",
    )
    parser.addoption(
        "--opinfo-record",
        default=None,
        help="write an expected_failures.txt line for every failing OpInfo test to this file",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: OpInfo dtypes/directions beyond float32 forward")
    config.addinivalue_line("filterwarnings", f"ignore:{FALLBACK_WARNING}:UserWarning")


# ---------------------------------------------------------------------------
# Moving things between devices
# ---------------------------------------------------------------------------


def _move_tensor(x, device):
    base = x._base
    if (base is not None and base.dtype == x.dtype and base.layout == torch.strided
            and base.storage_offset() == 0):
        # A view: copy its whole base and view that the same way, so that ops that see
        # the storage (as_strided, set_) find the same neighbours as on the CPU.
        nb = base.detach().to(device)
        if nb.stride() == base.stride():
            v = nb.as_strided(x.size(), x.stride(), x.storage_offset())
            # Lazy bits (x = base.conj(), autograd's negative views) are the view's own.
            if x.is_conj() and not base.is_conj():
                v = v.conj()
            if x.is_neg() and not base.is_neg():
                v = v._neg_view()
            return v
    return x.detach().to(device)


def to_tpu(obj, device="tpu"):
    """Copies every tensor in a pytree to `device`; leaves keep requires_grad, views stay
    views of a copy of their base."""

    def move(x):
        if isinstance(x, torch.Tensor):
            y = _move_tensor(x, device)
            if x.requires_grad:
                y.requires_grad_()
            return y
        return x

    return tree_map(move, obj)


def to_cpu(obj):
    """Detached host copies of every tensor in a pytree."""
    return tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, obj)


def assert_on_device(actual, expected, device_type="tpu"):
    """Every tensor that the CPU run returned on the CPU is on `device_type` in `actual`."""
    a_leaves, a_spec = tree_flatten(actual)
    e_leaves, e_spec = tree_flatten(expected)
    assert len(a_leaves) == len(e_leaves), f"result structure differs: {a_spec} vs {e_spec}"
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves, strict=True)):
        if isinstance(e, torch.Tensor) and e.device.type == "cpu":
            assert isinstance(a, torch.Tensor), f"result {i}: expected a tensor, got {type(a)}"
            assert a.device.type == device_type, f"result {i} is on {a.device}, not {device_type}"
            assert type(a) is torch.Tensor or type(a) is type(e), f"result {i} has type {type(a)}"


def assert_close(actual, expected, atol=None, rtol=None, **kw):
    """torch.testing.assert_close after moving `actual` to the CPU (NaNs compare equal)."""
    kw.setdefault("equal_nan", True)
    if atol is None or rtol is None:
        atol = rtol = None
    torch.testing.assert_close(to_cpu(actual), expected, atol=atol, rtol=rtol, **kw)


# ---------------------------------------------------------------------------
# Parameters after several optimizer steps, refereed by a float64 run
# ---------------------------------------------------------------------------


class Float64Twin:
    """A float64 copy of a CPU model, trained by the test on the same data next to it, that
    marks the parameter elements whose float32 training is ill-conditioned.

    An element is ill-conditioned when, at some step, the CPU's float32 gradient is off its
    float64 value by more than NOISE of it: the gradient is (nearly) zero and float32
    rounding decides its sign and size (a key bias of attention, whose gradient is zero
    in exact arithmetic, is one). AdamW divides by the square root of such a tiny second
    moment, so the element moves by up to lr per step whatever its last bits were: tpu
    and the CPU can only agree there to within the optimizer's largest move.
    """

    NOISE = 1e-3

    def __init__(self, model, make_opt=None):
        """make_opt: the optimizer the test steps with `self.opt`, if it makes none itself."""
        self.model = copy.deepcopy(model).double()
        self.opt = make_opt and make_opt(self.model.parameters())
        self.noisy = {n: torch.zeros(p.shape, dtype=torch.bool)
                      for n, p in model.named_parameters()}

    @staticmethod
    def inputs(*xs):
        """The float64 run's copies of the inputs (floating ones in float64)."""
        return tuple(x.double() if x.is_floating_point() else x for x in xs)

    def note_grads(self, cpu_model):
        """Call after both runs' backward of a step: marks the noisy elements."""
        for (n, p), q in zip(cpu_model.named_parameters(), self.model.parameters(), strict=True):
            if p.grad is not None and q.grad is not None:
                self.noisy[n] |= (p.grad.double() - q.grad).abs() > self.NOISE * q.grad.abs()


def assert_trained_close(tpu_model, cpu_model, twin, max_move, atol, rtol):
    """Parameters after a training run: where the float32 update is well conditioned (see
    Float64Twin) tpu agrees with the CPU within (atol, rtol); on ill-conditioned elements
    tpu is within `max_move` (the most the optimizer can move an element over the run,
    e.g. about 2 lr per AdamW step) of the float64 run. At most a quarter of all elements
    may be ill-conditioned, so that the comparison keeps its teeth."""
    total = noisy_total = 0
    params = zip(tpu_model.named_parameters(), cpu_model.named_parameters(),
                 twin.model.parameters(), strict=True)
    for (n, p), (_, q), r in params:
        p, q, r = p.detach().cpu(), q.detach(), r.detach()
        noisy = twin.noisy[n]
        total, noisy_total = total + noisy.numel(), noisy_total + int(noisy.sum())
        torch.testing.assert_close(p[~noisy], q[~noisy], atol=atol, rtol=rtol,
                                   msg=lambda m, n=n: f"parameter {n} differs: {m}")
        dev = (p.double() - r)[noisy].abs()
        allowed = max_move + atol + rtol * r[noisy].abs()
        assert (dev <= allowed).all(), (
            f"parameter {n}: an ill-conditioned element is {dev.max().item():.3g} from the "
            f"float64 run (at most {max_move:.3g} + tolerance allowed)")
    assert noisy_total <= total / 4, f"{noisy_total} of {total} elements ill-conditioned"
    return noisy_total


# ---------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------


def fallbacks():
    """{op: fallback calls} for every op that ran on the CPU fallback since the last reset."""
    return {k: v[1] for k, v in torch_pjrt.metrics()["ops"].items() if v[1]}


def compare(fn, *args, atol=None, rtol=None, check_fallback=False, check_args=True, **kwargs):
    """Runs fn on tpu copies of args/kwargs and on the CPU originals; compares results.

    The tpu copies are made before either run, so functions that mutate their arguments
    are fine; with check_args the (possibly mutated) tensor arguments are compared too.
    With check_fallback the tpu run must not use the CPU fallback.
    Returns (cpu_result, tpu_result).
    """
    t_args, t_kwargs = to_tpu((args, kwargs))
    if check_fallback:
        torch_pjrt.reset_metrics()
    actual = fn(*t_args, **t_kwargs)
    fb = fallbacks() if check_fallback else {}
    expected = fn(*args, **kwargs)
    assert_on_device(actual, expected)
    assert_close(actual, expected, atol=atol, rtol=rtol)
    if check_args:
        assert_close((t_args, t_kwargs), (args, kwargs), atol=atol, rtol=rtol)
    assert not fb, f"ran on the CPU fallback: {fb}"
    return expected, actual


# ---------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _restore_global_state():
    """Undoes the global switches a failing test may leave behind. Each test starts with no
    shape history: with shape buckets on, sizes an earlier test saw would make this test's
    ops dynamic (bucketed, and in DeferAndFuse outside the graph), so a test's result would
    depend on the order."""
    dev = torch.tpu.current_device()
    torch_pjrt._C.forget_shape_history()
    yield
    torch_pjrt.enable_cpu_fallback = True
    if torch.tpu.current_device() != dev:
        torch.tpu.set_device(dev)


EAGER_MODES = [torch.tpu.EagerMode.DEFER_NEVER, torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING,
               torch.tpu.EagerMode.DEFER_AND_FUSE]
EAGER_MODE_IDS = ["strict", "debug", "defer"]


@pytest.fixture(params=EAGER_MODES, ids=EAGER_MODE_IDS)
def eager_mode(request):
    """Runs the test once in each eager mode (whatever mode the process started in)."""
    with torch.tpu.set_eager_mode(request.param):
        yield request.param
        torch.tpu.synchronize()


@pytest.fixture
def seed():
    torch.manual_seed(0)
    return 0


@pytest.fixture
def no_fallback():
    """The test body must not run anything on the CPU fallback."""
    torch_pjrt.reset_metrics()
    yield
    fb = fallbacks()
    assert not fb, f"ran on the CPU fallback: {fb}"


@pytest.fixture
def fallback_off():
    torch_pjrt.enable_cpu_fallback = False
    yield
    torch_pjrt.enable_cpu_fallback = True


# ---------------------------------------------------------------------------
# --opinfo-record: failing OpInfo tests as expected_failures.txt lines
# ---------------------------------------------------------------------------


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    path = item.config.getoption("--opinfo-record")
    rep = outcome.get_result()
    if not path or rep.when != "call" or not rep.failed or item.originalname != "test_opinfo":
        return
    name, dname, direction = (item.callspec.params[k] for k in ("name", "dname", "direction"))
    if call.excinfo is None:  # a strict xfail that passed
        reason = "XPASS: delete this line from expected_failures.txt"
    else:
        reason = str(call.excinfo.value).strip().split("\n")[0]
    reason = reason.split(": ", 1)[1] if reason.startswith("sample ") else reason
    reason = " ".join(reason.split())[:160]
    with open(path, "a") as f:
        f.write(f"{name} {dname} {direction}  # {reason}\n")


# ---------------------------------------------------------------------------
# OpInfo summary: outcomes per dtype and direction, and how many ran natively;
# recorded in OPINFO_JSON for `python -m torch_pjrt.coverage`
# ---------------------------------------------------------------------------

OPINFO_JSON = Path(__file__).resolve().parent.parent / ".torch_pjrt_coverage" / "opinfo.json"
OUTCOMES = ("passed", "failed", "xfailed", "skipped")

_OPINFO_RESULTS = {}


def pytest_runtest_logreport(report):
    if "test_opinfo[" not in report.nodeid:
        return
    name, dtype, direction = report.nodeid.rsplit("[", 1)[1].rstrip("]").rsplit("-", 2)
    if report.when == "call" or (report.when == "setup" and report.skipped):
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "failed"  # XPASS(strict) fails
        else:
            outcome = report.outcome
        fb = dict(report.user_properties).get("fallbacks")
        _OPINFO_RESULTS[report.nodeid] = (name, dtype, direction, outcome, fb)


def _opinfo_rows(tests):
    """{(dtype, direction): counts} from {(dtype, direction): {op: {"outcome", "fallbacks"}}}."""
    table = {}
    for key, ops in tests.items():
        row = table.setdefault(key, dict.fromkeys((*OUTCOMES, "native"), 0))
        for t in ops.values():
            row[t["outcome"]] += 1
            row["native"] += t["outcome"] == "passed" and t.get("fallbacks") == []
    return table


def _this_run():
    tests = {}
    for name, dtype, direction, outcome, fb in _OPINFO_RESULTS.values():
        t = {"outcome": outcome}
        if fb is not None:
            t["fallbacks"] = fb
        tests.setdefault((dtype, direction), {})[name] = t
    return tests


def pytest_sessionfinish(session):
    """Merges this run's OpInfo outcomes into OPINFO_JSON (runs of single files accumulate).

    Only runs with the default 8 samples per op are recorded (the pass rates are quoted for
    those); concurrent runs may overwrite each other's merge (last writer wins)."""
    if not _OPINFO_RESULTS or session.config.getoption("--opinfo-samples") < 8:
        return
    tests = {}
    try:
        old = json.loads(OPINFO_JSON.read_text())
        for dtype, dirs in old.get("results", {}).items():
            for direction, r in dirs.items():
                tests[(dtype, direction)] = dict(r.get("tests", {}))
    except (OSError, ValueError, AttributeError):
        pass  # nothing recorded yet, or an unreadable file: start afresh
    for key, ops in _this_run().items():
        tests.setdefault(key, {}).update(ops)
    results = {}
    for (dtype, direction), row in sorted(_opinfo_rows(tests).items()):
        results.setdefault(dtype, {})[direction] = {
            **row, "tests": dict(sorted(tests[(dtype, direction)].items()))}
    doc = {"torch": torch.__version__,
           "updated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "samples": session.config.getoption("--opinfo-samples"),
           "results": results}
    OPINFO_JSON.parent.mkdir(exist_ok=True)
    tmp = OPINFO_JSON.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(OPINFO_JSON)


def pytest_terminal_summary(terminalreporter):
    if not _OPINFO_RESULTS:
        return
    table = _opinfo_rows(_this_run())
    w = terminalreporter
    w.section("OpInfo summary")
    w.line(f"{'dtype':<8} {'direction':<9} {'passed':>7} {'native':>7} {'xfailed':>8} "
           f"{'skipped':>8} {'failed':>7} {'pass rate':>10}")
    for (dt, d), r in sorted(table.items()):
        ran = r["passed"] + r["failed"] + r["xfailed"]
        rate = f"{100 * r['passed'] / ran:.1f}%" if ran else "-"
        w.line(f"{dt:<8} {d:<9} {r['passed']:>7} {r['native']:>7} {r['xfailed']:>8} "
               f"{r['skipped']:>8} {r['failed']:>7} {rate:>10}")
    w.line("native: passed without any CPU fallback; pass rate: passed / (passed + xfailed "
           "+ failed)")
    w.line(f"recorded in {OPINFO_JSON} (python -m torch_pjrt.coverage)")


def _buckets(on):
    was = torch_pjrt.set_shape_buckets(on)
    yield
    torch_pjrt.set_shape_buckets(was)


@pytest.fixture
def shape_buckets():
    """Shape buckets on for one test (torch_pjrt.set_shape_buckets), the previous state after."""
    yield from _buckets(True)


@pytest.fixture
def exact_shapes():
    """Shape buckets off for one test: what it checks is one program per exact shape."""
    yield from _buckets(False)
