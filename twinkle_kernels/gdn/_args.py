"""Argument checks of the Gated DeltaNet ops. Every error names the argument."""
from __future__ import annotations

from typing import List, Optional

import torch

from .. import _checks

SUPPORTED_CHUNK_SIZES = (16, 32, 64, 128)
ACTIVATIONS = (None, "silu", "swish")
_INT_DTYPES = (torch.int32, torch.int64)


def _bool(name: str, v) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
    return v


# the offsets' check is shared with twinkle_kernels.packed_attention
cu_seqlens = _checks.cu_seqlens


def gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                     cu, chunk_size=None, values=True):
    """Checks the arguments of chunk/fused_recurrent_gated_delta_rule; returns the resolved scale.
    ``values=False``: the offsets' values are left to the op (see :func:`cu_seqlens`)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _checks.tensor(name, t)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D ({'[B, T, H, K]' if name != 'v' else '[B, T, HV, V]'}), "
                             f"got shape {tuple(t.shape)}")
    _checks.same_shape(("q", "k"), (q, k))
    _checks.same_dtype(("q", "k", "v"), (q, k, v))
    B, T, H, K = q.shape
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must have shape [B, T, HV, V] = [{B}, {T}, HV, V] like q's [B, T], got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H != 0:
        raise ValueError(f"v's head count HV={HV} must be a multiple of q/k's head count H={H} (HV % H == 0)")
    if K == 0 or V == 0:
        raise ValueError(f"head dims must be positive, got K={K} (q, k) and V={V} (v)")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (B, T, HV):
            raise ValueError(f"{name} must have shape [B, T, HV] = {[B, T, HV]}, got {tuple(t.shape)}")
    if initial_state is not None:
        _checks.tensor("initial_state", initial_state)
    _checks.same_device(("q", "k", "v", "g", "beta", "initial_state"), (q, k, v, g, beta, initial_state))
    if scale is None:
        scale = K ** -0.5
    else:
        scale = _checks.positive_float("scale", scale)
    _bool("output_final_state", output_final_state)
    _bool("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    cu_seqlens(cu, B, T, q.device, values)
    N = B if cu is None else cu.shape[0] - 1
    if initial_state is not None:
        if tuple(initial_state.shape) != (N, HV, K, V):
            what = "the number of sequences in cu_seqlens" if cu is not None else "the batch size"
            raise ValueError(f"initial_state must have shape [N, HV, K, V] = {[N, HV, K, V]} (N = {what}), "
                             f"got {tuple(initial_state.shape)}")
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
            raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__}")
        if chunk_size not in SUPPORTED_CHUNK_SIZES:
            raise ValueError(f"chunk_size={chunk_size} is not supported; supported chunk sizes: {SUPPORTED_CHUNK_SIZES}")
    return scale


def activation(act) -> Optional[str]:
    if act not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {act!r}")
    return None if act is None else "silu"


def conv_weight(x, weight, bias) -> None:
    x_channels = x.shape[1]
    _checks.tensor("weight", weight)
    if weight.dim() != 2 or weight.shape[0] != x_channels or weight.shape[1] < 1:
        raise ValueError(f"weight must have shape [D, W] = [{x_channels}, W] with W >= 1, got {tuple(weight.shape)}")
    if bias is not None:
        _checks.tensor("bias", bias)
        if tuple(bias.shape) != (x_channels,):
            raise ValueError(f"bias must have shape [D] = [{x_channels}], got {tuple(bias.shape)}")
    _checks.same_device(("x", "weight", "bias"), (x, weight, bias))


def causal_conv1d(x, weight, bias, act, cu, values=True):
    _checks.tensor("x", x)
    if x.dim() != 3:
        raise ValueError(f"x must be 3-D [B, D, T], got shape {tuple(x.shape)}")
    conv_weight(x, weight, bias)
    act = activation(act)
    cu_seqlens(cu, x.shape[0], x.shape[2], x.device, values)
    return act


def causal_conv1d_update(x, conv_state, weight, bias, act):
    _checks.tensor("x", x)
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [B, D, S] or [B, D], got shape {tuple(x.shape)}")
    conv_weight(x, weight, bias)
    _checks.tensor("conv_state", conv_state)
    W = weight.shape[1]
    if conv_state.dim() != 3 or conv_state.shape[:2] != x.shape[:2] or conv_state.shape[2] < W - 1:
        raise ValueError(f"conv_state must have shape [B, D, L] = [{x.shape[0]}, {x.shape[1]}, L] with "
                         f"L >= W - 1 = {W - 1}, got {tuple(conv_state.shape)}")
    _checks.same_device(("x", "conv_state"), (x, conv_state))
    return activation(act)
