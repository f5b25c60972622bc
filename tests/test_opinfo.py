"""Every OpInfo of PyTorch's op_db, on tpu against the CPU.

One test per (op name[.variant], dtype, direction):
  forward   the first N samples of op.sample_inputs('cpu', dtype) (N = --opinfo-samples,
            default 8) run through the function variant on tpu copies and on the CPU;
            outputs (after the sample's output_process_fn_grad) must be close, with
            the tolerances PyTorch's OpInfo grants the op for that dtype, on tpu.
  backward  float32 and complex64: gradients of sum(outputs) w.r.t. every input that requires
            grad, via torch.autograd.grad.
  inplace   float32 only: the in-place variant (x.add_(...)) mutates its input like CPU
            and returns it.
If the CPU raises for a sample, the tpu run must raise the same exception type.

Where the tpu result is not within those tolerances of the CPU's, a float64 run of the same
call referees (floating-point dtypes): the test passes if tpu is within the tolerances of
the float64 result (rounded to the result's dtype), or at most REFEREE_FACTOR times as far
from it as the CPU is (both measured in units of the tolerance). The CPU's last bits depend
on the processor and on the kernel ATen picks for it (blocked sums, vector widths,
intermediates rounded to half types); the float64 run's do not, so the test passes on any
machine where tpu is no less accurate than the CPU, and fails where tpu is wrong. Indices
chosen among tied values (TIES) are checked for the values they pick instead.

"Native" OpInfos (their ATen name, or "_" + it, has a lowering rule in
torch_pjrt.lowered_ops()) must also run without the CPU fallback. Other OpInfos may fall
back, they only have to be right.

Known failures live in tests/expected_failures.txt (strict xfail: a listed test that
passes fails, so the file only shrinks). Default selection: float32 forward, backward and
inplace; the int64/int32/bool/bfloat16/float16/complex64 tests carry the `slow` marker
(deselect with `-m "not slow"`).

bfloat16/float16 compare like PyTorch's TestCommon.test_compare_cpu: the CPU run in the
same dtype is the reference (its kernels often compute in float32 and round once; a
lowering must then do the same), with the OpInfo's tolerances for that dtype, each at
least assert_close's default for the dtype.
"""

import math
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
from conftest import assert_on_device, fallbacks, opinfo_samples, to_cpu, to_tpu
from torch.testing._comparison import default_tolerances
from torch.testing._internal.common_device_type import precisionOverride, toleranceOverride
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.opinfo.core import DecorateInfo, SampleInput
from torch.utils._pytree import tree_flatten, tree_map

import torch_pjrt

EXPECTED_FILE = Path(__file__).with_name("expected_failures.txt")
DTYPES = {
    "float32": torch.float32,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "complex64": torch.complex64,
}
# Dtypes whose backward is tested too (complex64: gradients of sum(real) + sum(imag)).
BACKWARD_DTYPES = (torch.float32, torch.complex64)
DIRECTIONS = ("forward", "backward", "inplace")

# OpInfos whose samples pass some tensor arguments that must stay on the CPU
# (PyTorch requires them there on every device).
CPU_ARGS = {"tensor_split"}

# OpInfos whose values depend on the random stream (the tpu stream differs from the CPU
# one): only shapes, dtypes and devices are compared.
RANDOM = {
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "normal",
    "normal.in_place", "normal.number_mean", "uniform", "multinomial", "randn", "randn_like",
    "rand_like", "randint", "randint_like", "nn.functional.dropout", "nn.functional.dropout2d",
    "nn.functional.dropout3d", "nn.functional.alpha_dropout",
    "nn.functional.feature_alpha_dropout.with_train", "nn.functional.rrelu",
    "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d",
    "svd_lowrank", "pca_lowrank",
}

