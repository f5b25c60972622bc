"""``torch.compile(backend="tpu")``: Dynamo -> AOTAutograd -> one StableHLO program per graph.

AOTAutograd gives ATen-level forward and backward graphs (PyTorch's core decompositions are
applied only to ops without a lowering rule). The first call of a graph runs its ATen ops
through the DeferAndFuse recorder, so the Rust lowering rules build one StableHLO module
(the same rules as eager; no second table); the module is compiled once (through the
compilation cache) and later calls replay it directly on the new inputs. A graph whose
capture is interrupted (an op without a lowering falls back to the CPU, a value is read on
the host) runs eagerly on tpu every call instead, and is counted in ``metrics()``.

Dynamic shapes (``dynamic=True``, ``torch._dynamo.mark_dynamic``): Dynamo traces one symbolic
graph for every length, and this backend keeps one program per graph *and concrete input
layout*: each distinct length is captured and compiled once (forward and backward graphs
separately), later calls with that length replay it. Inputs are not padded to buckets: the
backend sees an arbitrary ATen graph and cannot tell whether padding a dimension changes
its results (reductions or normalization over it, non-causal attention, mean losses,
positional tables indexed by ``arange(T)``), so results stay exactly those of the
unpadded call at the price of one compilation per distinct length. At most
``options={"max_programs": N}`` programs (default 16) are kept per graph; the least recently
used beyond that is freed and, if its length comes back, captured again (its XLA compilation
then usually comes from the disk cache). ``torch._dynamo.reset()`` and garbage collection of
a graph free its programs (executables and constants).
"""

import collections
import functools
import itertools
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


def _release(programs):
    """Frees the compiled programs of one graph (values of ``_Graph.programs``)."""
    for prog in programs.values():
        if prog != "eager" and _C.release(prog[0]):
            counters["released_programs"] += 1
    programs.clear()


# Every graph whose programs are alive, for torch._dynamo.reset().
_LIVE = weakref.WeakSet()
_GRAPH_IDS = itertools.count()


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


