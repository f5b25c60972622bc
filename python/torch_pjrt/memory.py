"""``torch.tpu``'s memory functions, CUDA's names over ``torch.accelerator``'s statistics.

The counts are Rust's (runtime ``memory.rs``): "allocated" is the bytes of live tpu
storages; "reserved" is what the plugin reports in use (TPU, GPU), the allocated bytes on
the CPU plugin. PJRT owns the buffers, so there is no cache to empty: ``empty_cache`` waits
for queued work (whose finished inputs are then freed) and gives freed host memory back to
the system (the CPU plugin's buffers are host memory).
"""

import torch

from . import _C


def _dev(device):
    from .device import _index

    idx = _index(device)
    if not 0 <= idx < _C.device_count():
        raise ValueError(f"Invalid device index {idx}: {_C.device_count()} tpu devices")
    return idx


def memory_stats(device=None):
    return torch.accelerator.memory_stats(_dev(device))


def memory_allocated(device=None):
    return torch.accelerator.memory_allocated(_dev(device))


def max_memory_allocated(device=None):
    return torch.accelerator.max_memory_allocated(_dev(device))


def memory_reserved(device=None):
    return torch.accelerator.memory_reserved(_dev(device))


def max_memory_reserved(device=None):
    return torch.accelerator.max_memory_reserved(_dev(device))


def reset_peak_memory_stats(device=None):
    torch.accelerator.reset_peak_memory_stats(_dev(device))


def reset_accumulated_memory_stats(device=None):
    torch.accelerator.reset_accumulated_memory_stats(_dev(device))


def empty_cache():
    torch.accelerator.empty_cache()


def mem_get_info(device=None):
    """(free, total) bytes of the device: the plugin's figures, or the host's memory on the
    CPU plugin."""
    return torch.accelerator.get_memory_info(_dev(device))


def set_per_process_memory_fraction(fraction, device=None):
    """Tensors on ``device`` may hold at most ``fraction`` of its total memory; an
    allocation past it raises ``torch.OutOfMemoryError`` (and allocates nothing)."""
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    _C.set_memory_fraction(_dev(device), fraction)


def memory_summary(device=None, abbreviated=False):
    """A printable table of the device's memory statistics."""
    idx = _dev(device)
    s = memory_stats(idx)

    def size(n):
        for unit in ("B", "KiB", "MiB", "GiB"):
            if abs(n) < 1024 or unit == "GiB":
                return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
            n /= 1024

    rows = [("Allocated memory", "allocated_bytes.all", size),
            ("Reserved memory", "reserved_bytes.all", size),
            ("Tensor storages", "allocation.all", str)]
    free, total = mem_get_info(idx)
    lines = [f"tpu:{idx} memory summary ({size(free)} free of {size(total)}; "
             f"{s.get('num_ooms', 0)} out-of-memory errors)",
             f"{'metric':<18} {'current':>12} {'peak':>12} {'allocated':>12} {'freed':>12}"]
    for name, key, fmt in rows:
        vals = [fmt(s.get(f"{key}.{k}", 0)) for k in ("current", "peak", "allocated", "freed")]
        lines.append(f"{name:<18} " + " ".join(f"{v:>12}" for v in vals))
    return "\n".join(lines)


__all__ = [
    "empty_cache", "max_memory_allocated", "max_memory_reserved", "mem_get_info",
    "memory_allocated", "memory_reserved", "memory_stats", "memory_summary",
    "reset_accumulated_memory_stats", "reset_peak_memory_stats",
    "set_per_process_memory_fraction",
]