# OpInfos with some random samples: dropout applied inside the op (only those samples
# are compared by metadata; the others must match the CPU).
RANDOM_SAMPLES = {
    "nn.functional.scaled_dot_product_attention": lambda s: s.kwargs.get("dropout_p", 0.0) > 0,
    # positional dropout_p (args[9]) counts only when training
    "nn.functional.multi_head_attention_forward":
        lambda s: s.kwargs.get("training", True) and s.args[9] > 0,
}

LOWERED = {n.split("::", 1)[1] for n in torch_pjrt.lowered_ops() if n.startswith("aten::")}


def full_name(op):
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


OPS = {full_name(op): op for op in op_db}


def native_aten_name(op):
    """The lowered ATen op this OpInfo exercises, or None."""
    cands = [op.aten_name]
    if op.name.startswith("nn.functional."):
        cands.append(op.name.rsplit(".", 1)[1])
    for c in cands:
        for n in (c, "_" + c):
            if n in LOWERED:
                return n
    return None


# ---------------------------------------------------------------------------
# expected_failures.txt
# ---------------------------------------------------------------------------

_LINE = re.compile(r"^(\S+)\s+(\S+)\s+(\S+)(\s+skip)?\s*#\s*(.+)$")


def parse_expected(path=EXPECTED_FILE):
    """[(op, dtype, direction, kind, reason, lineno)]; dtype/direction may be '*'."""
    entries = []
    for i, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            raise ValueError(f"{path.name}:{i}: cannot parse {raw!r}")
        op, dt, direction, skip, reason = m.groups()
        entries.append((op, dt, direction, "skip" if skip else "xfail", reason.strip(), i))
    return entries


EXPECTED = parse_expected()


def lookup(name, dtype, direction):
    """The most specific expected_failures entry for a test, or None."""
    best = None
    for op, dt, d, kind, reason, _ in EXPECTED:
        if op == name and dt in (dtype, "*") and d in (direction, "*"):
            score = (dt != "*") + (d != "*")
            if best is None or score > best[0]:
                best = (score, kind, reason)
    return best and best[1:]


# ---------------------------------------------------------------------------
# Parametrization
# ---------------------------------------------------------------------------


# The expected failures were recorded with the default 8 samples per op; a run with fewer
# samples (scripts/test.sh in Debug/DeferAndFuse) may miss the failing sample, so there an
# unexpected pass is not an error.
STRICT = opinfo_samples(os.environ.get("TORCH_PJRT_OPINFO_SAMPLES", "8")) >= 8


def _cases():
    for name, op in OPS.items():
        supported = op.supported_dtypes("cpu")
        for dname, dtype in DTYPES.items():
            if dtype not in supported:
                continue
            directions = ["forward"]
            if (dtype in BACKWARD_DTYPES and op.supports_autograd
                    and dtype in op.supported_backward_dtypes("cpu")):
                directions.append("backward")
            if dtype is torch.float32:
                if op.inplace_variant is not None:
                    directions.append("inplace")
            for direction in directions:
                marks = []
                if dtype is not torch.float32:
                    marks.append(pytest.mark.slow)
                hit = lookup(name, dname, direction)
                if hit:
                    kind, reason = hit
                    if kind == "skip":
                        marks.append(pytest.mark.skip(reason=reason))
                    else:
                        marks.append(pytest.mark.xfail(reason=reason, strict=STRICT))
                yield pytest.param(name, dname, direction, marks=marks,
                                   id=f"{name}-{dname}-{direction}")


CASES = list(_cases())


# ---------------------------------------------------------------------------
# Tolerances
# ---------------------------------------------------------------------------


