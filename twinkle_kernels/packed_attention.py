"""Causal self-attention over a pack of sequences (THD layout): one varlen kernel on CUDA.

A pack is ``q [T, Hq, D]``, ``k [T, Hkv, D]``, ``v [T, Hkv, Dv]`` with boundaries ``cu_seqlens``
(int ``[N + 1]``): token ``t`` of sequence ``i`` attends to the tokens of sequence ``i`` up to
itself (and, with a window ``W``, to the last ``W`` of them, itself included). Query head ``h``
reads key/value head ``h // (Hq // Hkv)`` (grouped-query attention).

Implementations, chosen by :func:`select_packed_attention`:

- ``flash_attn_varlen``: flash-attn's ``flash_attn_varlen_func``, when that package imports;
- ``torch_varlen_attn``: ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10; the causal
  flag is ``is_causal=True`` in 2.10 and ``window_size=(-1, 0)`` later, found from its signature);
- ``sdpa_loop``: ``scaled_dot_product_attention`` once per sequence. Always available; the path
  on CPU and wherever the varlen kernels cannot serve the call (fp32, head dims over 256 or not a
  multiple of 8, GPUs before sm_80, a window on a torch without ``window_size``).

Both varlen kernels are flash attention: fp16 / bf16 only, softmax statistics in fp32.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from . import _checks

__all__ = ["PackedAttentionChoice", "available_varlen", "packed_attention", "select_packed_attention"]

VARLEN_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


class PackedAttentionChoice(NamedTuple):
    impl: str       # "flash_attn_varlen" | "torch_varlen_attn" | "sdpa_loop"
    reason: str     # why, for logs and tests


def _torch_varlen() -> Optional[Callable]:
    try:
        mod = importlib.import_module("torch.nn.attention.varlen")
    except ImportError:
        return None
    return getattr(mod, "varlen_attn", None)


def _flash_attn_varlen() -> Optional[Callable]:
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # not installed, or built for another torch / CUDA: the other paths serve
        return None
    return flash_attn_varlen_func


@functools.lru_cache(maxsize=None)
def available_varlen() -> Dict[str, Callable]:
    """The varlen kernels this process can call, by implementation name (probed once)."""
    found = {}
    fa = _flash_attn_varlen()
    if fa is not None:
        found["flash_attn_varlen"] = fa
    tv = _torch_varlen()
    if tv is not None:
        found["torch_varlen_attn"] = tv
    return found


def _params(fn: Callable) -> Tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


def select_packed_attention(device, dtype: torch.dtype, head_dim: int, q_heads: int, kv_heads: int, *,
                            head_dim_v: Optional[int] = None, window: Optional[int] = None,
                            dropout: float = 0.0, capability: Optional[Tuple[int, int]] = None,
                            available: Optional[Dict[str, Callable]] = None) -> PackedAttentionChoice:
    """Which implementation :func:`packed_attention` runs for such a call, and why.

    ``capability``: the CUDA device's compute capability (queried when None on a CUDA device);
    ``available``: the varlen kernels to choose from (default :func:`available_varlen`).
    """
    device = torch.device(device)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    if device.type != "cuda":
        return PackedAttentionChoice("sdpa_loop", f"{device.type}: the varlen kernels are CUDA-only")
    if dtype not in VARLEN_DTYPES:
        return PackedAttentionChoice("sdpa_loop", f"{dtype}: the varlen (flash) kernels take fp16 / bf16 only")
    if head_dim != head_dim_v or head_dim > MAX_HEAD_DIM or head_dim % 8:
        return PackedAttentionChoice(
            "sdpa_loop", f"head dims {head_dim}/{head_dim_v}: the varlen kernels need equal q/k and v head "
                         f"dims, a multiple of 8, at most {MAX_HEAD_DIM}")
    if kv_heads <= 0 or q_heads % kv_heads:
        return PackedAttentionChoice("sdpa_loop", f"{q_heads} query heads over {kv_heads} key/value heads")
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < (8, 0):
        return PackedAttentionChoice("sdpa_loop", f"sm_{capability[0]}{capability[1]}: flash attention needs sm_80+")
    available = available_varlen() if available is None else available
    if "flash_attn_varlen" in available:
        return PackedAttentionChoice("flash_attn_varlen", "flash-attn imports: its varlen kernel, one launch per pack")
    fn = available.get("torch_varlen_attn")
    if fn is None:
        return PackedAttentionChoice("sdpa_loop", f"torch {torch.__version__} has no "
                                                  "torch.nn.attention.varlen.varlen_attn and flash-attn is missing")
    params = _params(fn)
    if dropout:
        return PackedAttentionChoice("sdpa_loop", "attention dropout: torch's varlen_attn has none")
    if window is not None and "window_size" not in params:
        return PackedAttentionChoice("sdpa_loop", "a sliding window: this torch's varlen_attn has no window_size")
    if "window_size" not in params and "is_causal" not in params:
        return PackedAttentionChoice("sdpa_loop", "torch's varlen_attn takes neither window_size nor is_causal")
    return PackedAttentionChoice("torch_varlen_attn", "torch.nn.attention.varlen.varlen_attn, one launch per pack")


def _cu_int32(cu_seqlens: torch.Tensor, device) -> torch.Tensor:
    return cu_seqlens.to(device=device, dtype=torch.int32).contiguous()


def _max_seqlen(cu: torch.Tensor) -> int:
    return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0


def sdpa_loop(q, k, v, cu_seqlens, scale: float, window: Optional[int] = None, dropout: float = 0.0):
    """The per-sequence reference path: one causal ``scaled_dot_product_attention`` per sequence."""
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    bounds = cu_seqlens.tolist()
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b <= a:
            continue
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))     # [H, n, D]
        if window is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, dropout_p=dropout, **gqa)
        else:
            i = torch.arange(b - a, device=q.device)
            allowed = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale, dropout_p=dropout, **gqa)
        out[a:b] = o.transpose(0, 1)
    return out


def _torch_varlen_call(fn, q, k, v, cu, max_len, scale, window):
    params = _params(fn)
    kwargs = {}
    if "scale" in params:
        kwargs["scale"] = scale
    else:  # torch 2.10's varlen_attn always scales by D ** -0.5
        q = q * (scale * q.shape[-1] ** 0.5)
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0) if window is None else (window - 1, 0)
    else:
        kwargs["is_causal"] = True
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # an older varlen_attn: key/value heads repeated as GQA defines them
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return fn(q, k, v, cu, cu, max_len, max_len, **kwargs)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                     scale: Optional[float] = None, window: Optional[int] = None, dropout: float = 0.0,
                     max_seqlen: Optional[int] = None, impl: Optional[str] = None) -> torch.Tensor:
    """Causal attention of each sequence of a pack to itself.

    Args:
        q: ``[T, Hq, D]``; k: ``[T, Hkv, D]``; v: ``[T, Hkv, Dv]``; same dtype and device, Hq % Hkv == 0.
        cu_seqlens: int ``[N + 1]``, ``0 = cu[0] <= ... <= cu[N] = T`` (empty sequences allowed).
        scale: softmax scale (default ``D ** -0.5``); window: each token sees itself and the
            ``window - 1`` tokens before it (None: the whole prefix); dropout: attention dropout.
        max_seqlen: the longest sequence, when the caller knows it (saves a device read).
        impl: force an implementation (see :func:`select_packed_attention`), None to choose.

    Returns ``[T, Hq, Dv]`` in q's dtype. Differentiable.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [T, heads, dim]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]) or k.shape[1] != v.shape[1] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: tokens, key/value heads "
                         "and q/k head dims must match")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q has {q.shape[1]} heads, k/v {k.shape[1]}: q heads must be a multiple of k/v heads")
    # integer, [N + 1], from 0 to T, non-decreasing, on q's device: a float tensor or one that does not
    # end at T gave rows of zeros or overlapping samples (checked as the Gated DeltaNet ops check it)
    _checks.cu_seqlens(cu_seqlens, 1, q.shape[0], q.device, values=not torch.compiler.is_compiling())
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if impl is None:
        impl = select_packed_attention(q.device, q.dtype, q.shape[2], q.shape[1], k.shape[1],
                                       head_dim_v=v.shape[2], window=window, dropout=dropout).impl
    if impl == "sdpa_loop":
        return sdpa_loop(q, k, v, cu_seqlens, scale, window, dropout)
    cu = _cu_int32(cu_seqlens, q.device)
    max_len = _max_seqlen(cu) if max_seqlen is None else int(max_seqlen)
    fn = available_varlen().get(impl)
    if fn is None:
        raise ValueError(f"packed attention impl {impl!r} is not available here "
                         f"(available: sdpa_loop, {', '.join(available_varlen()) or 'no varlen kernel'})")
    if impl == "flash_attn_varlen":
        win = (-1, -1) if window is None else (window - 1, 0)
        return fn(q, k, v, cu, cu, max_len, max_len, dropout_p=dropout, softmax_scale=scale, causal=True,
                  window_size=win)
    if dropout:
        raise ValueError("torch_varlen_attn has no attention dropout")
    return _torch_varlen_call(fn, q, k, v, cu, max_len, scale, window)
