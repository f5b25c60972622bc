"""``torch.compile(backend="tpu")``: Dynamo -> AOTAutograd -> one StableHLO program per graph.

AOTAutograd gives ATen-level forward and backward graphs (PyTorch's core decompositions are
applied only to ops without a lowering rule). The first call of a graph runs its ATen ops
through the DeferAndFuse recorder, so the Rust lowering rules build one StableHLO module
(the same rules as eager; no second table); the module is compiled once (through the
compilation cache) and later calls replay it directly on the new inputs. A graph whose
capture is interrupted (an op without a lowering falls back to the CPU, a value is read on
the host) runs eagerly on tpu every call instead, and is counted in ``metrics()``.

Dynamic shapes (``dynamic=True``, ``torch._dynamo.mark_dynamic``): Dynamo traces one symbolic
graph for every length. This backend captures it at its first concrete input layout. With
shape buckets off (the default), each distinct length is captured and compiled once (forward
and backward graphs separately) and later calls with that length replay it: the capture
cannot pad, since the backend sees an arbitrary ATen graph (reductions or normalization over
a padded dim, non-causal attention, mean losses). With shape buckets on
(``torch_pjrt.set_shape_buckets(True)``), a new shape of a graph captured before runs the
graph's ATen ops eagerly (counted as ``bucketed_graph_calls``), so each op's bucketed program
serves it, whose masking XLA's padder makes exact; a shape that comes back four times while
the graph holds fewer than four programs is captured (a last partial batch), and Rust decides
which (``compiled.rs``, ``Graph::miss``). At most
``options={"max_programs": N}`` programs (default 16) are kept per graph; the least recently
used beyond that is freed and, if its length comes back, captured again (its XLA compilation
then usually comes from the disk cache). ``torch._dynamo.reset()`` and garbage collection of
a graph free its programs (executables and constants).
"""

import collections
import functools
import weakref

import torch
from torch._dynamo import register_backend
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.exc import ShortenTraceback

from . import _C

_DTYPE = {
    torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4,
    torch.float16: 5, torch.float32: 6, torch.float64: 7, torch.bool: 11, torch.bfloat16: 15,
}
_FROM = {v: k for k, v in _DTYPE.items()}

KNOWN_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
KNOWN_OPTIONS = {
    "dump_stablehlo": "print each compiled graph's StableHLO",
    "decompositions": "'core' applies PyTorch's core ATen decompositions to ops without a "
                      "lowering rule (default 'none': measured 2x slower programs on XLA:CPU)",
    "max_programs": "compiled programs kept per graph, one per distinct input shape/layout; "
                    "the least recently used beyond it is freed (default 16; None: no limit)",
}
DEFAULT_MAX_PROGRAMS = 16

counters = collections.Counter()


class OptionError(ValueError, ShortenTraceback):
    """A bad ``mode``/``options`` for the tpu backend.

    Dynamo wraps a backend's exceptions in BackendCompilerFailed except ShortenTraceback
    ones; deriving from it lets the user see a ValueError.
    """

    def __init__(self, msg):
        Exception.__init__(self, msg)
        self.first_useful_frame = None  # what ShortenTraceback reads: nothing to shorten


def _meta(t):
    s = t.untyped_storage()
    return (s.data_ptr(), _DTYPE[t.dtype], list(t.shape), list(t.stride()), t.storage_offset(),
            s.nbytes())


def _is_tpu(t):
    return isinstance(t, torch.Tensor) and t.device.type == "tpu"


# Every graph whose programs are alive, for torch._dynamo.reset().
_LIVE = weakref.WeakSet()

# What torch_pjrt::replay returns instead of a program id when nothing ran.
_MISSED, _EAGER, _UNKEYABLE, _BUCKETED = -1, -2, -3, -4
# The graph's ops then run eagerly; what each such call counts.
_EAGER_COUNTERS = {_EAGER: "eager_graph_calls", _BUCKETED: "bucketed_graph_calls",
                   _UNKEYABLE: "eager_graphs"}


def _reset():
    """Frees every graph's programs. Dynamo calls it from ``torch._dynamo.reset()``; a graph
    still referenced (a pending backward) captures again if it is called."""
    for g in list(_LIVE):
        g.release()