def tolerances(op, dtype):
    """The loosest (atol, rtol) any of the OpInfo's tolerance decorators gives `dtype`.

    PyTorch grants these for differences between its own backends; XLA is one more
    backend. (None, None) means assert_close's defaults. bfloat16/float16 get at least
    assert_close's defaults for the dtype.
    """
    atol = rtol = None
    decos = []
    for d in op.decorators:
        if isinstance(d, DecorateInfo):
            if d.dtypes is None or dtype in d.dtypes:
                decos.extend(d.decorators)
        else:
            decos.append(d)
    for d in decos:
        if isinstance(d, toleranceOverride) and dtype in d.d:
            t = d.d[dtype]
            atol, rtol = max(atol or 0, t.atol), max(rtol or 0, t.rtol)
        elif isinstance(d, precisionOverride) and dtype in d.d:
            atol = max(atol or 0, d.d[dtype])
    if dtype in (torch.bfloat16, torch.float16):
        # As TestCase.assertEqual does: an override only ever loosens the dtype's default.
        default_rtol, default_atol = default_tolerances(dtype)
        return max(atol or 0, default_atol), max(rtol or 0, default_rtol)
    if atol is None and rtol is None:
        return None, None
    default_rtol, default_atol = {torch.float32: (1.3e-6, 1e-5)}.get(dtype, (0, 0))
    return (default_atol if atol is None else atol), (default_rtol if rtol is None else rtol)


# ---------------------------------------------------------------------------
# Running one sample
# ---------------------------------------------------------------------------


def _tpu_device(x):
    # Factory samples say device="cpu"; their tpu twin must say tpu.
    if isinstance(x, torch.device) and x.type == "cpu":
        return torch.device("tpu")
    if isinstance(x, str) and x == "cpu":
        return "tpu"
    return x


def _takes_device(name):
    """Whether the ATen op behind an OpInfo name has a `device` argument (a factory)."""
    packet = getattr(torch.ops.aten, name.split(".")[0], None)
    if packet is None:
        return False
    return any(a.name == "device" for ov in packet.overloads()
               for a in getattr(packet, ov)._schema.arguments)


def move_sample(name, sample):
    """A copy of the sample with its tensors on tpu (some stay on the CPU, see CPU_ARGS)."""
    args = sample.args if name in CPU_ARGS else to_tpu(sample.args)
    args, kwargs = tree_map(_tpu_device, (args, to_tpu(sample.kwargs)))
    leaves = tree_flatten((sample.input, sample.args, sample.kwargs))[0]
    if ("device" not in kwargs and _takes_device(name)
            and not any(isinstance(x, torch.Tensor) for x in leaves)):
        # A factory sample that names no device (torch.arange(2)) makes a CPU tensor on
        # both sides; its tpu twin asks for tpu.
        kwargs = {**kwargs, "device": "tpu"}
    return SampleInput(tree_map(_tpu_device, to_tpu(sample.input)), args=args, kwargs=kwargs,
                       output_process_fn_grad=sample.output_process_fn_grad,
                       broadcasts_input=sample.broadcasts_input, name=sample.name)


def upcast(sample, dtype):
    """A float64 copy of the sample: tensors of the tested floating dtype become float64
    (keeping requires_grad), everything else is shared."""

    wide = torch.complex128 if dtype.is_complex else torch.float64

    def up(x):
        if isinstance(x, torch.Tensor) and x.dtype == dtype:
            y = x.detach().to(wide)
            return y.requires_grad_() if x.requires_grad else y
        return x

    return SampleInput(tree_map(up, sample.input), args=tree_map(up, sample.args),
                       kwargs=tree_map(up, sample.kwargs),
                       output_process_fn_grad=sample.output_process_fn_grad,
                       broadcasts_input=sample.broadcasts_input, name=sample.name)


def call(fn, sample):
    return sample.output_process_fn_grad(fn(sample.input, *sample.args, **sample.kwargs))


class CpuRaised(Exception):
    """Both devices raised the same exception type: nothing to compare."""


