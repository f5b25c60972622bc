"""``torch.tpu.pallas``: JAX and Pallas kernels called on tpu tensors.

A kernel is a JAX function. Its first call with given input shapes, dtypes and static
arguments traces it with ``jax.export`` for the active plugin's platform; the module goes
to the runtime (``_C.register_kernel``), which imports its functions into our programs and
calls them through one op, ``torch_pjrt::jax_call(Tensor[] args, str kernel)``. So a
kernel runs like any op in every eager mode (a Strict job, a Debug call, a call fused into
DeferAndFuse's graph) and inside ``torch.compile(backend="tpu")`` graphs. Later calls with
the same signature do no JAX work. jax is imported on the first call only, on its CPU
platform (it never claims the accelerator).
"""

import enum
import functools
import hashlib
import json
import os
import sys
import threading
import types

import torch
from torch.utils import _pytree as pytree

from . import _C

__all__ = ["custom_jax_kernel", "jax_op", "KernelError"]

_LIB = torch.library.Library("torch_pjrt", "FRAGMENT")
_LIB.define("jax_call(Tensor[] args, str kernel) -> Tensor[]")
_JAX_CALL = torch.ops.torch_pjrt.jax_call.default
_TPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)

_lock = threading.RLock()


class KernelError(ValueError):
    """A kernel could not be traced or imported (the message names the kernel)."""


class _Traced:
    """One kernel traced for one signature."""

    def __init__(self, kid, name, outs, out_spec, diff):
        self.id = kid
        self.name = name
        self.outs = outs  # [(shape, torch dtype)]
        self.out_spec = out_spec  # torch pytree spec of the outputs
        self.diff = diff  # input positions with gradients (floating/complex)
        self.backward = None  # the backward kernel's _Traced, traced at the first backward
        self.make_backward = None


_BY_ID = {}  # kernel id -> _Traced


# --- jax -----------------------------------------------------------------------------

_jax = None
_said_interpret = False


def _import_jax():
    global _jax
    if _jax is not None:
        return _jax
    if "jax" not in sys.modules:
        # The kernel is traced on the host; jax must not initialise an accelerator.
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        import jax
        import jax.export  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "torch.tpu.pallas needs jax: pip install 'torch-pjrt[jax]' (or pip install jax)"
        ) from e
    _jax = jax
    return jax


_TO_JAX = {
    torch.bool: "bool",
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint32: "uint32",
    torch.uint64: "uint64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
}
_FROM_JAX = {v: k for k, v in _TO_JAX.items()}
_WIDE = {torch.int64, torch.uint64, torch.float64, torch.complex128}


def _platform():
    return {"cuda": "cuda", "rocm": "rocm", "tpu": "tpu"}.get(_C.platform_name(), "cpu")


class _ForceInterpret:
    """On the CPU plugin, lowers ``pallas_call`` in interpret mode (plain StableHLO loops)."""

    def __init__(self, name):
        self.name = name
        self.prev = None
        self.prim = None

    def __enter__(self):
        if _platform() != "cpu":
            return self
        try:
            from jax._src.interpreters import mlir
            from jax._src.pallas import pallas_call as pc
        except ImportError:
            return self
        self.prim = pc.pallas_call_p
        table = mlir._platform_specific_lowerings["cpu"]
        self.prev = table.get(self.prim)

        def lowering(ctx, *args, interpret=False, **params):
            global _said_interpret
            if not _said_interpret:
                _said_interpret = True
                import warnings

                warnings.warn(
                    f"torch.tpu.pallas: kernel '{self.name}' runs its pallas_call in "
                    "interpret mode on the XLA CPU plugin (Mosaic and Triton kernels need "
                    "a TPU or GPU plugin)",
                    stacklevel=2,
                )
            return pc._pallas_call_lowering(ctx, *args, interpret=True, **params)

        mlir.register_lowering(self.prim, lowering, platform="cpu")
        return self

    def __exit__(self, *exc):
        if self.prim is None:
            return
        from jax._src.interpreters import mlir

        table = mlir._platform_specific_lowerings["cpu"]
        if self.prev is None:
            table.pop(self.prim, None)
        else:
            table[self.prim] = self.prev


def _generic_text(exported):
    """The module in MLIR's generic form without locations (what the runtime imports)."""
    from jax._src.interpreters import mlir as jmlir
    from jax._src.lib.mlir import ir

    with jmlir.make_ir_context():
        m = ir.Module.parse(exported.mlir_module())
        return m.operation.get_asm(print_generic_op_form=True, enable_debug_info=False)


