"""A packing-aware attention implementation for transformers' ``AttentionInterface``.

With packed (padding-free) batches — ``position_ids`` restarting per sample, or the flash-style
``cu_seq_lens_q/k`` + ``max_length_q/k`` that ``DataCollatorWithFlattening`` makes — transformers'
``sdpa`` and ``eager`` paths attend across samples whenever a cache object exists (the default
``use_cache=True``): their mask only sees packing when ``past_key_values is None``. This
implementation builds the block-diagonal causal mask from the packing kwargs itself and then runs
transformers' own ``sdpa_attention_forward``; unpacked calls go straight to it. When the caller asks
for attention weights (``output_attentions=True``) it runs the model's own ``eager_attention_forward``
instead, with the same mask as a float bias, and returns the weights as ``eager`` does.

On CUDA, a packed fp16 / bf16 call with no mask tensor (transformers' plain causal ``None``), no
weights, softcap or sinks runs one varlen kernel over the whole pack instead of a masked SDPA
(``twinkle_kernels.packed_attention``: flash-attn's or torch's ``varlen_attn``, whichever
:func:`~twinkle_kernels.packed_attention.select_packed_attention` picks); in eager mode only (the
boundaries are data). Everything else, and every CPU call, takes the mask path.

Which path a call takes is decided from what is static at trace time wherever possible: whether the
caller passed ``cu_seq_lens_q`` (always packed), whether it passed ``position_ids`` of the query's
length (possibly packed), whether keys are longer than queries (decoding: never packed) and whether
weights were asked for. Only "do these ``position_ids`` restart?" depends on data. In eager mode that
is a Python ``if``, decided once per ``position_ids`` tensor (every layer of a forward passes the
same one; an in-place change is seen through its version), and an unpacked batch then runs exactly
transformers' call. Under ``torch.compile`` the graph always takes the packed path, whose
block-diagonal mask is plain causal when no position restarts, so ``fullgraph=True`` traces one
graph that serves packed and unpacked batches of a shape without a graph break or a recompile.

Padding is never taken for packing. A batch is packed only when the caller says so
(``cu_seq_lens_q``) or when its ``position_ids`` restart at 0 inside a row and the mask marks no
padding. When the mask transformers built marks padding (a token that may not attend to itself), the
mask alone decides what each token sees and transformers' own call runs, however the positions repeat
(``(attention_mask.cumsum(-1) - 1).clamp(min=0)`` repeats one across mid-row padding). Position ids
that restart at 0 after a real token of a padded row are refused (``ValueError`` naming both): packed
rows with padding are not a layout either path can honour.

A patched family keeps the implementation its user chose. Its modeling module gets its own attention
interface (:func:`family_interface`; transformers' documented way to override an implementation for
one model file) whose ``sdpa`` and ``eager`` are packing-aware: ``config._attn_implementation``,
``output_attentions`` (``eager`` returns weights, ``sdpa`` does not, as unpatched) and
``set_attn_implementation`` behave as without the patch, and only packed calls differ. The global
``sdpa`` entry is never replaced. The same function is also registered under its own name
(:data:`NAME`) for a model that asks for it explicitly (``attn_implementation="twinkle_packed"``).
"""
from __future__ import annotations

import sys
import weakref
from typing import Callable, Optional

import torch

from twinkle_kernels.patching import Patcher

NAME = "twinkle_packed"


