"""``torch.tpu.compiler``: XLA options for the programs compiled in a block."""

import contextlib

from . import _C

__all__ = ["custom_compiler_options"]


def _current():
    return dict(_C.compiler_options())


@contextlib.contextmanager
def custom_compiler_options(options=None, **kwargs):
    """Compiles the programs made in the block with these XLA options, by name
    (``xla_cpu_enable_fast_math=True``, ``{"xla_cpu_max_isa": "AVX2"}``; values are bools,
    ints, floats or strings). Nested blocks add to the outer one's options. The options are
    part of every cache key, so a program compiled with them is not reused outside the
    block, and ops already compiled without them compile again inside it. A name XLA does
    not know fails the first compilation in the block with XLA's error. ``torch.compile``d
    graphs keep the options they were captured with."""
    merged = _current()
    merged.update(options or {})
    merged.update(kwargs)
    for name in merged:
        if not isinstance(name, str):
            raise TypeError(f"compiler option names are strings, got {name!r}")
    prev = _C.set_compiler_options(list(merged.items()))
    try:
        yield
    finally:
        _C.set_compiler_options(prev)
