"""OpInfo samples of the ops that serve sizes (shape buckets), run at their size and at two
other sizes of the same buckets: the CPU's results, and no program built for the third.
Its own file (its own process in scripts/test.sh): the bucket state other tests leave."""

import itertools
import math
import os

import pytest
import test_opinfo as oi
import torch
from conftest import opinfo_samples
from test_dynamic import per_op, reset
from torch.testing._internal.opinfo.core import SampleInput
from torch.utils._pytree import tree_flatten, tree_map

import torch_pjrt

# Every test here runs with shape buckets on (conftest.py).
pytestmark = pytest.mark.usefixtures("shape_buckets")

def _bucket(d):
    return max(16, 1 << (d - 1).bit_length())


def _moved(d, k):
    """Size d taken past the smallest bucket (d + 16 up to 16) and moved by k inside its
    bucket; sizes 0 and 1 stay (1 broadcasts). Above 16 two sizes of one bucket make a dim
    serve sizes; below, sizes of different powers of two stay apart (2 and 4 heads)."""
    if d < 2:
        return d
    base = d if d > 16 else d + 16
    return base + k if base + k <= _bucket(base) else base - k


# Arguments kept at their size: a size the op's backward receives as a number
# (embedding's num_weights) makes each size its own signature, as any size argument does.
FIXED_ARGS = {"nn.functional.embedding": {"input"}}  # the weight
# Trailing dims kept in every tensor: layer norm's normalized_shape is an int argument (a
# new one is a new signature); the dims before it are what changes in a model.
KEPT_TRAILING_DIMS = {"nn.functional.layer_norm": lambda s: len(s.args[0]),
                      "native_layer_norm": lambda s: len(s.args[0]),
                      "nn.functional.rms_norm": lambda s: len(s.args[0])}


def _resized(sample, k, fixed=frozenset(), trailing=0):
    """The sample with every size d >= 2 of every tensor moved by k inside its bucket: a
    size maps to the same size everywhere, so dims that must match still do. Floating
    tensors get new values; the others repeat their old ones (indices stay in range where
    sizes grow; where one shrinks the CPU decides: both sides must raise alike). Arguments
    in `fixed` ("input", positions of args) stay as they are, and so do the last `trailing`
    dims of each tensor."""
    gen = torch.Generator().manual_seed(k)

    def re(x):
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return x
        shape = [d if i >= x.dim() - trailing else _moved(d, k) for i, d in enumerate(x.shape)]
        if x.is_floating_point():
            y = torch.randn(shape, generator=gen, dtype=x.dtype)
        elif x.numel() == 0:
            y = torch.zeros(shape, dtype=x.dtype)
        else:
            flat = x.detach().flatten()
            y = flat[torch.arange(math.prod(shape)) % flat.numel()].reshape(shape)
        return y.requires_grad_(x.requires_grad)

    args = tuple(a if i in fixed else tree_map(re, a) for i, a in enumerate(sample.args))
    inp = sample.input if "input" in fixed else tree_map(re, sample.input)
    return SampleInput(inp, args=args,
                       kwargs=tree_map(re, sample.kwargs),
                       output_process_fn_grad=sample.output_process_fn_grad,
                       broadcasts_input=sample.broadcasts_input, name=sample.name)


# OpInfos whose op reads a tensor flat (embedding's indices: index_select of n * n of
# them), so that its element count's bucket matters too.
FLAT_READS = {"nn.functional.embedding"}


def _buckets(name, op, sample):
    """The buckets of the sizes of the sample's tensors and of the op's CPU results (and of
    their element counts, for the ops in FLAT_READS)."""
    try:
        out = op(sample.input, *sample.args, **sample.kwargs)
    except Exception:
        out = None
    ts = [x for x in tree_flatten((sample.input, sample.args, sample.kwargs, out))[0]
          if isinstance(x, torch.Tensor)]
    flat = name in FLAT_READS
    return [tuple(_bucket(d) if d > 1 else d for d in (*x.shape, *([x.numel()] * flat)))
            for x in ts]


def _sizes(sample):
    return [tuple(x.shape) for x in tree_flatten((sample.input, sample.args, sample.kwargs))[0]
            if isinstance(x, torch.Tensor)]


# Ops that serve sizes whose OpInfo goes by another name (a composite calls them).
FORWARD_OPINFOS = {
    "aten::native_layer_norm": ["nn.functional.layer_norm"],
    "aten::_fused_rms_norm": ["nn.functional.rms_norm"],
    "aten::_scaled_dot_product_fused_attention_overrideable": [
        "nn.functional.scaled_dot_product_attention"],
    "aten::nll_loss_forward": ["nn.functional.nll_loss"],
}


def _bucketed_opinfos():
    names = {n for ns in FORWARD_OPINFOS.values() for n in ns}
    for name, op in oi.OPS.items():
        aten = oi.native_aten_name(op)
        if (aten and torch_pjrt._C.serves_sizes("aten::" + aten)
                and torch.float32 in op.supported_dtypes("cpu")):
            names.add(name)
    return sorted(n for n in names if oi.lookup(n, "float32", "forward") is None)