def run_both(fn, name, sample):
    """(cpu_result, tpu_result, reference) of fn on the sample and on its tpu copy (made
    first); reference() runs fn on a float64 copy of the sample (made first too).

    When the CPU raises, the tpu run must raise the same exception type (then CpuRaised).
    """
    t_sample = move_sample(name, sample)
    dtype = next((x.dtype for x in tree_flatten((sample.input, sample.args, sample.kwargs))[0]
                  if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())),
                 None)
    r_sample = (upcast(sample, dtype) if dtype not in (None, torch.float64, torch.complex128)
                else None)
    try:
        expected = fn(sample)
    except Exception as e:  # noqa: BLE001 - the CPU decides what is an error
        expected_exc = e
    else:
        expected_exc = None
    try:
        actual = fn(t_sample)
    except Exception as e:  # noqa: BLE001
        if expected_exc is None:
            raise
        if not isinstance(e, type(expected_exc)):
            raise AssertionError(
                f"CPU raised {type(expected_exc).__name__}, tpu raised {type(e).__name__}: {e}"
            ) from e
        raise CpuRaised(f"{type(expected_exc).__name__}: {expected_exc}") from expected_exc
    if expected_exc is not None:
        raise AssertionError(
            f"CPU raised {type(expected_exc).__name__}: {expected_exc}; tpu did not raise")
    return expected, actual, (lambda: fn(r_sample)) if r_sample is not None else None


def check_metadata(actual, expected):
    a, _ = tree_flatten(actual)
    e, _ = tree_flatten(expected)
    assert len(a) == len(e), "result structure differs"
    for x, y in zip(a, e, strict=True):
        if isinstance(y, torch.Tensor):
            assert (x.shape, x.dtype) == (y.shape, y.dtype), f"{x.shape, x.dtype} != {y.shape, y.dtype}"


def is_random(op, name, sample):
    return (name in RANDOM or op.has_nondeterministic_output
            or RANDOM_SAMPLES.get(name, lambda s: False)(sample))


# OpInfos returning the indices of values chosen among ties, which the CPU picks with
# unstable algorithms (std::sort, nth_element, quickselect; their order depends on the
# kernel ATen runs on the processor): {name: (dim's position in args, keepdim's or None)}.
# Where the indices differ from the CPU's, they must point at the CPU's values.
TIES = {"sort": (0, None), "argsort": (0, None), "topk": (1, None), "kthvalue": (1, 2),
        "mode": (0, 1)}


def _arg(sample, pos, key, default):
    if pos is not None and len(sample.args) > pos:
        return sample.args[pos]
    return sample.kwargs.get(key, default)


def check_ties(name, sample, actual, expected, atol, rtol, failure):
    """Passes a tpu result whose indices differ from the CPU's only among tied values:
    the values agree, the indices pick the same input values (sets of them for topk) and
    are distinct within a slice; stable sorts must agree exactly."""
    x = sample.input
    a, e = tree_flatten(actual)[0], tree_flatten(expected)[0]
    if sample.kwargs.get("stable") or x.dim() == 0:
        raise failure
    dim_pos, keep_pos = TIES[name]
    dim = _arg(sample, dim_pos, "dim", -1) % x.dim()
    keepdim = keep_pos is None or _arg(sample, keep_pos, "keepdim", False)
    idx_a, idx_e = a[-1], e[-1]
    if not keepdim:
        idx_a, idx_e = idx_a.unsqueeze(dim), idx_e.unsqueeze(dim)
    picked_a, picked_e = x.gather(dim, idx_a), x.gather(dim, idx_e)
    values = [(a[0], e[0])] if len(a) == 2 else []
    if name == "topk":  # sorted=False leaves the order of the k values open
        picked_a, picked_e = picked_a.sort(dim).values, picked_e.sort(dim).values
        values = [(v.sort(dim).values, w.sort(dim).values) for v, w in values]
    torch.testing.assert_close(picked_a, picked_e, atol=0, rtol=0, equal_nan=True)
    for v, w in values:
        torch.testing.assert_close(v, w, atol=atol, rtol=rtol, equal_nan=True)
    srt = idx_a.sort(dim).values
    assert not (srt.narrow(dim, 1, srt.shape[dim] - 1) == srt.narrow(dim, 0, srt.shape[dim] - 1)
                ).any(), f"{name}: an index repeats within a slice"