def _hook_reset():
    """Makes the next ``torch._dynamo.reset()`` call ``_reset``: Dynamo resets only the
    backends torch.compile was given since the last reset, and a graph can outlive one."""
    try:
        from torch._dynamo import eval_frame

        eval_frame.cached_backends.setdefault(id(tpu_backend), tpu_backend)
    except (ImportError, AttributeError):  # Dynamo internals may move
        pass


def _drop_graph(gid):
    counters["released_programs"] += len(_C.graph_release(gid, True))


def _views_as_reshapes(gm):
    """AOTAutograd placed ``view`` where the meta kernels' strides allow one; some tpu
    kernels lay results out otherwise (contiguous where TensorIterator keeps an input's
    permutation), so such a view would raise here. In a functionalized graph a reshape
    computes the same values (a view whenever the strides allow); views that an op writes
    through (an optimizer step's kept input mutations) stay views."""

    def written(n):
        return any(getattr(getattr(u.target, "_schema", None), "is_mutable", False)
                   for u in n.users)

    changed = False
    for n in gm.graph.nodes:
        if (n.op == "call_function" and n.target is torch.ops.aten.view.default
                and not written(n)):
            n.target = torch.ops.aten.reshape.default
            changed = True
    if changed:
        gm.recompile()
    return gm


