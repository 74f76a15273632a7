"""The gated linear units on the C++ CPU backend (``csrc/swiglu``): the split form's autograd is
C++ (the ``swiglu`` op), the packed form's a Python Function over the same kernels.

Operands are passed as ``[M, n]`` views with any row stride: the packed layout's halves
and their gradients are views of one buffer, and row-strided inputs are not copied.
``activation`` (``"silu"``, ``"gelu"``, ``"gelu_tanh"``) goes to the kernels as its code
(:data:`twinkle_kernels._activations.CODE`).
"""
from __future__ import annotations

import math

import torch

from .. import _alloc, _cpu_ext
from .._activations import CODE


def _rows(t: torch.Tensor) -> torch.Tensor:
    n = t.shape[-1]
    t2 = t.reshape(math.prod(t.shape[:-1]), n)
    if n > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    return t2


def swiglu_backward(dy, gate, up, activation="silu"):
    """gate, up, dy: ``[..., I]`` -> (dgate, dup) in gate's shape and dtype."""
    g2, u2 = _rows(gate), _rows(up)
    dy2 = _rows(dy.to(g2.dtype))
    dg = _alloc.empty(g2.shape, dtype=g2.dtype, device=g2.device)
    du = _alloc.empty(g2.shape, dtype=g2.dtype, device=g2.device)
    _cpu_ext.ops().swiglu_bwd(dy2, g2, u2, dg, du, CODE[activation])
    return dg.view(gate.shape), du.view(gate.shape)


def swiglu_packed_backward(dy, x, activation="silu"):
    """x: ``[..., 2n]``, dy: ``[..., n]`` -> dx in x's shape and dtype."""
    x2 = _rows(x)
    n = x2.shape[1] // 2
    dy2 = _rows(dy.to(x2.dtype))
    dx = _alloc.empty(x2.shape, dtype=x2.dtype, device=x2.device)
    _cpu_ext.ops().swiglu_bwd(dy2, x2[:, :n], x2[:, n:], dx[:, :n], dx[:, n:], CODE[activation])
    return dx.view(x.shape)


class SwiGLUPackedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, activation):
        x2 = _rows(x)
        n = x2.shape[1] // 2
        y = _alloc.empty(x2.shape[0], n, dtype=x2.dtype, device=x2.device)
        _cpu_ext.ops().swiglu_fwd(x2[:, :n], x2[:, n:], y, CODE[activation])
        ctx.save_for_backward(x2)
        ctx.shape, ctx.activation = x.shape, activation
        return y.view(x.shape[:-1] + (n,))

    @staticmethod
    def backward(ctx, dy):
        (x2,) = ctx.saved_tensors
        return swiglu_packed_backward(dy, x2, ctx.activation).view(ctx.shape), None


def swiglu(gate, up, activation="silu"):
    # forward and backward in C++ (csrc/swiglu: torch::autograd::Function): at small hidden sizes a
    # Python autograd.Function cost more than the two kernels it ran
    return _cpu_ext.op("swiglu")(gate, up, CODE[activation], _alloc.poisoning())


def swiglu_packed(x, activation="silu"):
    return SwiGLUPackedFunction.apply(x, activation)