# How much farther from the float64 result than the CPU's a tpu result may be (see the
# module docstring).
REFEREE_FACTOR = 4.0


def scaled_error(x, ref, atol, rtol):
    """max |x - ref| / (atol + rtol |ref|) over the elements, in float64: how many
    tolerances x is from ref. NaN/inf count as exact where ref has the same, else inf."""
    x, ref = x.double(), ref.double()
    same = (x == ref) | (x.isnan() & ref.isnan())
    err = (x - ref).abs() / (atol + rtol * ref.abs())
    err = torch.where(same, 0.0, torch.nan_to_num(err, nan=math.inf, posinf=math.inf))
    return err.max().item() if err.numel() else 0.0


def referee(actual, expected, reference, atol, rtol, failure):
    """Passes a tpu result that failed the CPU comparison if it is within the tolerances of
    the float64 result, or at most REFEREE_FACTOR times as far from it as the CPU's
    (finite) result is; else raises `failure` with both distances."""
    try:
        ref = reference()
    except Exception:  # noqa: BLE001 - no float64 path: the CPU comparison stands
        raise failure from None
    leaves = [tree_flatten(t)[0] for t in (actual, expected, ref)]
    if len({len(v) for v in leaves}) != 1:
        raise failure
    for x, y, r in zip(*leaves, strict=True):
        if not isinstance(y, torch.Tensor):
            continue
        if y.is_complex() and isinstance(r, torch.Tensor) and r.is_complex():
            # Complex results are judged part by part.
            x, y, r = (torch.view_as_real(t.resolve_conj()) for t in (x, y, r))
        if not (y.is_floating_point() and isinstance(r, torch.Tensor) and r.is_floating_point()
                and x.shape == y.shape == r.shape):
            torch.testing.assert_close(x, y, atol=atol, rtol=rtol, equal_nan=True)
            continue
        # The float64 result rounded to the result's dtype is the best that dtype can hold
        # (float16's inf where the true value is past 65504).
        r = r.to(y.dtype)
        a, rt = (atol, rtol) if atol is not None else default_tolerances(y.dtype)[::-1]
        e_tpu, e_cpu = scaled_error(x, r, a, rt), scaled_error(y, r, a, rt)
        if e_tpu > 1 and not (math.isfinite(e_cpu) and e_tpu <= REFEREE_FACTOR * e_cpu):
            raise AssertionError(
                f"{failure}\nfloat64 referee: tpu is {e_tpu:.3g} tolerances from the float64 "
                f"result, the CPU {e_cpu:.3g}") from failure


def check(op, name, sample, actual, expected, atol, rtol, reference=None):
    assert_on_device(actual, expected)
    if is_random(op, name, sample):
        check_metadata(actual, expected)
        return
    actual = to_cpu(actual)
    try:
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=True)
    except AssertionError as e:
        if name in TIES:
            check_ties(name, sample, actual, expected, atol, rtol, e)
            return
        if reference is None:
            raise
        referee(actual, expected, reference, atol, rtol, e)


def forward(op, name, sample, atol, rtol):
    expected, actual, reference = run_both(lambda s: call(op, s), name, sample)
    check(op, name, sample, actual, expected, atol, rtol, reference)


def grad_leaves(sample):
    leaves, _ = tree_flatten((sample.input, sample.args, sample.kwargs))
    return [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]