# Backward ops that serve sizes, and OpInfos whose backward calls them.
BACKWARD_OPINFOS = {
    "aten::gelu_backward": ["nn.functional.gelu"],
    "aten::silu_backward": ["nn.functional.silu"],
    "aten::sigmoid_backward": ["sigmoid"],
    "aten::tanh_backward": ["tanh"],
    "aten::threshold_backward": ["nn.functional.relu"],
    "aten::_softmax_backward_data": ["softmax"],
    "aten::_log_softmax_backward_data": ["log_softmax"],
    "aten::embedding_dense_backward": ["nn.functional.embedding"],
    "aten::native_layer_norm_backward": ["nn.functional.layer_norm"],
    "aten::_fused_rms_norm_backward": ["nn.functional.rms_norm"],
    "aten::_scaled_dot_product_fused_attention_overrideable_backward": [
        "nn.functional.scaled_dot_product_attention"],
    "aten::nll_loss_backward": ["nn.functional.nll_loss"],
}


def test_every_backward_op_that_serves_sizes_has_an_opinfo_here():
    sized = {o for o in torch_pjrt._C.lowered_ops() if torch_pjrt._C.serves_sizes(o)}
    backward = {o for o in sized if "backward" in o}
    assert backward == set(BACKWARD_OPINFOS), backward ^ set(BACKWARD_OPINFOS)


def _backward_opinfos():
    return sorted({n for names in BACKWARD_OPINFOS.values() for n in names
                   if oi.lookup(n, "float32", "backward") is None})


def _at_other_sizes(name, direction):
    """Each OpInfo sample, its sizes taken past 16 (`_moved`), run at four sizes of the
    same buckets: every run gives the CPU's result (values and shapes, the OpInfo's
    tolerances), and the last compiles nothing. The second size makes the dims dynamic
    and builds the buckets' programs; the third builds those of ops reading another
    bucketed op's result on the device (the first bucketed call read it from the host).
    """
    op = oi.OPS[name]
    run = oi.RUNNERS[direction]
    atol, rtol = oi.tolerances(op, torch.float32)
    torch_pjrt.wait_background()
    torch_pjrt.clear_cache(disk=False)  # earlier tests' programs at these shapes
    n = opinfo_samples(os.environ.get("TORCH_PJRT_OPINFO_SAMPLES", "8"))
    fixed = FIXED_ARGS.get(name, frozenset())
    kept = KEPT_TRAILING_DIMS.get(name, lambda s: 0)

    def resized(s, k):
        return _resized(s, k, fixed, kept(s))

    def moves(s):
        """Four consecutive moves; with kept dims, ones where no moved size equals a kept
        one (duck sizing would pad both at that size only: another program)."""
        if not kept(s):
            return [0, 1, 2, 3]
        fixed_sizes = {d for x in _sizes(s) for d in x[len(x) - kept(s):]}

        def ok(k):
            return not any(d in fixed_sizes for x in _sizes(resized(s, k))
                           for d in x[:len(x) - kept(s)])
        return next((list(range(k, k + 4)) for k in range(0, 8)
                     if all(ok(j) for j in range(k, k + 4))), [])

    served = 0
    samples = (s for s in op.sample_inputs("cpu", torch.float32,
                                           requires_grad=direction == "backward")
               # Nothing to resize in scalars and sizes 1; empty tensors run exact programs.
               if _sizes(resized(s, 1)) != _sizes(s)
               and not any(0 in x for x in _sizes(s)) and len(moves(s)) == 4)
    for sample in itertools.islice(samples, n):
        *warm, last = (resized(sample, k) for k in moves(sample))
        # Which dims change: this sample's sizes only (a cached program hides its call).
        torch_pjrt._C.forget_shape_history()
        torch_pjrt.clear_cache(disk=False)
        try:
            for s in warm:
                run(op, name, s, atol, rtol)
            reset()
            run(op, name, last, atol, rtol)
        except oi.CpuRaised:
            continue
        if _buckets(name, op, warm[-1]) != _buckets(name, op, last):
            continue  # a size or element count left its bucket: a new bucket
        progs = torch_pjrt.metrics()["programs"]
        # (built, bucketed built, bucketed calls) per op: no bucket's program is built, and
        # a program built at the exact shape is one a bucket served often enough that its
        # exact version compiles in the background (earlier tests call these shapes too).
        built = {o: c for o, c in progs.items()
                 if torch_pjrt._C.serves_sizes(o) and (c[1] or c[0] and not c[2])}
        assert not built, (sample.name, _sizes(last), built)
        served += sum(c[2] for c in progs.values())
    assert served > 0, f"no sample of {name} ran a bucketed program"


@per_op
@pytest.mark.parametrize("name", _bucketed_opinfos())
def test_opinfo_samples_at_other_sizes_of_their_bucket(name):
    _at_other_sizes(name, "forward")


@per_op
@pytest.mark.parametrize("name", _backward_opinfos())
def test_opinfo_gradients_at_other_sizes_of_their_bucket(name):
    """The same for gradients: the backward ops that serve sizes (BACKWARD_OPINFOS)."""
    _at_other_sizes(name, "backward")