class _Graph:
    """One AOTAutograd graph (forward or backward).

    Every call is one native op, ``torch_pjrt::replay``: the shim keys the call by its
    inputs (shapes, layouts, Python values) and Rust runs the program the graph has for that
    key (``compiled.rs`` keeps them, least recently used first). Python only captures a key
    seen for the first time and binds the key to the new program (or to eager execution
    when the capture broke), and counts what Rust reports."""

    def __init__(self, gm, dump, max_programs=DEFAULT_MAX_PROGRAMS, inference=False):
        # AOTAutograd passes the arguments as one list. An instance attribute, so that
        # functools.wraps (Dynamo's disable() around the backward) copies it.
        self._boxed_call = True
        self.gm = _views_as_reshapes(gm)
        self.dump = dump
        # No autograd (AOTAutograd's inference graph): one that writes its inputs is an
        # optimizer step, and ends a training step for DeferAndFuse.
        self.inference = inference
        self.gid = _C.graph_new(max_programs)
        self.specs = {}  # program id -> how to rebuild the graph's result from its outputs
        # Each argument's type at the first call, and the positions of the non-tensors.
        self.kinds = None
        self.values = None
        _LIVE.add(self)
        # Not at exit: the runtime may be gone.
        weakref.finalize(self, _drop_graph, self.gid).atexit = False

    def release(self):
        freed = _C.graph_release(self.gid, False)
        counters["released_programs"] += len(freed)
        for pid in freed:
            self.specs.pop(pid, None)

    def _split(self, args):
        """(tensors, Python values) of a call, or (None, None) if it cannot be keyed.

        AOTAutograd fixes which arguments are tensors; the others are ints, floats or bools
        (sizes under dynamic=True), keyed by value, or None (an unused input). Any other
        object, or a type that changed since the first call, cannot be keyed: the graph then
        runs eagerly."""
        if self.kinds is None:
            self.kinds = tuple(torch.Tensor if isinstance(a, torch.Tensor) else type(a)
                               for a in args)
            self.values = [i for i, k in enumerate(self.kinds) if k is not torch.Tensor]
        if not self.values:
            return args, []
        if len(args) != len(self.kinds) or any(
                not isinstance(a, k) if k is torch.Tensor else type(a) is not k
                for a, k in zip(args, self.kinds, strict=False)):
            return None, None
        vals = [args[i] for i in self.values if args[i] is not None]
        if not all(type(v) in (int, float, bool) for v in vals):
            return None, None
        return [a for a in args if isinstance(a, torch.Tensor)], vals

    def __call__(self, args):
        tensors, values = self._split(args)
        pid, outs = _UNKEYABLE, None
        if tensors is not None:
            pid, outs = torch.ops.torch_pjrt.replay.default(self.gid, tensors, values)
        if pid >= 0:
            return _rebuild(self.specs[pid], outs, tensors)
        if pid in _EAGER_COUNTERS:
            counters[_EAGER_COUNTERS[pid]] += 1
            return self.gm(*args)
        assert pid == _MISSED, pid
        return self._capture(args)

    def _bind(self, pid, spec=None):
        """Binds the key of the call just missed to ``pid`` (None: eager)."""
        if pid is not None:
            self.specs[pid] = spec
        reason, evicted, freed = _C.graph_bind(self.gid, pid)
        if reason is not None:
            counters["recompilations"] += 1
            counters[f"recompilations_{reason}"] += 1
        counters["evicted_programs"] += evicted
        counters["released_programs"] += len(freed)
        for p in freed:
            self.specs.pop(p, None)

    def _capture(self, args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        device = tensors[0].device.index if tensors else torch.tpu.current_device()
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
            _C.capture_begin(device)
            try:
                res = self.gm(*args)
            except BaseException:
                _C.capture_abort(device)
                raise
            flat, spec = _flatten(res)
            kept = all(t.dtype in _DTYPE for t in tensors) and all(
                _is_tpu(t) and t.device.index == device and t.dtype in _DTYPE for t in flat)
            if kept:
                r = _C.capture_end(device, [_meta(t) for t in tensors], [_meta(t) for t in flat],
                                   self.inference)
            else:
                _C.capture_abort(device)
                r = None
        if r is None:
            # An op fell back to the CPU or a value was read mid-graph: keep it eager.
            counters["graph_breaks"] += 1
            self._bind(None)
            return res
        pid, out_meta, views = r
        counters["compiled_graphs"] += 1
        _hook_reset()
        if self.dump:
            print(_C.captured_mlir(pid))
        device = torch.device("tpu", device)
        outs = [torch.empty(s, dtype=_FROM[d], device=device) for d, s in out_meta]
        _C.take_outputs(pid, [o.untyped_storage().data_ptr() for o in outs])
        # Outputs that are views of an input are returned as those views (see capture_end).
        spec = (*spec, views)
        self._bind(pid, spec)
        return _rebuild(spec, outs, tensors)


def _flatten(res):
    """Tensors of a graph's (tuple/list) result and how to put them back."""
    if isinstance(res, (tuple, list)):
        flat, spec = [], []
        for r in res:
            if isinstance(r, torch.Tensor):
                spec.append(("t", len(flat)))
                flat.append(r)
            else:
                spec.append(("v", r))
        return flat, (type(res), spec)
    if isinstance(res, torch.Tensor):
        return [res], (None, [("t", 0)])
    return [], (None, [("v", res)])


def _rebuild(spec, outs, inputs):
    kind, items, views = spec
    if views:
        outs = list(outs)
        for k, i, size, stride, offset in views:
            outs[k] = inputs[i].as_strided(size, stride, offset)
    vals = [outs[x] if k == "t" else x for k, x in items]
    if kind is None:
        return vals[0]
    return kind(vals)


# Functional variants without a lowering whose decomposition is not among the core ones:
# the functionalized graph calls these, and their composite kernel would call the mutating
# op (running stats marked as written), which the lowering rules do not model.
_EXTRA_DECOMPS = ("_native_batch_norm_legit_functional",)


@functools.lru_cache(maxsize=None)
def _required_decompositions():
    """Always applied (whatever the ``decompositions`` option): without them the graph
    cannot be captured at all."""
    from torch._decomp import decomposition_table

    lowered = set(_C.lowered_ops())
    table = {}
    for name in _EXTRA_DECOMPS:
        op = getattr(torch.ops.aten, name).default
        if f"aten::{name}" not in lowered and op in decomposition_table:
            table[op] = decomposition_table[op]
    return table


@functools.lru_cache(maxsize=None)
def _decompositions():
    from torch._decomp import core_aten_decompositions

    lowered = set(_C.lowered_ops())
    table = dict(_required_decompositions())
    for op, fn in core_aten_decompositions().items():
        name = op.name() if hasattr(op, "name") else str(op)
        base = name.split(".")[0]
        if not base.startswith("aten::"):
            base = "aten::" + base
        if base not in lowered:
            table[op] = fn
    return table


def tpu_backend(gm, example_inputs, mode=None, options=None, **kwargs):
    """The Dynamo backend registered as ``"tpu"``."""
    if mode not in KNOWN_MODES:
        raise OptionError(f"torch.compile(backend='tpu'): unknown mode {mode!r}; known: {KNOWN_MODES}")
    options = dict(options or {})
    unknown = sorted(set(options) - set(KNOWN_OPTIONS))
    if unknown:
        raise OptionError(
            f"torch.compile(backend='tpu'): unknown options {unknown}; known: {KNOWN_OPTIONS}"
        )
    dump = bool(options.get("dump_stablehlo", False))
    decomp = options.get("decompositions", "none")
    if decomp not in ("none", "core"):
        raise OptionError(f"torch.compile(backend='tpu'): decompositions must be 'none' or 'core', got {decomp!r}")

    max_programs = options.get("max_programs", DEFAULT_MAX_PROGRAMS)
    if max_programs is not None and (type(max_programs) is not int or max_programs < 1):
        raise OptionError(
            f"torch.compile(backend='tpu'): max_programs must be a positive int or None, got {max_programs!r}"
        )

    def compiler(g, _inputs, inference=False):
        if any(_is_collective(n) for n in g.graph.nodes):
            return _split_at_collectives(g, dump, max_programs, inference)
        return _Graph(g, dump, max_programs, inference)

    # Inference graphs (an optimizer step) keep their in-place updates of inputs: the
    # program writes them back into the input storages instead of returning copies that
    # AOTAutograd would copy_ in one eager op each.
    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler,
                        inference_compiler=functools.partial(compiler, inference=True),
                        keep_inference_input_mutations=True,
                        decompositions=dict(_decompositions() if decomp == "core"
                                            else _required_decompositions()))(gm, example_inputs)