def _plugin_stablehlo_version():
    return _C.plugin_attribute("stablehlo_current_version")


def _check_version(name, text):
    """Serializes the module as a StableHLO portable artifact for the plugin's version:
    an op the plugin's StableHLO does not have fails here, named."""
    want = _plugin_stablehlo_version()
    if not want:
        return
    from jax._src.interpreters import mlir as jmlir
    from jax._src.lib.mlir import ir
    from jaxlib.mlir.dialects import stablehlo

    have = stablehlo.get_current_version()
    target = min(want, have, key=lambda v: tuple(int(x) for x in v.split(".")))
    notes = []

    def note(d):
        notes.append(str(d.message))
        return True

    with jmlir.make_ir_context() as ctx:
        handler = ctx.attach_diagnostic_handler(note)
        try:
            stablehlo.serialize_portable_artifact(ir.Module.parse(text), target)
        except Exception:  # jaxlib raises a bare exception; the reason is in the diagnostics
            raise KernelError(
                f"kernel '{name}' cannot be serialized for the plugin's StableHLO {want} "
                f"(jax has {have}): {'; '.join(notes) or 'unknown reason'}"
            ) from None
        finally:
            handler.detach()


# --- the trace cache on disk ------------------------------------------------------------


def _code_digest(fn, h, seen):
    """Feeds what defines `fn` into `h`: its bytecode, constants, defaults, closure values and
    the Python functions it calls by global name, recursively."""
    fn = getattr(fn, "__wrapped__", fn)
    if isinstance(fn, functools.partial):
        h.update(repr((fn.args, sorted(fn.keywords.items()))).encode())
        return _code_digest(fn.func, h, seen)
    code = getattr(fn, "__code__", None)
    if code is None or id(code) in seen:
        h.update(repr(getattr(fn, "__qualname__", type(fn).__name__)).encode())
        return
    seen.add(id(code))

    def feed_code(c):
        h.update(c.co_code)
        h.update(repr(c.co_names).encode())
        for k in c.co_consts:
            if isinstance(k, types.CodeType):
                feed_code(k)
            else:
                h.update(repr(k).encode())

    feed_code(code)
    h.update(repr(getattr(fn, "__defaults__", None)).encode())
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            v = cell.cell_contents
        except ValueError:
            continue
        if callable(v) and hasattr(v, "__code__"):
            _code_digest(v, h, seen)
        else:
            h.update(repr(v).encode())
    g = getattr(fn, "__globals__", {})
    for n in code.co_names:
        v = g.get(n)
        if isinstance(v, types.FunctionType):
            _code_digest(v, h, seen)
        elif isinstance(v, (int, float, str, bool, tuple)):
            h.update(repr((n, v)).encode())


def _trace_dir():
    if os.environ.get("TORCH_TPU_KERNEL_TRACE_CACHE", "1") == "0":
        return None
    d = _C.cache_info().get("directory")
    return os.path.join(d, "kernels") if d else None


def _disk_key(kernel, key):
    from importlib.metadata import version

    h = hashlib.sha256()
    h.update(repr((kernel.name, version("jax"), _platform(), key)).encode())
    _code_digest(kernel.fn, h, set())
    if kernel.backward_fn is not None:
        _code_digest(kernel.backward_fn, h, set())
    return h.hexdigest()


def _disk_load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _disk_store(path, entry):
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(entry, f)
        os.replace(tmp, path)
    except OSError:
        pass


# --- kernels --------------------------------------------------------------------------


def _describe(path):
    """`argument 1`, `argument 'y'`, `argument 0['w'][2]` from a leaf's key path below
    (args, kwargs)."""
    if not path:
        return "argument"
    head, rest = path[0], path[1:]
    name = getattr(head, "idx", None)
    name = repr(head.key) if name is None else str(name)
    return f"argument {name}{pytree.keystr(rest) if rest else ''}"