def backward(op, name, sample, atol, rtol):
    def grads(s):
        inputs = grad_leaves(s)
        outs = [o for o in tree_flatten(call(op, s))[0]
                if isinstance(o, torch.Tensor) and o.requires_grad]
        if not inputs or not outs:
            raise CpuRaised("no differentiable input or output")
        loss = sum(o.real.sum() + o.imag.sum() if o.is_complex() else o.sum() for o in outs)
        return torch.autograd.grad(loss, inputs, allow_unused=True)

    expected, actual, reference = run_both(grads, name, sample)
    assert [g is None for g in actual] == [g is None for g in expected], "unused inputs differ"
    keep = [i for i, g in enumerate(expected) if g is not None]
    ref = reference and (lambda: [reference()[i] for i in keep])
    check(op, name, sample, [actual[i] for i in keep], [expected[i] for i in keep], atol, rtol,
          ref)


def inplace(op, name, sample, atol, rtol):
    def run(s):
        out = op.inplace_variant(s.input, *s.args, **s.kwargs)
        return out is s.input, s.input

    (e_same, e_self), (a_same, a_self), reference = run_both(run, name, sample)
    assert a_same == e_same, "the in-place variant did not return its input"
    check(op, name, sample, a_self, e_self, atol, rtol, reference and (lambda: reference()[1]))


RUNNERS = {"forward": forward, "backward": backward, "inplace": inplace}


@pytest.mark.parametrize("name,dname,direction", CASES)
def test_opinfo(name, dname, direction, request):
    op = OPS[name]
    dtype = DTYPES[dname]
    n_samples = request.config.getoption("--opinfo-samples")
    atol, rtol = tolerances(op, dtype)
    torch.manual_seed(0)
    samples = op.sample_inputs("cpu", dtype, requires_grad=direction == "backward")
    run = RUNNERS[direction]
    native = native_aten_name(op)
    torch_pjrt.reset_metrics()
    compared, first_raise = 0, None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, sample in enumerate(samples):
            if i >= n_samples:
                break
            try:
                run(op, name, sample, atol, rtol)
                compared += 1
            except CpuRaised as e:
                first_raise = first_raise or f"sample {i}: {e}"
            except Exception as e:
                msg = " ".join(str(e).split())[:200]
                raise AssertionError(
                    f"sample {i}: {type(e).__name__}: {msg}\n  sample: {sample.summary()}"
                ) from e
    # Samples are valid CPU calls; if none ran, the harness (not the op) is broken. In-place
    # variants are often invalid (self cannot broadcast); there only the error must match.
    if first_raise and not compared and direction != "inplace":
        pytest.fail(f"no sample ran on the CPU: {first_raise[:200]}")
    fb = fallbacks()
    request.node.user_properties.append(("fallbacks", sorted(fb)))
    if native and fb:
        pytest.fail(f"falls back: {', '.join(sorted(fb))} (rule aten::{native})")


