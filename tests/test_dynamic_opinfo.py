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
    """Size d moved by k inside its bucket (sizes 0 and 1 stay: 1 broadcasts)."""
    if d < 2:
        return d
    return d + k if d + k <= _bucket(d) else d - k


def _resized(sample, k):
    """The sample with every size d >= 2 of every tensor moved by k inside its bucket: a
    size maps to the same size everywhere, so dims that must match still do. Floating
    tensors get new values; the others repeat their old ones (indices stay in range where
    sizes grow; where one shrinks the CPU decides: both sides must raise alike)."""
    gen = torch.Generator().manual_seed(k)

    def re(x):
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return x
        shape = [_moved(d, k) for d in x.shape]
        if x.is_floating_point():
            y = torch.randn(shape, generator=gen, dtype=x.dtype)
        elif x.numel() == 0:
            y = torch.zeros(shape, dtype=x.dtype)
        else:
            flat = x.detach().flatten()
            y = flat[torch.arange(math.prod(shape)) % flat.numel()].reshape(shape)
        return y.requires_grad_(x.requires_grad)

    return SampleInput(tree_map(re, sample.input), args=tree_map(re, sample.args),
                       kwargs=tree_map(re, sample.kwargs),
                       output_process_fn_grad=sample.output_process_fn_grad,
                       broadcasts_input=sample.broadcasts_input, name=sample.name)


def _sizes(sample):
    return [tuple(x.shape) for x in tree_flatten((sample.input, sample.args, sample.kwargs))[0]
            if isinstance(x, torch.Tensor)]


def _bucketed_opinfos():
    names = []
    for name, op in oi.OPS.items():
        aten = oi.native_aten_name(op)
        if (aten and torch_pjrt._C.serves_sizes("aten::" + aten)
                and torch.float32 in op.supported_dtypes("cpu")
                and oi.lookup(name, "float32", "forward") is None):
            names.append(name)
    return sorted(names)


@per_op
@pytest.mark.parametrize("name", _bucketed_opinfos())
def test_opinfo_samples_at_other_sizes_of_their_bucket(name):
    """Each OpInfo sample of an op that serves sizes, run at its size and at two other sizes
    of the same buckets: every run gives the CPU's result (values and shapes, the OpInfo's
    tolerances), and the third compiles nothing: the second built the bucket's program."""
    op = oi.OPS[name]
    atol, rtol = oi.tolerances(op, torch.float32)
    torch_pjrt.wait_background()
    torch_pjrt.clear_cache(disk=False)  # earlier tests' programs at these shapes
    n = opinfo_samples(os.environ.get("TORCH_PJRT_OPINFO_SAMPLES", "8"))
    served = 0
    samples = (s for s in op.sample_inputs("cpu", torch.float32)
               # Nothing to resize in scalars and sizes 1; empty tensors run exact programs.
               if _sizes(_resized(s, 1)) != _sizes(s) and not any(0 in x for x in _sizes(s)))
    for sample in itertools.islice(samples, n):
        second, third = _resized(sample, 1), _resized(sample, 2)
        try:
            oi.forward(op, name, sample, atol, rtol)
            oi.forward(op, name, second, atol, rtol)
            reset()
            oi.forward(op, name, third, atol, rtol)
        except oi.CpuRaised:
            continue
        progs = torch_pjrt.metrics()["programs"]
        # (built, bucketed built, bucketed calls) per op: no bucket's program is built, and
        # a program built at the exact shape is one a bucket served often enough that its
        # exact version compiles in the background (earlier tests call these shapes too).
        built = {o: c for o, c in progs.items()
                 if torch_pjrt._C.serves_sizes(o) and (c[1] or c[0] and not c[2])}
        assert not built, (sample.name, _sizes(third), built)
        served += sum(c[2] for c in progs.values())
    assert served > 0, f"no sample of {name} ran a bucketed program"
