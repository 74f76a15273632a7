""":func:`twinkle_kernels.wgrad_accum` on the C++ CPU backend (``csrc/linear/wgrad_accum.cpp``)."""
from __future__ import annotations

import functools

from .. import _cpu_ext


def wgrad_accum(x, dy, main_grad, accumulate: bool = True) -> None:
    fn = _cpu_ext.op("wgrad_accum")
    if accumulate:
        fn(x, dy, main_grad)
    elif _overwrites(fn):
        fn(x, dy, main_grad, False)
    else:   # a build from before ``accumulate``: the same values, with the zeroing and the read
        main_grad.zero_()
        fn(x, dy, main_grad)


@functools.lru_cache(maxsize=None)
def _overwrites(fn) -> bool:
    return any(a.name == "accumulate" for a in fn._schema.arguments)
