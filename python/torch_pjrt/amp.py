"""Automatic mixed precision on tpu.

The op policy is CUDA's, registered by the shim (``shim/autocast.cpp``). What Python adds:
``torch.autocast("tpu")`` defaults to bfloat16, as TorchTPU's does. PyTorch keeps the
autocast dtype per thread and starts every thread at float16 for custom devices, so the
default is answered here until a thread sets its own.
"""

import functools
import threading

import torch

_state = threading.local()


def get_amp_supported_dtype():
    return [torch.bfloat16, torch.float16]


def is_bf16_supported(including_emulation=True):
    """Every PJRT device runs bfloat16 (XLA emulates it where the hardware lacks it)."""
    return True


def _install_default_dtype():
    get, put = torch.get_autocast_dtype, torch.set_autocast_dtype
    if getattr(get, "_torch_pjrt", False):
        return

    @functools.wraps(get)
    def get_autocast_dtype(device_type):
        if device_type == "tpu" and not getattr(_state, "dtype_set", False):
            return torch.bfloat16
        return get(device_type)

    @functools.wraps(put)
    def set_autocast_dtype(device_type, dtype):
        put(device_type, dtype)
        if device_type == "tpu":
            _state.dtype_set = True

    get_autocast_dtype._torch_pjrt = True
    torch.get_autocast_dtype = get_autocast_dtype
    torch.set_autocast_dtype = set_autocast_dtype
