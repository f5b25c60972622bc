"""Moving modules to and from tpu keeps their parameters: identity and sharing.

`nn.Module._apply` converts a parameter in place (`param.data = new`) only when the two
tensors have "compatible shallow-copy types", which PyTorch grants to CPU/CUDA/XPU/... dense
tensors but not to PrivateUse1 ones; otherwise it wraps each module's converted tensor in a
new Parameter, so tied weights (an LM head sharing the embedding) come apart and an
optimizer built before the move holds stale tensors. PyTorch's other path, swapping the
tensors (`torch.utils.swap_tensors`, what `torch.__future__.set_swap_module_params_on_
conversion(True)` selects), keeps each Parameter object, which is what CUDA users get; it is
used for moves that involve tpu.
"""

import contextlib
import itertools
import warnings

import torch
from torch.nn import Module

_ORIGINAL = {}


def _on_tpu(module):
    return any(t.device.type == "tpu"
               for t in itertools.chain(module.parameters(), module.buffers()))


@contextlib.contextmanager
def _swapping(on):
    if not on or torch.__future__.get_swap_module_params_on_conversion():
        yield
        return
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)


def _move(name, module, target_is_tpu, *args, **kwargs):
    original = _ORIGINAL[name]
    swap = target_is_tpu or _on_tpu(module)
    try:
        with _swapping(swap):
            return original(module, *args, **kwargs)
    except RuntimeError as e:
        if not swap or "Couldn't swap" not in str(e):
            raise
        # A tensor that cannot be swapped (weak references to it): PyTorch's own path.
        warnings.warn(f"moving {type(module).__name__} to or from tpu: {e}; its parameters "
                      "were replaced (tied weights come apart; call tie_weights() again)",
                      stacklevel=3)
        return original(module, *args, **kwargs)


def _to(self, *args, **kwargs):
    device = torch._C._nn._parse_to(*args, **kwargs)[0]
    return _move("to", self, device is not None and device.type == "tpu", *args, **kwargs)


def _tpu(self, *args, **kwargs):
    return _move("tpu", self, True, *args, **kwargs)


def _cpu(self, *args, **kwargs):
    return _move("cpu", self, False, *args, **kwargs)


def install():
    for name, fn in (("to", _to), ("tpu", _tpu), ("cpu", _cpu)):
        if name not in _ORIGINAL:
            _ORIGINAL[name] = getattr(Module, name)
            setattr(Module, name, fn)