class _Static:
    """A static argument inside the argument tree (a leaf of no data)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class JaxKernel:
    """A JAX function callable on tpu tensors (see ``custom_jax_kernel``)."""

    def __init__(
        self,
        fn,
        name=None,
        static_argnums=(),
        static_argnames=(),
        donate_argnums=(),
        backward=None,
        jit_kwargs=None,
    ):
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "kernel")
        if isinstance(static_argnums, int):
            static_argnums = (static_argnums,)
        if isinstance(static_argnames, str):
            static_argnames = (static_argnames,)
        self.static_argnums = tuple(static_argnums)
        self.static_argnames = tuple(static_argnames)
        self.donate_argnums = tuple(
            (donate_argnums,) if isinstance(donate_argnums, int) else donate_argnums
        )
        self.backward_fn = backward
        self.jit_kwargs = dict(jit_kwargs or {})
        self._traced = {}
        self._fast = {}  # (shape, dtype, device) of each tensor argument -> _Traced
        self.last_spec = None
        # Calls may bypass the op's dispatch (custom_jax_kernel); a jax_op's calls must
        # reach its own op.
        self.jax_call_direct = True
        functools.update_wrapper(self, fn)

    def known(self, args):
        """The traced kernel of a call whose arguments are all tensors of a signature seen
        before (a dictionary lookup), else None."""
        try:
            sig = tuple([(a.shape, a.dtype, a.device) for a in args])
        except AttributeError:
            return None
        return self._fast.get(sig)

    def flat_call(self, op, args, kwargs):
        """Runs the kernel through `op` (``jax_call`` or a ``jax_op``'s op); a flat tuple of
        outputs."""
        traced = None if kwargs else self.known(args)
        if traced is not None:
            self.last_spec = traced.out_spec
            return tuple(op(list(args), traced.id))
        tensors, key, spec, statics = self._split(args, kwargs)
        traced = self._lookup(key, tensors, spec, statics)
        if (
            not kwargs
            and not self.static_argnums
            and len(tensors) == len(args)
            and all(isinstance(a, torch.Tensor) for a in args)
        ):
            self._fast[tuple([(a.shape, a.dtype, a.device) for a in args])] = traced
        return tuple(op(tensors, traced.id))

    def _split(self, args, kwargs):
        nargs = len(args)
        statics_pos = {i + nargs if i < 0 else i for i in self.static_argnums}
        bad = [i for i in statics_pos if not 0 <= i < nargs]
        if bad:
            raise TypeError(
                f"kernel '{self.name}': static_argnums {bad} is out of range for a call "
                f"with {nargs} positional arguments"
            )
        marked_args = tuple(_Static(a) if i in statics_pos else a for i, a in enumerate(args))
        marked_kwargs = {
            k: _Static(v) if k in self.static_argnames else v for k, v in kwargs.items()
        }
        leaves, spec = pytree.tree_flatten_with_path(
            (marked_args, marked_kwargs), is_leaf=lambda x: isinstance(x, _Static)
        )
        tensors, avals, statics = [], [], []
        device = None
        for path, leaf in leaves:
            if isinstance(leaf, _Static):
                try:
                    hash(leaf.value)
                except TypeError:
                    raise TypeError(
                        f"kernel '{self.name}': static {_describe(path[1:])} must be "
                        f"hashable, got {type(leaf.value).__name__}"
                    ) from None
                statics.append(leaf.value)
                avals.append(("static", _static_key(leaf.value)))
            elif isinstance(leaf, torch.Tensor):
                if leaf.device.type != "tpu":
                    raise ValueError(
                        f"kernel '{self.name}': {_describe(path[1:])} is on "
                        f"{leaf.device}; kernels take tpu tensors (move it with .to('tpu'))"
                    )
                if device is None:
                    device = leaf.device
                elif leaf.device != device:
                    raise ValueError(
                        f"kernel '{self.name}': {_describe(path[1:])} is on {leaf.device}, "
                        f"the others on {device}"
                    )
                if leaf.dtype not in _TO_JAX:
                    raise TypeError(
                        f"kernel '{self.name}': {_describe(path[1:])} has dtype "
                        f"{leaf.dtype}, which JAX kernels cannot take"
                    )
                tensors.append(leaf)
                avals.append((tuple(leaf.shape), _TO_JAX[leaf.dtype], False))
            elif isinstance(leaf, (bool, int, float, complex)):
                t = _scalar_tensor(leaf, device)
                tensors.append(t)
                avals.append(((), _TO_JAX[t.dtype], True))
            elif leaf is None:
                avals.append(("none",))
            else:
                raise TypeError(
                    f"kernel '{self.name}': {_describe(path[1:])} is a "
                    f"{type(leaf).__name__}; pass tensors, numbers, or mark it static "
                    "(static_argnums/static_argnames)"
                )
        key = (str(spec), tuple(avals))
        return tensors, key, spec, statics

    def _lookup(self, key, tensors, spec, statics):
        traced = self._traced.get(key)
        if traced is not None:
            self.last_spec = traced.out_spec
            return traced
        with _lock:
            traced = self._traced.get(key)
            if traced is None:
                traced = self._trace(key, tensors, spec, statics)
                self._traced[key] = traced
        self.last_spec = traced.out_spec
        return traced

    def _flat_fn(self, key, spec, statics):
        """The kernel as a function of its dynamic leaves only."""

        def flat(*dyn):
            args, kwargs = _rebuild(key, spec, statics, dyn)
            return self.fn(*args, **kwargs)

        return flat

    def _trace(self, key, tensors, spec, statics):
        avals = [a for a in key[1] if a[0] not in ("static", "none")]
        diff = [i for i, a in enumerate(avals) if a[1].startswith(("float", "bfloat", "complex"))]
        path = None
        d = _trace_dir()
        if d is not None:
            try:
                path = os.path.join(d, _disk_key(self, key) + ".json")
            except Exception:  # an unhashable closure value: no disk cache for this kernel
                path = None
        entry = _disk_load(path) if path else None
        if entry is None:
            entry = self._export(self._flat_fn(key, spec, statics), avals, self.name)
            if path:
                _disk_store(path, entry)
        traced = _register(self.name, entry, diff)
        traced.make_backward = functools.partial(self._trace_backward, key, spec, statics, avals, diff)
        return traced

    def _export(self, flat, avals, name):
        jax = _import_jax()
        import jax.numpy as jnp

        wide = any(_FROM_JAX[a[1]] in _WIDE for a in avals)
        shapes = [
            jax.ShapeDtypeStruct(a[0], jnp.dtype(a[1]), weak_type=a[2]) for a in avals
        ]
        try:
            with jax.enable_x64(wide), _ForceInterpret(name):
                # Every input stays a parameter: the call passes them all.
                jit_kwargs = dict(self.jit_kwargs, keep_unused=True)
                exported = jax.export.export(jax.jit(flat, **jit_kwargs), platforms=[_platform()])(
                    *shapes
                )
        except (TypeError, ValueError, NotImplementedError) as e:
            hint = ""
            if name.endswith(".backward"):
                hint = (
                    " (kernels JAX cannot differentiate, such as pallas_call, need an "
                    "explicit backward=)"
                )
            raise type(e)(f"kernel '{name}' failed to trace{hint}: {e}") from e
        except Exception as e:
            raise KernelError(f"kernel '{name}' failed to trace: {e}") from e
        for a in exported.out_avals:
            if str(a.dtype) not in _FROM_JAX:
                raise KernelError(
                    f"kernel '{name}' returns dtype {a.dtype}, which tpu tensors cannot hold"
                )
        text = _generic_text(exported)
        # Custom calls the plugin cannot run are refused first (the clearer error).
        _C.register_kernel(name, text)
        _check_version(name, text)
        # The output structure as a torch pytree spec, so a later process needs no jax.
        example = jax.tree_util.tree_unflatten(exported.out_tree, list(range(exported.out_tree.num_leaves)))
        _, out_spec = pytree.tree_flatten(example)
        return {
            "module": text,
            "outs": [[list(a.shape), str(a.dtype)] for a in exported.out_avals],
            "out_spec": pytree.treespec_dumps(out_spec),
        }

    def _trace_backward(self, key, spec, statics, avals, diff):
        """The backward kernel: (inputs..., output cotangents...) -> gradients of `diff`."""
        jax = _import_jax()
        flat = self._flat_fn(key, spec, statics)
        traced = self._traced[key]
        n_in = len(avals)
        outs = traced.outs

        if self.backward_fn is not None:
            user = self.backward_fn

            def bwd(*xs):
                primal, cts = xs[:n_in], xs[n_in:]
                g = pytree.tree_unflatten(list(cts), traced.out_spec)
                args, _ = _rebuild(key, spec, statics, primal)
                return _grads_for(self.name, user(args, g), key, spec, diff, primal)

        else:

            # Integer outputs have no cotangent (JAX's float0): only the others are used.
            inexact = [j for j, (_, d) in enumerate(outs) if d.is_floating_point or d.is_complex]

            def bwd(*xs):
                primal, cts = list(xs[:n_in]), xs[n_in:]

                def of_diff(*dx):
                    p = list(primal)
                    for i, v in zip(diff, dx, strict=True):
                        p[i] = v
                    leaves = pytree.tree_leaves(flat(*p))
                    return [leaves[j] for j in inexact]

                _, vjp = jax.vjp(of_diff, *[primal[i] for i in diff])
                return tuple(vjp([cts[j] for j in inexact]))

        bavals = list(avals) + [(tuple(sh), _TO_JAX[dt], False) for sh, dt in outs]
        entry = self._export(bwd, bavals, self.name + ".backward")
        return _register(self.name + ".backward", entry, [])


def _rebuild(key, spec, statics, dyn):
    """(args, kwargs) of a call from its dynamic leaves `dyn` and its static values."""
    it_d, it_s = iter(dyn), iter(statics)
    leaves = []
    for a in key[1]:
        if a[0] == "static":
            leaves.append(next(it_s))
        elif a[0] == "none":
            leaves.append(None)
        else:
            leaves.append(next(it_d))
    return pytree.tree_unflatten(leaves, spec)


def _grads_for(name, grads, key, spec, diff, primal):
    """An explicit backward's result (one entry per positional argument: None, or gradients
    with the argument's structure) as the gradients of the differentiable leaves, in order
    (zeros where none was given)."""
    import jax.numpy as jnp

    arg_specs = spec.children_specs[0].children_specs
    if not isinstance(grads, (tuple, list)) or len(grads) != len(arg_specs):
        raise KernelError(
            f"kernel '{name}': backward must return one gradient (or None) per positional "
            f"argument, {len(arg_specs)} in all"
        )
    flat, pos = [], 0
    for i, (aspec, g) in enumerate(zip(arg_specs, grads, strict=True)):
        kinds = key[1][pos : pos + aspec.num_leaves]
        pos += aspec.num_leaves
        n = sum(1 for k in kinds if k[0] not in ("static", "none"))
        if g is None:
            flat.extend([None] * n)
            continue
        leaves = pytree.tree_leaves(g)
        if len(leaves) != n:
            raise KernelError(
                f"kernel '{name}': backward returned {len(leaves)} gradients for argument "
                f"{i}, which has {n} arrays"
            )
        flat.extend(leaves)
    out = []
    for i in diff:
        g = flat[i] if i < len(flat) else None
        out.append(jnp.zeros_like(primal[i]) if g is None else g)
    return tuple(out)


def _static_key(v):
    if isinstance(v, enum.Enum):
        return (type(v).__qualname__, v.name)
    return (type(v).__name__, repr(v))


def _scalar_tensor(v, device):
    dtype = (
        torch.bool
        if isinstance(v, bool)
        else torch.int32
        if isinstance(v, int)
        else torch.float32
        if isinstance(v, float)
        else torch.complex64
    )
    return torch.tensor(v, dtype=dtype, device=device or "tpu")


def _register(name, entry, diff):
    # Two kernels may trace to one module; each call id is its own (backwards differ).
    kid = f"{_C.register_kernel(name, entry['module'])}/{len(_BY_ID)}"
    outs = [(tuple(s), _FROM_JAX[d]) for s, d in entry["outs"]]
    spec = pytree.treespec_loads(entry["out_spec"])
    traced = _Traced(kid, name, outs, spec, diff)
    _BY_ID[kid] = traced
    return traced


def _kernel(kid):
    t = _BY_ID.get(kid)
    if t is None:
        raise RuntimeError(f"no custom kernel is registered as '{kid}' in this process")
    return t


@torch.library.register_fake("torch_pjrt::jax_call")
def _jax_call_fake(args, kernel):
    t = _kernel(kernel)
    device = args[0].device if args else torch.device("tpu")
    return [torch.empty(s, dtype=d, device=device) for s, d in t.outs]


def _setup_context(ctx, inputs, output):
    args, kernel = inputs
    ctx.kernel = kernel
    ctx.save_for_backward(*args)


def _backward(ctx, grads):
    t = _kernel(ctx.kernel)
    args = list(ctx.saved_tensors)
    if not t.diff:
        return [None] * len(args), None
    with _lock:
        if t.backward is None:
            t.backward = t.make_backward()
    cts = [
        g if g is not None else torch.zeros(s, dtype=d, device=args[0].device)
        for g, (s, d) in zip(grads, t.outs, strict=True)
    ]
    res = _JAX_CALL(args + cts, t.backward.id)
    out = [None] * len(args)
    for i, g in zip(t.diff, res, strict=True):
        out[i] = g
    return out, None


torch.library.register_autograd("torch_pjrt::jax_call", _backward, setup_context=_setup_context)


def custom_jax_kernel(
    fn=None,
    *,
    name=None,
    static_argnums=(),
    static_argnames=(),
    donate_argnums=(),
    backward=None,
    **jit_kwargs,
):
    """Makes the JAX function ``fn`` callable on tpu tensors.

    Use as ``@custom_jax_kernel``, ``@custom_jax_kernel(static_argnums=1)`` or
    ``custom_jax_kernel(fn, ...)``. Tensor arguments (in any pytree) become the kernel's
    arrays; Python numbers become weakly typed scalars; static arguments (hashable: ints,
    floats, bools, strings, tuples, enums) are part of the kernel's key, as in ``jax.jit``.
    Returns what ``fn`` returns, with arrays as tpu tensors.

    ``backward(args, grad)``: an explicit backward in JAX (``args`` the call's positional
    arguments as arrays and static values, ``grad`` the output's cotangent with the output's
    structure), returning one gradient or None per positional argument. Without it the
    gradient is ``jax.vjp`` of ``fn`` (recomputing the forward).

    ``donate_argnums`` is accepted for ``jax.jit`` compatibility; whether an input's buffer
    is reused is the runtime's decision, as for every op (a kernel never invalidates a
    tensor the caller still holds).
    """

    def wrap(f):
        k = JaxKernel(
            f,
            name=name,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            donate_argnums=donate_argnums,
            backward=backward,
            jit_kwargs=jit_kwargs,
        )

        def run(*args, **kwargs):
            return k.flat_call(_JAX_CALL, args, kwargs)

        return _compilable(k, run)

    return wrap if fn is None else wrap(fn)


def _compilable(k, run):
    """The kernel as Dynamo sees it: `run` (tensors and static values in, a flat tuple of
    tensors out) stays whole in Dynamo's graph and is traced by AOTAutograd, where it
    becomes one custom-op node; the caller rebuilds the output's structure from the spec
    the last call left (Dynamo reads it once `run`'s example value exists)."""
    flat_run = torch.compiler.allow_in_graph(run)

    direct = k.jax_call_direct

    @functools.wraps(k.fn)
    def call(*args, **kwargs):
        traced = None
        if direct and not kwargs and not torch.compiler.is_compiling():
            traced = k.known(args)
        if (
            traced is not None
            and all(type(a) is torch.Tensor for a in args)
            and not (torch.is_grad_enabled() and any(a.requires_grad for a in args))
            and torch._C._len_torch_dispatch_stack() == 0
        ):
            # Eager, nothing for autograd to record, no mode to see the call: straight to
            # the tpu kernel (skips Dynamo's wrapper and the Python autograd formula's ~5 us).
            outs = _JAX_CALL.redispatch(_TPU_KEYS, list(args), traced.id)
            spec = traced.out_spec
            return outs[0] if spec.is_leaf() else pytree.tree_unflatten(list(outs), spec)
        outs = flat_run(*args, **kwargs)
        spec = k.last_spec
        if spec.is_leaf():
            return outs[0]
        return pytree.tree_unflatten(list(outs), spec)

    call.kernel = k
    return call


def jax_op(qualname, fn, *, static_argnums=(), static_argnames=(), backward=None, **jit_kwargs):
    """Registers the JAX function ``fn`` as the custom op ``qualname`` (``"ns::name"``).

    The op's schema is ``(Tensor[] args, str statics) -> Tensor[]``; its tpu kernel traces
    ``fn`` per signature, its fake (meta) kernel gives the traced output shapes, so the op
    works under ``torch.compile`` and ``torch.export``. Returns a callable with ``fn``'s
    arguments that calls the op.
    """
    k = JaxKernel(
        fn,
        name=qualname,
        static_argnums=static_argnums,
        static_argnames=static_argnames,
        backward=backward,
        jit_kwargs=jit_kwargs,
    )
    ns, _, opname = qualname.partition("::")
    if not ns or not opname:
        raise ValueError(f"jax_op: qualname must be 'namespace::name', got {qualname!r}")
    lib = torch.library.Library(ns, "FRAGMENT")
    lib.define(f"{opname}(Tensor[] args, str call) -> Tensor[]")
    _LIBS.append(lib)  # a Library deregisters its op when collected

    def impl(args, call):
        return list(_JAX_CALL(args, call))

    lib.impl(opname, impl, "PrivateUse1")
    torch.library.register_fake(qualname, _jax_call_fake, lib=lib)
    torch.library.register_autograd(qualname, _backward, setup_context=_setup_context, lib=lib)
    op = getattr(getattr(torch.ops, ns), opname)

    def run(*args, **kwargs):
        return k.flat_call(op.default, args, kwargs)

    k.jax_call_direct = False
    call = _compilable(k, run)
    call.op = op
    return call


_LIBS = []