def _cu_segment_ids(cu: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """[1, S] sample index of each token from flash-style cumulative lengths ``cu`` [N + 1]."""
    B, S = query.shape[0], query.shape[2]
    if B != 1:
        raise ValueError(f"cu_seq_lens_q needs a packed batch of size 1; got batch {B}")
    cu = cu.to(device=query.device, dtype=torch.long)
    msg = f"cu_seq_lens_q[-1] must be the packed length {S}"
    if torch.compiler.is_compiling():
        torch._assert_async(cu[-1] == S, msg)  # traced as an op: the value is not known at trace time
    elif int(cu[-1]) != S:
        raise ValueError(f"{msg}; got cu_seq_lens_q[-1]={int(cu[-1])}")
    return torch.searchsorted(cu[1:], torch.arange(S, device=query.device), right=True)[None]


def _position_segment_ids(pos: torch.Tensor, B: int, S: int, device) -> torch.Tensor:
    """[B, S] sample index of each token: a new sample starts wherever the position restarts at 0.
    A repeated or skipped position is not a boundary: ``(mask.cumsum(-1) - 1).clamp(min=0)``, what
    generate and many collators pass with padding, repeats a position across mid-row padding, and
    those tokens belong to one sample."""
    pos = pos.to(device).expand(B, S)
    first = torch.zeros_like(pos, dtype=torch.bool)
    first[:, 0] = True
    return ((pos == 0) & ~first).cumsum(-1)


# The last eager call's segments: (weakref to its position_ids, their version, (B, S, device), seg,
# whether any row restarts). Every layer of one forward passes the same position_ids tensor, so the
# segments and the device-to-host sync that reads "do they restart?" happen once per forward, not
# once per layer. An in-place change of the tensor bumps its version; a new tensor fails the identity.
_LAST_SEGMENTS = None


def _eager_segments(pos: torch.Tensor, B: int, S: int, device):
    """(:func:`_position_segment_ids`, whether any row restarts at 0) for eager calls, cached per tensor."""
    global _LAST_SEGMENTS
    hit = _LAST_SEGMENTS
    if hit is not None and hit[0]() is pos and hit[1] == pos._version and hit[2] == (B, S, device):
        return hit[3], hit[4]
    seg = _position_segment_ids(pos, B, S, device)
    restarts = bool((seg[:, -1] != 0).any())
    _LAST_SEGMENTS = (weakref.ref(pos), pos._version, (B, S, device), seg, restarts)
    return seg, restarts


def _real_tokens(attention_mask, S: int) -> Optional[torch.Tensor]:
    """[B, S] bool, True where a token may attend to itself in transformers' mask (a real token), or
    None when the mask marks no padding. Every real token sees itself under a causal (or sliding
    window) mask, so a False diagonal is exactly a padding token."""
    if attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[-1] < S:
        return None
    diag = torch.diagonal(attention_mask[..., :S, :S], dim1=-2, dim2=-1)[:, 0]
    real = diag if diag.dtype == torch.bool else diag == 0
    return None if bool(real.all()) else real


def _check_padding_positions(real: torch.Tensor, pos: torch.Tensor, B: int, S: int) -> None:
    """A padding mask with position ids that restart at 0 after a real token of the same row mixes
    packing and padding: transformers would attend across those samples, the packed path would
    ignore the mask's rows, so neither is what the caller meant. Refused, naming both."""
    pos = pos.to(real.device).expand(B, S)
    earlier = (real.long().cumsum(-1) - real.long()) > 0
    bad = real & (pos == 0) & earlier
    if bool(bad.any()):
        b, t = (int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(
            f"attention_mask and position_ids disagree: attention_mask pads row {b}, and position_ids restart at 0 "
            f"at token {t} after real tokens of that row (a packed row with padding). Pass packed rows without "
            "attention_mask (position_ids restarting at 0, or cu_seq_lens_q), or padded rows with position_ids "
            "that do not restart inside a sample, e.g. (attention_mask.cumsum(-1) - 1).clamp(min=0)")


def _allowed(seg: torch.Tensor, attention_mask, S: int, sliding_window) -> torch.Tensor:
    """[B, 1, S, S] bool, True = attend: same sample, causal, inside the window, and allowed by the
    mask transformers built (bool True = attend, or a float bias with 0 = attend)."""
    i = torch.arange(S, device=seg.device)
    allowed = (seg[:, :, None] == seg[:, None, :]) & (i[:, None] >= i[None, :])
    if sliding_window:
        allowed = allowed & ((i[:, None] - i[None, :]) < sliding_window)
    allowed = allowed[:, None]
    if attention_mask is not None:
        m = attention_mask[..., :S]
        allowed = allowed & (m if m.dtype == torch.bool else m == 0)
    return allowed


def _eager_forward(module) -> Callable:
    """The ``eager_attention_forward`` of the module's own modeling file (models differ: sinks,
    softcapping), else Llama's."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as fn
    return fn


def _as_bias(mask, query, key) -> Optional[torch.Tensor]:
    """The mask ``eager_attention_forward`` expects (float, 0 = attend, dtype minimum = masked), as
    transformers' ``eager_mask`` makes it. ``None`` from ``sdpa_mask`` means plain causal (queries
    are the last ``q`` of ``kv`` positions), which eager needs spelled out."""
    if mask is not None and mask.dtype != torch.bool:
        return mask
    if mask is None:
        q, kv = query.shape[2], key.shape[2]
        if q == 1:
            return None
        i = torch.arange(q, device=query.device)[:, None] + (kv - q)
        mask = (i >= torch.arange(kv, device=query.device)[None, :])[None, None]
    return torch.where(mask, torch.zeros((), device=mask.device, dtype=query.dtype), torch.finfo(query.dtype).min)


def packed_sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                  sliding_window=None, **kwargs):
    """The :data:`NAME` implementation (a model asks for it by name): q [B, H, S, D], k/v [B, Hkv, S, D]
    -> (out [B, S, H, D], weights).

    A packed batch gets a block-diagonal causal mask (and the sliding window, when the layer has one)
    combined with the mask transformers built; everything else is ``sdpa_attention_forward``. weights
    are ``None`` (as ``sdpa``) unless ``output_attentions=True`` is in the call, when the model's
    ``eager_attention_forward`` runs and its weights [B, H, S, S_kv] come back.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    eager = _eager_forward(module) if kwargs.get("output_attentions", False) else None

    def plain(q, k, v):
        if eager is not None:
            return eager(module, q, k, v, _as_bias(attention_mask, q, k), dropout=dropout, scaling=scaling,
                         sliding_window=sliding_window, **kwargs)
        return sdpa_attention_forward(module, q, k, v, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)[0], None

    return _packing_aware(module, query, key, value, attention_mask, dropout, scaling, sliding_window, kwargs,
                          plain, eager)


def family_forwards(base, eager_original):
    """The packing-aware ``sdpa`` and ``eager`` of one modeling module, for its own attention interface
    (:class:`FamilyAttention`): a model keeps the implementation its user chose, and only packed calls
    differ from transformers' (each gets its block-diagonal mask).

    ``base``: the interface the module had (transformers' global one); ``sdpa`` is looked up in it at
    call time, so a later ``AttentionInterface.register("sdpa", ...)`` still serves unpacked calls.
    ``eager_original``: the module's own ``eager_attention_forward``. Unpacked calls, decoding and
    non-causal layers (a vision tower's) run the original with the caller's arguments untouched;
    ``sdpa`` never returns weights (as transformers' does not), ``eager`` always does.
    """

    def sdpa(module, query, key, value, attention_mask, *args, **kwargs):
        def plain(q, k, v, mask=attention_mask):   # also the packed call, with the block-diagonal mask
            return base["sdpa"](module, q, k, v, mask, *args, **kwargs)

        if args:  # positional extras: not a call shape this module's code makes; leave it alone
            return plain(query, key, value)
        return _packing_aware(module, query, key, value, attention_mask, kwargs.get("dropout", 0.0),
                              kwargs.get("scaling"), kwargs.get("sliding_window"), kwargs, plain, None,
                              packed_sdpa=plain)

    def eager(module, query, key, value, attention_mask, *args, **kwargs):
        def plain(q, k, v):
            return eager_original(module, q, k, v, attention_mask, *args, **kwargs)

        if args:
            return plain(query, key, value)
        return _packing_aware(module, query, key, value, attention_mask, kwargs.get("dropout", 0.0),
                              kwargs.get("scaling"), kwargs.get("sliding_window"), kwargs, plain, eager_original)

    return sdpa, eager


def _packing_aware(module, query, key, value, attention_mask, dropout, scaling, sliding_window, kwargs,
                   plain, eager, packed_sdpa=None):
    """One attention call: ``plain(q, k, v)`` (the caller's own implementation, mask as given) unless
    the batch is packed; then the block-diagonal causal mask runs through ``eager`` (returns weights)
    when given, else through SDPA (``packed_sdpa(q, k, v, mask)`` or transformers' own), or one varlen
    kernel on CUDA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, S = query.shape[0], query.shape[2]
    call_kw = {k: v for k, v in kwargs.items() if k not in ("dropout", "scaling", "sliding_window")}

    def packed(q, k, v, seg):
        allowed = _allowed(seg, attention_mask, S, sliding_window)
        if eager is not None:  # a fully masked row softmaxes to uniform weights, as in transformers' eager
            return eager(module, q, k, v, _as_bias(allowed, q, k), dropout=dropout, scaling=scaling,
                         sliding_window=sliding_window, **call_kw)
        if attention_mask is not None:
            # a row masked out entirely (padding inside a packed batch) would give NaN: let it see itself
            eye = torch.eye(S, dtype=torch.bool, device=q.device)
            allowed = allowed | (~allowed.any(-1, keepdim=True) & eye)
        if packed_sdpa is not None:
            return packed_sdpa(q, k, v, allowed)[0], None
        return sdpa_attention_forward(module, q, k, v, allowed, dropout=dropout, scaling=scaling,
                                      **call_kw)[0], None

    if key.shape[2] != S:  # decoding against a cache: packing is a training-time layout
        return plain(query, key, value)
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        return plain(query, key, value)  # bidirectional (a vision tower's blocks): no causal mask to split
    varlen = _varlen_choice(module, query, key, value, attention_mask, dropout, sliding_window,
                            eager is not None, kwargs)
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:  # the caller says the batch is packed
        if varlen is not None:
            return _varlen_forward(query, key, value, _cu_checked(cu, query), scaling, sliding_window, dropout,
                                   varlen), None
        return packed(query, key, value, _cu_segment_ids(cu, query))
    pos = kwargs.get("position_ids")
    if pos is None or pos.dim() != 2 or pos.shape[-1] != S:
        return plain(query, key, value)
    if not torch.compiler.is_compiling():
        # With padding, sample boundaries come from the mask (transformers built it from the caller's
        # attention_mask): the row is one sample, whatever its positions repeat; transformers' own
        # path runs it, exactly as unpatched.
        real = _real_tokens(attention_mask, S)
        if real is not None:
            _check_padding_positions(real, pos, B, S)
            return plain(query, key, value)
        seg, restarts = _eager_segments(pos, B, S, query.device)
        if not restarts:
            return plain(query, key, value)
        if varlen is not None:
            return _varlen_forward(query, key, value, _segment_bounds(seg), scaling, sliding_window, dropout,
                                   varlen), None
        return packed(query, key, value, seg)
    # Traced: "do the positions restart?" is data, and a traced graph cannot branch on it without a
    # break or a guard, so it always takes the packed path, whose mask is plain causal when they do not
    # (transformers' own find_packed_sequence_indices does the same while tracing). torch.cond between
    # the two paths does not trace here: with the DynamicCache that transformers creates inside the
    # forward (use_cache=True), torch 2.13's dynamo loses the cache layers' state while it speculates
    # the branches (AttributeError: 'DynamicLayer' object has no attribute 'dtype').
    return packed(query, key, value, _position_segment_ids(pos, B, S, query.device))


def _varlen_choice(module, query, key, value, attention_mask, dropout, sliding_window, weights,
                   kwargs) -> Optional[str]:
    """The varlen kernel a packed call runs on (CUDA, eager, plain causal attention with no mask
    tensor, softcap or sinks, fp16 / bf16), else None: the mask path below serves it."""
    if (query.device.type != "cuda" or weights or attention_mask is not None or torch.compiler.is_compiling()
            or not getattr(module, "is_causal", True)
            or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None):
        return None
    from twinkle_kernels.packed_attention import select_packed_attention
    choice = select_packed_attention(query.device, query.dtype, query.shape[-1], query.shape[1], key.shape[1],
                                     head_dim_v=value.shape[-1], window=sliding_window or None,
                                     dropout=dropout)
    return None if choice.impl == "sdpa_loop" else choice.impl


def _cu_checked(cu: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """``cu_seq_lens_q`` checked against the packed length (as :func:`_cu_segment_ids`)."""
    _cu_segment_ids(cu, query)
    return cu


def _segment_bounds(seg: torch.Tensor) -> torch.Tensor:
    """int32 ``[N + 1]`` boundaries of the samples of ``seg`` [B, S] (sample ids per row) with the
    B rows laid end to end: a row starts a new sample too."""
    B, S = seg.shape
    flat = (seg + torch.arange(B, device=seg.device)[:, None] * S).reshape(-1)
    starts = torch.nonzero(flat[1:] != flat[:-1]).flatten() + 1
    ends = starts.new_tensor([0, B * S])
    return torch.cat([ends[:1], starts, ends[1:]]).to(torch.int32)


def _varlen_forward(query, key, value, cu, scaling, sliding_window, dropout, impl) -> torch.Tensor:
    """q [B, H, S, D], k/v [B, Hkv, S, D] -> [B, S, H, D] by one varlen kernel over the B * S tokens."""
    from twinkle_kernels.packed_attention import packed_attention
    B, H, S = query.shape[:3]
    q, k, v = (t.transpose(1, 2).reshape(B * S, t.shape[1], t.shape[3]) for t in (query, key, value))
    out = packed_attention(q, k, v, cu, scale=scaling, window=sliding_window or None, dropout=dropout, impl=impl)
    return out.view(B, S, H, value.shape[-1])


def family_interface(base, eager_original):
    """A modeling module's own attention interface (transformers' documented way to override an
    implementation for one model file: an ``AttentionInterface`` instance in ``modeling_<model>.py``).
    ``sdpa`` and ``eager`` are the packing-aware ones of :func:`family_forwards`; every other name
    (flash, flex, ``twinkle_packed``, ...) is looked up in ``base``, the module's interface before."""
    from transformers.modeling_utils import AttentionInterface

    class FamilyAttention(AttentionInterface):
        def __init__(self):
            super().__init__()
            sdpa, eager = family_forwards(base, eager_original)
            self._local_mapping.update(sdpa=sdpa, eager=eager)
            self._twinkle_base = base

        def __getitem__(self, key):
            if key in self._local_mapping:
                return self._local_mapping[key]
            return base[key]

        def __iter__(self):
            return iter(dict.fromkeys([*base, *self._local_mapping]))

        def __len__(self):
            return len(set(base) | set(self._local_mapping))

    return FamilyAttention()


def register_named(name: str, forward) -> Optional[Callable[[], None]]:
    """Add ``forward`` to transformers' attention interface under ``name``, with transformers'
    ``sdpa_mask`` (boolean, True = attend, or None for plain causal) as its mask. Returns the undo,
    or None when ``name`` was registered already. The global ``sdpa`` entry is never touched."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    if name in AttentionInterface._global_mapping:
        return None
    swaps = Patcher()
    swaps.setitem(AttentionInterface._global_mapping, name, forward)
    swaps.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, name, sdpa_mask)
    return swaps.undo


def register() -> Optional[Callable[[], None]]:
    """Adds :data:`NAME` to transformers' attention and mask interfaces; returns the undo (or None
    if it was there already)."""
    return register_named(NAME, packed_sdpa_attention_forward)
