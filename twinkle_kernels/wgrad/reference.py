"""The reference of :func:`twinkle_kernels.wgrad_accum`: the unfused weight gradient, then its add."""
from __future__ import annotations

import torch


def wgrad_accum_reference(x: torch.Tensor, dy: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += dy^T @ x``: the product in the inputs' dtype (as autograd's weight gradient),
    added into ``main_grad`` in its dtype."""
    main_grad.add_((dy.t() @ x).to(main_grad.dtype))
