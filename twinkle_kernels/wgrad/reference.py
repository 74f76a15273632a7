"""The reference of :func:`twinkle_kernels.wgrad_accum`: the unfused weight gradient, then its add."""
from __future__ import annotations

import torch


def wgrad_accum_reference(x: torch.Tensor, dy: torch.Tensor, main_grad: torch.Tensor,
                          accumulate: bool = True) -> None:
    """``main_grad += dy^T @ x`` (``accumulate=False``: ``main_grad = dy^T @ x``): the product in the
    inputs' dtype (as autograd's weight gradient), added into (or written over) ``main_grad`` in its
    dtype."""
    product = (dy.t() @ x).to(main_grad.dtype)
    if accumulate:
        main_grad.add_(product)
    else:
        main_grad.copy_(product)