_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d", "_dtensor")


def _is_collective(node):
    t = node.target
    return node.op == "call_function" and getattr(t, "namespace", None) in _COLLECTIVE_NAMESPACES


def _split_at_collectives(g, dump, max_programs, inference):
    """A graph with collectives (functional collectives, which Dynamo makes of
    ``dist.all_reduce`` and which DTensor and FSDP2 call) runs as compiled pieces with the
    collectives between them: a collective exchanges data with other processes, which no
    program of ours can do on a plugin without cross-process collectives, and capturing it
    would read values mid-graph (the whole graph would then run eagerly). Each piece is one
    ``_Graph``; the collectives run as ops (counted in ``counters["collectives"]``)."""
    from torch.fx.passes.split_module import split_module

    part, parts = 0, {}
    for n in g.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        if _is_collective(n):
            parts[n] = part + 1
            part += 2
        else:
            parts[n] = part
    split = split_module(g, None, lambda n: parts[n], keep_original_order=True)
    for name, sub in list(split.named_children()):
        if any(_is_collective(n) for n in sub.graph.nodes):
            setattr(split, name, _Piece(collective=sub))
        else:
            graph = _Graph(sub, dump, max_programs, inference)
            setattr(split, name, _Piece(graph=graph))
    counters["graphs_split_at_collectives"] += 1

    def run(args):
        return split(*args)

    run._boxed_call = True
    return run


class _Piece(torch.nn.Module):
    """A piece of a split graph: a compiled ``_Graph`` or the collective between two."""

    def __init__(self, graph=None, collective=None):
        super().__init__()
        self.graph = graph
        self.collective = collective

    def forward(self, *args):
        if self.graph is not None:
            return self.graph(list(args))
        counters["collectives"] += 1
        return self.collective(*args)


def _optimizer_state_on_tpu():
    """A compiled optimizer step over tpu parameters keeps its ``step`` counters on the tpu
    device, as Dynamo does for CUDA parameters (it sets ``capturable`` while initializing the
    state): with CPU counters the update graph has CPU inputs and could not be captured (it
    ran op by op, one eager graph per piece)."""
    try:
        from torch._dynamo.variables.optimizer import OptimizerVariable
    except ImportError:  # Dynamo internals may move; the step then stays eager-compatible
        return
    orig = OptimizerVariable._safe_to_set_capturable
    if getattr(orig, "_tpu", False):
        return

    def safe_to_set_capturable(self, group):
        params = group.get("params", [])
        if params and all(_is_tpu(p) for p in params):
            return "capturable" in group and all(p not in self.value.state for p in params)
        return orig(self, group)

    safe_to_set_capturable._tpu = True
    OptimizerVariable._safe_to_set_capturable = safe_to_set_capturable


NEEDS_TPU_BACKEND = (
    "torch.compile's default backend, Inductor, cannot generate code for the tpu device "
    "(PyTorch maps the device type 'tpu' to its Pallas code generator, which needs jax and a "
    "TPU); compile with torch.compile(model, backend=\"tpu\") instead"
)


