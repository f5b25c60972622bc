"""torch_pjrt: PyTorch's ``tpu`` device on any XLA device, through PJRT.

``import torch_pjrt`` loads a PJRT plugin (libtpu, the XLA CUDA plugin or the XLA CPU
plugin), registers the ``tpu`` device with PyTorch and the ``torch.tpu`` module. Every op
on a tpu tensor is lowered in Rust to StableHLO and run by XLA.
"""

import atexit
import site
import sys
import types


def _autoload():
    """Entry point for ``torch.backends`` autoloading: importing the package is enough.

    Defined before ``import torch``: importing torch autoloads this entry point while this
    module is still initializing.
    """


import torch  # noqa: E402

from . import _C  # noqa: E402

__all__ = [
    "export_stablehlo",
    "metrics",
    "metrics_report",
    "reset_metrics",
    "enable_cpu_fallback",
    "lowered_ops",
    "cache_info",
    "clear_cache",
    "set_cache_dir",
    "set_shape_buckets",
    "wait_background",
]


def _search_dirs():
    dirs = []
    try:
        dirs.extend(site.getsitepackages())
    except AttributeError:
        pass
    dirs.extend(p for p in sys.path if p.endswith("site-packages"))
    return list(dict.fromkeys(dirs))


def _register():
    _C._init(_search_dirs())
    # A background compilation must not outlive the PJRT client at exit.
    atexit.register(_C.shutdown_background)
    if torch._C._get_privateuse1_backend_name() != "tpu":
        torch.utils.rename_privateuse1_backend("tpu")
    if not hasattr(torch.Tensor, "is_tpu"):
        torch.utils.generate_methods_for_privateuse1_backend(
            for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True
        )
    from . import device as _device
    from . import modules as _modules

    _modules.install()

    if not hasattr(torch, "tpu"):
        torch._register_device_module("tpu", _device)
    _patch_printing()
    from .amp import _install_default_dtype

    _install_default_dtype()
    _claim_composite_ops()
    if torch.distributed.is_available():
        from .distributed import register as _register_c10d

        _register_c10d()
    # Run backward of tpu tensors on the calling thread: autograd's per-device worker
    # threads outlive the interpreter at exit and abort the process when they drop
    # Python state during finalization.
    torch._C._set_multithreading_enabled(False)


def _claim_composite_ops():
    # Some ops (the _foreach_* family, native_layer_norm, ...) have composite kernels that
    # would split them before they reach the backend; Rust lists those it lowers whole, and
    # every overload of each is routed to it.
    names = []
    for op in _C.claimed_ops():
        base = op.split("::", 1)[1]
        for variant in (base, base + "_"):
            packet = getattr(torch.ops.aten, variant, None)
            if packet is None:
                continue
            for ov in packet.overloads():
                names.append(f"aten::{variant}" + ("" if ov == "default" else f".{ov}"))
    if names:
        _C.register_boxed(names)


def _patch_printing():
    # Formatting a tensor runs a dozen small ops; do them on a host copy (as PyTorch does
    # for xla tensors) so printing compiles nothing and never falls back.
    import torch._tensor_str as ts

    if getattr(ts._tensor_str, "_torch_pjrt", False):
        return
    orig = ts._tensor_str

    def _tensor_str(self, indent):
        if self.device.type == "tpu":
            self = self.detach().cpu()
        return orig(self, indent)

    _tensor_str._torch_pjrt = True
    ts._tensor_str = _tensor_str


def _after_optimizer_step(optimizer, args, kwargs):
    """Tells the runtime a training step ended (DeferAndFuse may flush there, see
    ``Runtime::step_boundary``). Skipped while Dynamo traces a compiled ``opt.step``."""
    if not torch.compiler.is_compiling():
        _C.step_boundary()


_register()
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402

register_optimizer_step_post_hook(_after_optimizer_step)

from . import compile as _compile  # noqa: E402  (registers the "tpu" Dynamo backend)
from .compile import export_stablehlo  # noqa: E402