class _Graph:
    """One AOTAutograd graph (forward or backward) and its compiled programs by input layout,
    least recently used first."""

    def __init__(self, gm, dump, max_programs=DEFAULT_MAX_PROGRAMS, inference=False):
        # AOTAutograd passes the arguments as one list. An instance attribute, so that
        # functools.wraps (Dynamo's disable() around the backward) copies it.
        self._boxed_call = True
        self.gm = gm
        self.dump = dump
        # No autograd (AOTAutograd's inference graph): one that writes its inputs is an
        # optimizer step, and ends a training step for DeferAndFuse.
        self.inference = inference
        self.max_programs = max_programs
        self.programs = collections.OrderedDict()
        # Keys evicted or released, to name the reason when they come back (bounded).
        self.dropped = collections.OrderedDict()
        self.captures = 0
        # Graphs whose arguments are all tensors replay through one native op that finds
        # the program by the inputs' layout and allocates the outputs (torch_pjrt::replay);
        # Python's own lookup below runs only when that op finds nothing bound.
        self.gid = next(_GRAPH_IDS)
        self.native = None
        self.keys = {}  # program id -> its key in self.programs
        _LIVE.add(self)
        # The finalizer holds the dict, not the graph; not at exit (the runtime may be gone).
        weakref.finalize(self, _release, self.programs).atexit = False

    def release(self, reason="released"):
        for key in self.programs:
            self._forget(key, reason)
        self.keys.clear()
        _release(self.programs)

    def _forget(self, key, reason):
        self.dropped[key] = reason
        self.dropped.move_to_end(key)
        while len(self.dropped) > 4 * (self.max_programs or DEFAULT_MAX_PROGRAMS):
            self.dropped.popitem(last=False)

    def _evict(self):
        while self.max_programs is not None and len(self.programs) > self.max_programs:
            key, prog = self.programs.popitem(last=False)
            self._forget(key, "evicted")
            if prog != "eager":
                self.keys.pop(prog[0], None)
            counters["evicted_programs"] += 1
            _release({key: prog})

    @staticmethod
    def _shapes(key):
        return tuple(k[1] if k[0] != "py" else k[2] for k in key)

    def _note_recompile(self, key):
        """Counts a new program for an already captured graph, by reason."""
        if not self.captures:
            return
        counters["recompilations"] += 1
        if key in self.dropped:
            reason = self.dropped.pop(key)
        elif self._shapes(key) in {self._shapes(k) for k in self.programs}:
            reason = "new_layout"  # same shapes: strides, offset, storage size or aliasing
        else:
            reason = "new_shape"
        counters[f"recompilations_{reason}"] += 1

    @staticmethod
    def _key(args):
        """The program key of a call and its tensors' storage addresses; (None, None) if a
        tensor is not on tpu or has a dtype the runtime lacks (the graph then runs eagerly).

        A program reads each input's whole storage (its size is a parameter type), and
        inputs sharing a storage at capture share one parameter: both are part of the key."""
        first = {}
        key = []
        ptrs = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                dev = a.device
                if dev.type != "tpu" or a.dtype not in _DTYPE:
                    return None, None
                s = a.untyped_storage()
                ptr = s.data_ptr()
                ptrs.append(ptr)
                key.append((a.dtype, a.shape, a.stride(), a.storage_offset(), dev.index,
                            s.nbytes(), first.setdefault(ptr, i)))
            else:
                key.append(("py", type(a), a if isinstance(a, (int, float, bool)) else None))
        return tuple(key), ptrs

    def __call__(self, args):
        if self.native is None:
            self.native = all(isinstance(a, torch.Tensor) for a in args)
        if self.native:
            pid, outs = torch.ops.torch_pjrt.replay.default(self.gid, args)
            if pid >= 0:
                key = self.keys[pid]
                self.programs.move_to_end(key)
                return _rebuild(self.programs[key][2], outs)
        key, inputs = self._key(args)
        if key is None:
            counters["eager_graphs"] += 1
            return self.gm(*args)
        prog = self.programs.get(key)
        if prog is None:
            self._note_recompile(key)
            self.captures += 1
            res = self._capture(key, args)
            self._evict()
            return res
        self.programs.move_to_end(key)
        if prog == "eager":
            counters["eager_graph_calls"] += 1
            return self.gm(*args)
        pid, out_meta, spec, device = prog
        outs = [torch.empty(s, dtype=d, device=device) for d, s in out_meta]
        _C.replay(pid, inputs, [o.untyped_storage().data_ptr() for o in outs])
        self._bind(args, key, pid)
        return _rebuild(spec, outs)

    def _bind(self, args, key, pid):
        if self.native:
            torch.ops.torch_pjrt.bind.default(self.gid, args, pid)
            self.keys[pid] = key

    def _capture(self, key, args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        device = tensors[0].device.index if tensors else torch.tpu.current_device()
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
            _C.capture_begin(device)
            try:
                res = self.gm(*args)
            except BaseException:
                _C.capture_end(device, [], [])
                raise
            flat, spec = _flatten(res)
            if not all(_is_tpu(t) and t.device.index == device and t.dtype in _DTYPE for t in flat):
                _C.capture_end(device, [], [])
                self.programs[key] = "eager"
                counters["graph_breaks"] += 1
                return res
            r = _C.capture_end(device, [_meta(t) for t in tensors], [_meta(t) for t in flat],
                               self.inference)
        if r is None:
            # An op fell back to the CPU or a value was read mid-graph: keep it eager.
            self.programs[key] = "eager"
            counters["graph_breaks"] += 1
            return res
        pid, out_meta = r
        counters["compiled_graphs"] += 1
        _hook_reset()
        if self.dump:
            print(_C.captured_mlir(pid))
        # Kept ready for replays: torch dtypes and sizes, one device object.
        out_meta = [(_FROM[d], torch.Size(s)) for d, s in out_meta]
        device = torch.device("tpu", device)
        outs = [torch.empty(s, dtype=d, device=device) for d, s in out_meta]
        _C.take_outputs(pid, [o.untyped_storage().data_ptr() for o in outs])
        self.programs[key] = (pid, out_meta, spec, device)
        self._bind(args, key, pid)
        return _rebuild(spec, outs)


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


def _rebuild(spec, outs):
    kind, items = spec
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
        return _Graph(g, dump, max_programs, inference)

    # Inference graphs (an optimizer step) keep their in-place updates of inputs: the
    # program writes them back into the input storages instead of returning copies that
    # AOTAutograd would copy_ in one eager op each.
    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler,
                        inference_compiler=functools.partial(compiler, inference=True),
                        keep_inference_input_mutations=True,
                        decompositions=dict(_decompositions() if decomp == "core"
                                            else _required_decompositions()))(gm, example_inputs)


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


_optimizer_state_on_tpu()
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
                _C.capture_end(device, [], [])
                raise
            flat, _ = _flatten(res)
            r = _C.capture_end(device, [_meta(t) for t in tensors], [_meta(t.detach()) for t in flat])
    if r is None:
        raise RuntimeError(
            "export_stablehlo: the function could not be captured as one program "
            "(an op fell back to the CPU or a value was read on the host); see torch_pjrt.metrics()"
        )
    pid, out_meta = r
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