class _InductorNeedsTpuBackend:
    """Inductor's code generator for the tpu device: says to pass backend="tpu"."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(NEEDS_TPU_BACKEND)


def _claim_inductor_device():
    # Registered before Inductor's own registration runs, which skips a device that has one.
    from torch._inductor.codegen.common import register_backend_for_device
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen

    register_backend_for_device("tpu", _InductorNeedsTpuBackend, PythonWrapperCodegen)


_optimizer_state_on_tpu()
_claim_inductor_device()
tpu_backend.reset = _reset  # called by torch._dynamo.reset()
register_backend(name="tpu", compiler_fn=tpu_backend)


def export_stablehlo(fn, *example_inputs):
    """The StableHLO text of ``fn(*example_inputs)`` as one program.

    The inputs (tpu tensors) and, for a module, its parameters and buffers are the program's
    parameters, in the order the program reads them; the outputs are ``fn``'s tensor results,
    contiguous. For a training step (forward, backward and optimizer update inside ``fn``) the
    whole step is one program. Returns the text; ``torch_pjrt.compile.export_signature`` of the
    last export gives the parameter and result tensors.
    """
    global _last_export
    tensors = [a for a in example_inputs if isinstance(a, torch.Tensor)]
    if isinstance(fn, torch.nn.Module):
        tensors = tensors + [p for p in fn.parameters()] + [b for b in fn.buffers()]
    if not all(_is_tpu(t) for t in tensors):
        raise ValueError("export_stablehlo: inputs and module state must be on the tpu device")
    device = tensors[0].device.index if tensors else torch.tpu.current_device()
    with torch.no_grad() if not torch.is_grad_enabled() else _nullctx():
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
            _C.capture_begin(device)
            try:
                res = fn(*example_inputs)
            except BaseException:
                _C.capture_abort(device)
                raise
            flat, _ = _flatten(res)
            r = _C.capture_end(device, [_meta(t) for t in tensors], [_meta(t.detach()) for t in flat])
    if r is None:
        raise RuntimeError(
            "export_stablehlo: the function could not be captured as one program "
            "(an op fell back to the CPU or a value was read on the host); see torch_pjrt.metrics()"
        )
    pid, out_meta, _ = r
    outs = [torch.empty(s, dtype=_FROM[d], device=f"tpu:{device}") for d, s in out_meta]
    _C.take_outputs(pid, [o.untyped_storage().data_ptr() for o in outs])
    if _last_export is not None:
        _C.release(_last_export[0])  # only the last export's program is kept
    _last_export = (pid, tensors, outs)
    return _C.captured_mlir(pid)


_last_export = None

_MLIR_DTYPE = {
    "f32": torch.float32, "f64": torch.float64, "f16": torch.float16, "bf16": torch.bfloat16,
    "i1": torch.bool, "i8": torch.int8, "i16": torch.int16, "i32": torch.int32, "i64": torch.int64,
    "ui8": torch.uint8,
}


def _result_types(mlir):
    """(dtype, shape) of each result of the module's main function."""
    import re

    m = re.search(r"func\.func public @main\(.*?\)\s*->\s*(\(.*?\)|tensor<[^>]*>)\s*\{", mlir, re.S)
    if m is None:
        return []
    types = []
    for t in re.findall(r"tensor<([^>]*)>", m.group(1)):
        *dims, elem = t.split("x")
        types.append((_MLIR_DTYPE.get(elem), [int(d) for d in dims]))
    return types


def export_signature():
    """The last ``export_stablehlo``'s program signature: ``(params, results)``.

    ``params``: for each program parameter, in order, the tensor it reads (an input, or a
    module's parameter or buffer), or None for a value fixed at export (a tensor the function
    closed over, a host constant, random state). ``results``, one per program result:
    first ``fn``'s tensor results, as tensors holding the export run's values; then
    (dtype, [numel]) for each other value the program returns (tensors the function left
    alive: for a training step, new gradients and optimizer state, and one int64 scalar per
    index range check: the smallest int64 when every index was in range, else an offending
    index).
    """
    if _last_export is None:
        raise RuntimeError("export_signature: nothing was exported yet")
    pid, tensors, outs = _last_export
    params = [tensors[i] if i >= 0 else None for i in _C.captured_inputs(pid)]
    results = list(outs) + _result_types(_C.captured_mlir(pid))[len(outs):]
    return params, results


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