def metrics():
    """Counters since start (or the last ``reset_metrics``).

    Keys: compilations (real XLA compilations; programs loaded from the disk cache are
    disk_hits, with load_seconds), cache_hits, cache_misses, compile_seconds, executions,
    host_to_device_bytes, device_to_host_bytes, native_calls, fallback_calls,
    cached_programs (per-op programs held in memory, at most ``TORCH_TPU_MAX_CACHED_PROGRAMS``,
    default 4096), evicted_programs (dropped to stay within it; reloaded from the disk cache
    when needed again), graph_programs (DeferAndFuse graphs whose program was not in
    memory: compiled or loaded), and ``ops``: {op name: (native calls, fallback calls)}.

    ``compile`` (torch.compile): dynamo_graphs (distinct graphs Dynamo traced; one for all
    lengths under dynamic shapes), compiled_graphs (programs captured: one per graph and
    distinct input shape/layout), recompilations and, by reason, recompilations_new_shape,
    recompilations_new_layout, recompilations_evicted, recompilations_released;
    evicted_programs (over ``max_programs``), released_programs, live_programs (compiled
    programs held now; not reset), graph_breaks, eager_graphs, eager_graph_calls,
    dynamo_graph_breaks.
    """
    m = _C.metrics()
    m["compile"] = dict(_compile.counters)
    m["compile"]["live_programs"] = _C.live_programs()
    try:
        from torch._dynamo.utils import counters as dynamo_counters

        m["compile"]["dynamo_graph_breaks"] = sum(dynamo_counters["graph_break"].values())
        m["compile"]["dynamo_graphs"] = dynamo_counters["stats"]["unique_graphs"]
    except Exception:  # noqa: BLE001 - dynamo internals may move
        pass
    return m


def reset_metrics():
    _C.reset_metrics()
    _compile.counters.clear()


def metrics_report():
    """The metrics as a printable table."""
    m = metrics()
    lines = ["counter                      value"]
    for k, v in m.items():
        if k not in ("ops", "compile", "flush_reasons"):
            lines.append(f"{k:<28} {v:.4f}" if isinstance(v, float) else f"{k:<28} {v}")
    lines.append("")
    lines.append(f"{'op':<44} {'native':>8} {'fallback':>9}")
    for name, (n, f) in sorted(m["ops"].items(), key=lambda kv: -(kv[1][0] + kv[1][1])):
        lines.append(f"{name:<44} {n:>8} {f:>9}")
    text = "\n".join(lines)
    print(text)
    return text


def cache_info():
    """The compilation caches.

    Compiled programs are cached in memory and on disk, in ``TORCH_TPU_CACHE_DIR`` (default
    ``$XDG_CACHE_HOME/torch_pjrt`` or ``~/.cache/torch_pjrt``; ``""`` turns it off), capped at
    ``TORCH_TPU_CACHE_MAX_BYTES`` (default 10 GiB, least recently used entries go first).
    Keys: directory (None: off), entries and bytes on disk, max_bytes, writable,
    memory_programs, memory_hits/memory_misses, disk_hits/disk_misses (since start or
    ``reset_metrics``), corrupt_entries, compilations, compile_seconds, load_seconds.
    """
    return _C.cache_info()


def clear_cache(disk=True):
    """Empties the in-memory compilation caches and, with ``disk``, the cache directory.

    Returns the number of disk entries deleted.
    """
    return _C.clear_cache(bool(disk))


def set_cache_dir(path):
    """Uses ``path`` for the disk compilation cache from now on; None turns it off."""
    _C.set_cache_dir(None if path is None else str(path))


def set_shape_buckets(on=True):
    """Programs that serve a range of sizes (off by default; ``TORCH_TPU_SHAPE_BUCKETS=1``).

    In Strict and Debug modes, once an op is called again with other sizes, calls at new
    sizes run a program compiled for a power-of-two bucket of each changing dimension
    instead of compiling one per shape; ``metrics()["programs"]`` counts programs and
    bucket hits per op. Returns the previous setting."""
    was = _C.shape_buckets()
    _C.set_shape_buckets(bool(on))
    return was


def wait_background():
    """Waits for the compilations running in the background: optimized versions of programs
    that became hot, exact programs of shapes a bucketed program kept serving (see
    ``metrics()["background_compilations"]``). Benchmarks call it before measuring the
    steady state."""
    _C.wait_background()


def lowered_ops():
    """ATen op names with a native lowering rule."""
    return list(_C.lowered_ops())


class _Module(types.ModuleType):
    @property
    def enable_cpu_fallback(self):
        """Run ops without a lowering on the CPU (True, the default) or raise NotImplementedError."""
        return _C.fallback_enabled()

    @enable_cpu_fallback.setter
    def enable_cpu_fallback(self, on):
        _C.set_fallback_enabled(bool(on))


sys.modules[__name__].__class__ = _Module
