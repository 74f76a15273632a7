"""The sum of squares of many tensors in float64: a gradient norm's square without its rounding.

Backends: ``reference`` (:mod:`.reference`) and ``cpu`` (C++ in ``csrc/reduce``, :mod:`._cpu`).
On other devices the reference serves: there torch's own reductions are fast.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import _checks, _dispatch
from .._verifiers import cpu_reason
from .reference import sum_of_squares_reference

__all__ = ["sum_of_squares", "sum_of_squares_reference"]

_OP = _dispatch.op("sum_of_squares")
_OP.register("reference")(sum_of_squares_reference)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def sum_of_squares(tensors: Sequence[torch.Tensor], *, backend: Optional[str] = None) -> torch.Tensor:
    """``sum_t sum_i float64(t[i])**2``: the squared L2 norm of all of ``tensors`` together.

    Every element is widened to float64 before it is squared, so neither the squares nor the sum
    round or overflow at the input's precision. torch's CPU float32 norm sums in one float32
    accumulator, so a large gradient's norm comes out low. Not differentiable: the inputs are
    read detached.

    Args:
        tensors: a list or tuple of tensors, any shapes (a non-contiguous one is read through a
            contiguous copy), float32 / bfloat16 / float16 / float64, all on one device; empty
            gives 0.
        backend: ``None``/"auto", "reference" or "cpu".

    Returns a 0-dim float64 tensor on the tensors' device (the CPU for an empty list).

    Example::

        norm = sum_of_squares([p.grad for p in model.parameters()]).sqrt()
    """
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"tensors must be a list or tuple of tensors, got {type(tensors).__name__}")
    for i, t in enumerate(tensors):
        _checks.tensor(f"tensors[{i}]", t)
        if t.dtype not in _DTYPES:
            raise TypeError(f"tensors[{i}] has dtype {t.dtype}; expected float32, bfloat16, float16 or float64")
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    _checks.same_device(tuple(f"tensors[{i}]" for i in range(len(tensors))), tuple(tensors))
    return _OP(tensors[0].device, backend, tensors)


def _cpu_verify(tensors) -> Optional[str]:
    reason = cpu_reason(tensors[0])
    if reason is not None and tensors[0].dtype == torch.float64 and tensors[0].device.type == "cpu":
        reason = None   # the C++ loop reads float64 as well
    if reason is None:
        from . import _cpu
        reason = _cpu.missing_reason()
    return reason


@_OP.register("cpu", verify=_cpu_verify)
def _sum_cpu(tensors):
    from . import _cpu
    return _cpu.sum_of_squares(tensors)
