"""Readable rotary-embedding reference in the Hugging Face convention (``rotate_half``)."""
from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    rot = cos.shape[-1]
    xf = x.to(ct)
    if rot == x.shape[-1]:  # full rotary: no pass-through to concatenate (a copy torch.compile would keep)
        return (xf * cos.to(ct) + rotate_half(xf) * sin.to(ct)).to(x.dtype)
    x_rot, x_pass = xf[..., :rot], xf[..., rot:]
    out = x_rot * cos.to(ct) + rotate_half(x_rot) * sin.to(ct)
    return torch.cat((out, x_pass), dim=-1).to(x.dtype)


def apply_rotary_pos_emb_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                   unsqueeze_dim: int = 1):
    """``q * cos + rotate_half(q) * sin`` on the first ``cos.shape[-1]`` channels; the rest pass through.

    q: ``[..., Hq, ..., D]``, k: ``[..., Hk, ..., D]``; cos, sin: q's shape without the head
    dim (``unsqueeze_dim`` says where it is), last dim ``R <= D``, ``R`` even. Math in fp32,
    outputs in q's / k's dtype.
    """
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)
