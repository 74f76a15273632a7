"""Readable pure-torch references of the MoE ops: the ground truth the fast paths are judged by.

Both are plain loops over experts, differentiable through torch autograd. Math runs in
at least fp32 (float64 stays float64); results are cast to the input dtype once, at the end.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._dtypes import compute_dtype
from .. import _activations


def grouped_matmul_reference(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``y[rows of group e] = x[rows of group e] @ w[e]``.

    x: ``[M, K]`` rows grouped by expert; w: ``[E, K, N]``; offsets: int ``[E]`` cumulative
    end rows (group e is rows ``offsets[e-1]:offsets[e]``, ``offsets[-1] == M``).
    Returns ``[M, N]`` in ``x.dtype``.
    """
    ct = compute_dtype(x.dtype)
    ends = offsets.tolist()
    pieces = []
    start = 0
    for e, end in enumerate(ends):
        pieces.append(x[start:end].to(ct) @ w[e].to(ct))
        start = end
    if not pieces:  # E == 0 cannot reach here (checked), kept for M == 0 clarity
        return x.new_zeros(x.shape[0], w.shape[2])
    return torch.cat(pieces, 0).to(x.dtype)


def moe_experts_reference(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                          gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                          activation: str = "silu") -> torch.Tensor:
    """Hugging Face experts semantics as a loop over experts (like ``Qwen3MoeExperts`` eager).

    hidden_states: ``[T, H]``; top_k_index: int ``[T, k]``; top_k_weights: ``[T, k]``;
    gate_up_proj: ``[E, 2I, H]`` (gate rows first); down_proj: ``[E, H, I]``.
    ``out[t] = sum_j top_k_weights[t, j] * down_proj[e] @ (act(gate) * up)``,
    ``gate, up = (gate_up_proj[e] @ hidden_states[t]).chunk(2)``, ``e = top_k_index[t, j]``;
    ``act``: ``activation`` (``"silu"``, ``"gelu"``, ``"gelu_tanh"``: :mod:`twinkle_kernels._activations`).
    Returns ``[T, H]`` in ``hidden_states.dtype``.
    """
    _activations.check(activation)
    ct = compute_dtype(hidden_states.dtype)
    x = hidden_states.to(ct)
    out = torch.zeros_like(x)
    for e in range(gate_up_proj.shape[0]):
        token_idx, slot = torch.where(top_k_index == e)
        if token_idx.numel() == 0:
            continue
        gate, up = F.linear(x[token_idx], gate_up_proj[e].to(ct)).chunk(2, dim=-1)
        h = F.linear(_activations.apply(gate, activation) * up, down_proj[e].to(ct))
        out = out.index_add(0, token_idx, h * top_k_weights[token_idx, slot, None].to(ct))
    return out.to(hidden_states.dtype)
