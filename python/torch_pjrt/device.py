"""The ``torch.tpu`` device module."""

import contextlib
import enum
import struct
import sys
import types

import torch

from . import _C
from . import compiler as compiler  # torch.tpu.compiler
from . import pallas as pallas  # torch.tpu.pallas
from . import profiler as profiler  # torch.tpu.profiler
from .amp import get_amp_supported_dtype, is_bf16_supported  # noqa: F401
from .memory import *  # noqa: F403
from .memory import __all__ as _memory_names
from .streams import *  # noqa: F403
from .streams import __all__ as _stream_names

__all__ = [
    "is_available",
    "device_count",
    "current_device",
    "set_device",
    "device",
    "synchronize",
    "get_device_name",
    "manual_seed",
    "manual_seed_all",
    "initial_seed",
    "seed",
    "get_rng_state",
    "set_rng_state",
    "get_rng_state_all",
    "set_rng_state_all",
    "is_initialized",
    "EagerMode",
    "get_amp_supported_dtype",
    "is_bf16_supported",
    "set_eager_mode",
]
__all__ += _memory_names + _stream_names


class EagerMode(enum.Enum):
    """How eager ops run (TorchTPU's modes).

    DEFER_NEVER: Strict, the default: each op is dispatched asynchronously, like CUDA.
    DEFER_NEVER_AND_LAUNCH_BLOCKING: Debug: waits on every op (TORCH_TPU_LAUNCH_BLOCKING=1).
    DEFER_AND_FUSE: records ops and runs them as one fused program at synchronization
    points (TORCH_TPU_DEFER_AND_FUSE=1).
    """

    DEFER_NEVER = 0
    DEFER_NEVER_AND_LAUNCH_BLOCKING = 1
    DEFER_AND_FUSE = 2


def _get_mode():
    return EagerMode(_C.eager_mode())


def _set_mode(mode):
    if not isinstance(mode, EagerMode):
        raise TypeError(f"expected a torch.tpu.EagerMode, got {type(mode).__name__}")
    _C.set_eager_mode(mode.value)


@contextlib.contextmanager
def set_eager_mode(mode):
    """Runs the body in `mode`, restoring the previous mode afterwards (also on error)."""
    prev = _get_mode()
    _set_mode(mode)
    try:
        yield
    finally:
        _set_mode(prev)


def is_available():
    return _C.device_count() > 0


def is_initialized():
    return True


def _lazy_init():
    pass


def _is_in_bad_fork():
    """True in a child forked after torch_pjrt set up the device: tpu ops raise there (use
    the 'spawn' start method), CPU work goes on."""
    return _C.in_bad_fork()


def device_count():
    """Addressable devices of the PJRT client."""
    return _C.device_count()


def current_device():
    return _C.current_device()


def _index(dev):
    if dev is None:
        return current_device()
    if isinstance(dev, int):
        return dev
    dev = torch.device(dev)
    if dev.type != "tpu":
        raise ValueError(f"Expected a tpu device, but got: {dev}")
    return current_device() if dev.index is None else dev.index


def set_device(dev):
    idx = _index(dev)
    if not 0 <= idx < device_count():
        raise RuntimeError(f"Invalid device index {idx}: {device_count()} tpu devices are visible")
    torch.accelerator.set_device_index(idx)


@contextlib.contextmanager
def _device_ctx(dev):
    prev = current_device()
    idx = _index(dev)
    if idx >= 0 and idx != prev:
        set_device(idx)
    try:
        yield
    finally:
        if idx >= 0 and idx != prev:
            set_device(prev)


class device:
    """Context manager that makes ``dev`` the current tpu device."""

    def __init__(self, dev):
        self._ctx = _device_ctx(dev)

    def __enter__(self):
        return self._ctx.__enter__()

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def synchronize(dev=None):
    """Waits for every op issued so far, on every stream; raises the first device error."""
    _C.synchronize()


def get_device_name(dev=None):
    """The PJRT platform of the device (e.g. ``cpu``, ``cuda``, ``tpu``)."""
    return _C.platform_name()


def get_device_properties(dev=None):
    idx = _index(dev)
    return {"name": _C.platform_name(), "kind": _C.device_kind(idx), "index": idx,
            "plugin": _C.plugin_path()}


def manual_seed(seed):
    _C.manual_seed(current_device(), int(seed) & 0xFFFF_FFFF_FFFF_FFFF)


def manual_seed_all(seed):
    for i in range(device_count()):
        _C.manual_seed(i, int(seed) & 0xFFFF_FFFF_FFFF_FFFF)


def seed():
    import random

    manual_seed(random.getrandbits(63))


def initial_seed():
    return _C.initial_seed(current_device())


def get_rng_state(device="tpu"):
    """The default generator's state of `device`: a CPU uint8 tensor (seed, offset)."""
    seed, offset = _C.rng_state(_index(device))
    return torch.frombuffer(bytearray(struct.pack("<qq", seed, offset)), dtype=torch.uint8)


def set_rng_state(new_state, device="tpu"):
    """Restores a state from `get_rng_state`."""
    if not isinstance(new_state, torch.Tensor) or new_state.dtype != torch.uint8:
        raise TypeError("set_rng_state expects a torch.ByteTensor from get_rng_state")
    data = bytes(new_state.cpu().contiguous().tolist())
    if len(data) != 16:
        raise RuntimeError(f"RNG state is wrong size: expected 16 bytes, got {len(data)}")
    seed, offset = struct.unpack("<qq", data)
    _C.set_rng_state(_index(device), seed, offset)


def get_rng_state_all():
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(new_states):
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


class _DeviceModule(types.ModuleType):
    @property
    def eager_mode(self):
        """The current EagerMode; assign to change it (pending deferred work runs first)."""
        return _get_mode()

    @eager_mode.setter
    def eager_mode(self, mode):
        _set_mode(mode)


sys.modules[__name__].__class__ = _DeviceModule