# ---------------------------------------------------------------------------
# Inputs OpInfo's random samples rarely hit
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_floor_division_matches_python_semantics(dtype):
    """``a // b`` is not ``floor(a / b)``: 1.0 // 0.1 is 9.0 (the quotient rounds up to 10).
    div(rounding_mode="floor"), floor_divide and ``//`` must all give the CPU's results,
    including signs of zero and divisions by zero. bfloat16 within one bfloat16 step: the
    CPU rounds some intermediates to bfloat16 depending on the loop it takes, we use f32."""
    x = torch.cat([torch.linspace(-3, 3, 61), torch.tensor([0.0, -0.0, 1.0, 1e30])])
    y = torch.tensor([0.1, -0.1, 0.3, 0.7, -0.7, 1e-3, 3.0, 0.0, -0.0])
    a, b = x[:, None].to(dtype), y[None, :].to(dtype)
    at, bt = a.to("tpu"), b.to("tpu")
    for f in (lambda p, q: torch.div(p, q, rounding_mode="floor"), torch.floor_divide,
              lambda p, q: p // q):
        expected, got = f(a, b), f(at, bt).cpu()
        rtol = 2**-7 if dtype == torch.bfloat16 else 0  # one bfloat16 step
        torch.testing.assert_close(got, expected, rtol=rtol, atol=0, equal_nan=True)
        num = ~expected.isnan()  # a NaN's sign bit carries no meaning
        assert torch.equal(torch.signbit(got)[num], torch.signbit(expected)[num])


# ---------------------------------------------------------------------------
# The comparison itself: it passes what is right and fails what is wrong
# ---------------------------------------------------------------------------


def test_float64_referee_passes_last_bits_and_fails_wrong_results():
    """A tpu result off the CPU's by more than the tolerance passes when it is as close to
    float64 as the CPU's, and fails when it is wrong (or NaN where float64 is not)."""
    op = OPS["sum"]
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 1e4
    sample = SampleInput(x)
    cpu = torch.tensor(x.double().sum().item() * (1 + 3e-6), dtype=torch.float32)
    reference = lambda: x.double().sum()  # noqa: E731
    best = reference().float()  # correctly rounded: passes though 3e-6 off the CPU's
    with pytest.raises(AssertionError):
        torch.testing.assert_close(best, cpu, atol=1e-5, rtol=1.3e-6)
    check(op, "sum", sample, best.to("tpu"), cpu, 1e-5, 1.3e-6, reference)
    for wrong in (cpu * (1 + 1e-4), torch.tensor(float("nan"))):
        with pytest.raises(AssertionError, match="float64 referee"):
            check(op, "sum", sample, wrong.to("tpu"), cpu, 1e-5, 1.3e-6, reference)
    with pytest.raises(AssertionError, match="not close"):  # no float64 run: no referee
        check(op, "sum", sample, best.to("tpu"), cpu, 1e-5, 1.3e-6, None)


def test_tie_check_passes_other_ties_and_fails_wrong_indices():
    """sort's indices may differ from the CPU's among equal values, nowhere else."""
    op = OPS["sort"]
    x = torch.tensor([[3.0, 1.0, 3.0, 1.0, 2.0]])
    sample = SampleInput(x, args=(1,))
    values = torch.tensor([[1.0, 1.0, 2.0, 3.0, 3.0]])
    cpu = (values, torch.tensor([[3, 1, 4, 2, 0]]))
    other_ties = (values, torch.tensor([[1, 3, 4, 0, 2]]))
    check(op, "sort", sample, to_tpu(other_ties), cpu, None, None)
    for bad in ([[1, 3, 4, 0, 1]], [[1, 3, 0, 4, 2]]):  # a repeat; a value out of place
        with pytest.raises(AssertionError):
            check(op, "sort", sample, to_tpu((values, torch.tensor(bad))), cpu, None, None)
    stable = SampleInput(x, args=(), kwargs={"dim": 1, "stable": True})
    with pytest.raises(AssertionError):
        check(op, "sort", stable, to_tpu(other_ties), cpu, None, None)


# ---------------------------------------------------------------------------
# The expected-failures file itself
# ---------------------------------------------------------------------------


def test_expected_failures_file_is_valid():
    """Every line names an existing OpInfo, dtype and direction, and none is repeated."""
    seen = set()
    case_ids = {c.id for c in CASES}
    problems = []
    for op, dt, d, _kind, _reason, lineno in EXPECTED:
        key = (op, dt, d)
        if key in seen:
            problems.append(f"line {lineno}: duplicate {key}")
        seen.add(key)
        if op not in OPS:
            problems.append(f"line {lineno}: no OpInfo named {op}")
        if dt != "*" and dt not in DTYPES:
            problems.append(f"line {lineno}: unknown dtype {dt}")
        if d != "*" and d not in DIRECTIONS:
            problems.append(f"line {lineno}: unknown direction {d}")
        if "*" not in (dt, d) and op in OPS and f"{op}-{dt}-{d}" not in case_ids:
            problems.append(f"line {lineno}: {op} {dt} {d} is not a test (dtype unsupported?)")
    assert not problems, "\n".join(problems)
