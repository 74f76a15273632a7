"""From the user's ``inputs`` to megatron's micro-batches.

``to_batch`` normalises what :meth:`MegatronModel.forward_backward` accepts (a dict of [B, S]
tensors or a list of samples) to a dict of [B, S] tensors; ``micro_batches`` cuts it into the
micro-batch dicts the pipeline schedule feeds the model and the loss (HF label shift, padding for
SP / CP, CP's load-balanced chunks, packed rows as THD with ``PackedSeqParams``)."""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Sequence, Tuple

import torch

from .. import packing
from ..layers.attention import cp_positions
from . import loss_step
from .layout import ContextParallel, Layout, Packed, PackedContextParallel, Rows


#: the keys ``inputs`` (or each sample of a list) may have
INPUT_KEYS = ("input_ids", "labels", "position_ids", "attention_mask")
# what packs samples into a row here: position_ids restarting at 0 (twinkle_megatron.packing)
_PACKING = {"cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens_q", "cu_seqlens_kv", "packed_seq_params",
            "max_length_q", "max_length_k", "max_seqlen"}


def check_keys(keys, where: str = "inputs") -> None:
    """ValueError naming the first key of ``keys`` that is not one of :data:`INPUT_KEYS`, with
    the accepted ones and the closest of them; packing keys (``cu_seqlens``,
    ``packed_seq_params``, ...) are pointed at ``position_ids``."""
    import difflib
    for key in keys:
        if key in INPUT_KEYS:
            continue
        if key in _PACKING:
            raise ValueError(f"{where}[{key!r}]: packed rows are given by position_ids restarting at 0 for "
                             f"each sample (transformers' DataCollatorWithFlattening convention); the facade "
                             f"builds cu_seqlens / PackedSeqParams from them (twinkle_megatron.packing). "
                             f"Pass position_ids instead of {key!r}")
        close = difflib.get_close_matches(str(key), INPUT_KEYS, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{where} has an unknown key {key!r}{hint}; accepted keys: {list(INPUT_KEYS)} "
                         f"(loss arguments such as advantages go to forward_backward as keywords)")


def to_batch(inputs) -> Dict[str, torch.Tensor]:
    """Normalise ``inputs`` (dict of [B,S] tensors, or list of samples) to a dict of 2-D tensors.
    Samples are right-padded (input 0, labels -100). A key other than :data:`INPUT_KEYS` is a
    ValueError (:func:`check_keys`)."""
    if isinstance(inputs, dict):
        check_keys(inputs)
        batch = {k: torch.as_tensor(v) for k, v in inputs.items() if v is not None}
    elif isinstance(inputs, Sequence) and inputs and isinstance(inputs[0], dict):
        for i, sample in enumerate(inputs):
            if not isinstance(sample, dict):
                raise TypeError(f"inputs[{i}] must be a dict like inputs[0], got {type(sample).__name__}")
            check_keys(sample, f"inputs[{i}]")
            if set(sample) != set(inputs[0]):
                raise ValueError(f"inputs[{i}] has keys {sorted(sample)}, inputs[0] has {sorted(inputs[0])}: "
                                 "every sample must have the same keys")
        if any("input_ids" not in sample for sample in inputs):
            raise ValueError("every sample of inputs needs 'input_ids' and 'labels'")
        longest = max(len(s["input_ids"]) for s in inputs)
        batch = {}
        for key, pad in (("input_ids", 0), ("labels", -100), ("position_ids", 0), ("attention_mask", 0)):
            if key not in inputs[0]:
                continue
            rows = []
            for i, s in enumerate(inputs):
                if key not in s:
                    raise ValueError(f"inputs[{i}] has no {key!r} (inputs[0] has one)")
                t = torch.as_tensor(s[key]).reshape(-1)
                if len(t) != len(s["input_ids"]):
                    raise ValueError(f"inputs[{i}][{key!r}] has length {len(t)}, input_ids has "
                                     f"{len(s['input_ids'])}")
                rows.append(torch.cat([t, t.new_full((longest - len(t),), pad)]))
            batch[key] = torch.stack(rows)
    else:
        raise TypeError(f"inputs must be a dict of tensors or a non-empty list of samples, got {type(inputs).__name__}")
    if "input_ids" not in batch or "labels" not in batch:
        raise ValueError(f"inputs needs 'input_ids' and 'labels', got keys {sorted(batch)}")
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise ValueError(f"inputs['input_ids'] must be [B, S], got shape {tuple(ids.shape)}")
    for key in ("labels", "position_ids", "attention_mask"):
        if key in batch and batch[key].shape != ids.shape:
            raise ValueError(f"inputs[{key!r}] has shape {tuple(batch[key].shape)}, "
                             f"input_ids has {tuple(ids.shape)}: they must match")
    return batch


def user_labels(batch, ignore: int = -100) -> torch.Tensor:
    """labels [B, S] with the loss's ignore_index and the attention mask's padding as -100."""
    labels = batch["labels"].long()
    if ignore != -100:
        labels = labels.masked_fill(labels == ignore, -100)
    mask = batch.get("attention_mask")
    if mask is not None:
        mask = mask.bool()
        if (mask[:, 1:] & ~mask[:, :-1]).any():
            # Causal attention already keeps real tokens from seeing right padding; anything
            # else (left padding, arbitrary masks) would need a mask megatron's attention
            # does not take. Packed samples are given by position_ids instead.
            raise NotImplementedError("attention_mask must be right padding (1s then 0s per row); "
                                      "pack samples with position_ids restarting at 0")
        labels = labels.masked_fill(~mask, -100)
    return labels


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch of a call: ``mbs`` rows of the user's batch, as this rank's model gets them
    and as the loss reads them back (:attr:`layout`, :mod:`.layout`).

    The model's inputs, this rank's tokens in the layout's order: ``input_ids`` / ``position_ids``
    [rows_model, S_model] int64, ``labels`` [rows_model, S_model] int64 (shifted: position t holds
    the label of t + 1; -100 none), ``padding_mask`` [rows_model, S_model] bool (True: no real
    token; megatron's MoE convention), ``packed_seq_params`` (packed rows: megatron's THD
    ``PackedSeqParams``, else None). The rows, whole on every CP rank: ``loss_labels`` [mbs, S]
    int64 (shifted), ``extras`` the loss arguments {name: [mbs, S] or [mbs, S, k]} (shifted like
    the labels), ``segments`` [mbs, S] int64 and ``num_segments`` (the sequences: rows, or packed
    samples), ``row_length`` (the user's S, before SP / CP padding). Set by the call's plan
    (:func:`.call.plan`): ``row_groups`` [mbs] int64 / ``adapter_groups`` (the group of each row /
    of each model token, several groups only), ``student_topk`` (the arguments at whose ids the
    student's logits are computed), ``routed_experts`` [mbs, S, L_moe, k] int64 (the ids replayed,
    :mod:`.router_replay`)."""
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    padding_mask: torch.Tensor
    loss_labels: torch.Tensor
    extras: Dict[str, torch.Tensor]
    segments: torch.Tensor
    num_segments: int
    layout: Layout
    row_length: int
    packed_seq_params: object = None
    row_groups: Optional[torch.Tensor] = None
    adapter_groups: Optional[torch.Tensor] = None
    student_topk: Tuple[str, ...] = ()
    routed_experts: Optional[torch.Tensor] = None

    @property
    def rows(self) -> int:
        """The user's rows in this micro-batch (a packed THD row holds several)."""
        return self.loss_labels.shape[0]


def micro_batches(mesh, device, batch, micro_batch_size, args=None, ignore_index: int = -100):
    """``(list of MicroBatch, micro-batch size as megatron counts it, sequence length)`` for the
    schedule: the model's inputs for this rank and the rows' full internal layout for the loss
    (:class:`MicroBatch`). ``args``: per-token loss arguments, [B, S] (or [B, S, k]) user layout,
    kept in their dtype."""
    ids = batch["input_ids"].long()
    labels = user_labels(batch, ignore_index)
    b, s = ids.shape
    pos = batch.get("position_ids")
    mask = batch.get("attention_mask")
    mbs = micro_batch_size or b
    if b % mbs:
        raise ValueError(f"batch size {b} is not divisible by micro_batch_size={mbs}")
    # HF convention: the token at t predicts labels[t + 1] (within its row).
    shifted = loss_step.shift_like_labels(labels, fill=-100)
    args = {k: loss_step.shift_like_labels(v) for k, v in (args or {}).items()}
    if packing.is_packed(pos):
        return packed_micro_batches(mesh, device, ids, shifted, pos, mask, mbs, args)
    cp = mesh.cp_size
    # Sequence splits: SP needs the per-CP-rank length divisible by tp, CP needs 2*cp chunks.
    multiple = (2 * cp if cp > 1 else 1) * (mesh.tp_size if mesh.sequence_parallel else 1)
    pad = (-s) % multiple
    shifted = torch.cat([shifted, labels.new_full((b, pad), -100)], 1)
    ids = torch.cat([ids, ids.new_zeros((b, pad))], 1)
    args = {k: torch.cat([v, v.new_zeros((b, pad, *v.shape[2:]))], 1) for k, v in args.items()}
    pos = torch.arange(s + pad).expand(b, -1)
    # True at the tokens transformers leaves out of the MoE aux loss (attention_mask 0) and at
    # this padding: megatron's padding_mask convention
    padding = _padding(mask, b, s, pad)
    layout, keep = Rows(), slice(None)
    if cp > 1:
        from megatron.core import parallel_state as ps
        rank = ps.get_context_parallel_rank()
        keeps = [cp_positions((s + pad) // cp, r, cp) for r in range(cp)]
        keep = keeps[rank]
        layout = ContextParallel(keeps, rank, ps.get_context_parallel_group())
    out = []
    dev = device
    for i in range(0, b, mbs):
        rows = slice(i, i + mbs)
        out.append(MicroBatch(
            input_ids=ids[rows][:, keep].to(dev), position_ids=pos[rows][:, keep].to(dev),
            labels=shifted[rows][:, keep].to(dev), loss_labels=shifted[rows].to(dev),
            padding_mask=padding[rows][:, keep].to(dev), extras={k: v[rows].to(dev) for k, v in args.items()},
            segments=torch.arange(mbs)[:, None].expand(mbs, s + pad).to(dev), num_segments=mbs, layout=layout,
            row_length=s))
    return out, mbs, s + pad  # the full length: megatron divides by cp (and tp with SP)


def packed_micro_batches(mesh, device, ids, shifted, pos, mask, mbs, args):
    """Packed rows (position_ids restarting at 0 per sample): each micro-batch of ``mbs`` rows
    becomes one THD row of ``mbs * S`` tokens with ``packed_seq_params``; every packed sample is
    a segment of the loss.

    Under context parallelism the THD row is padded to a multiple of ``2 * cp`` (times tp with
    SP) and split as plain rows are: CP rank r holds chunks r and ``2cp - 1 - r`` of the whole row
    (:func:`cp_positions`), the same on every layer, whatever the samples' boundaries (a sample may
    cross a chunk boundary, or lie within one). ``packed_seq_params`` keeps the row's global
    ``cu_seqlens`` (never divided by cp): the Gated DeltaNet's CP ops, the CP attention's mask and
    the RoPE positions (each token's place in its sample) all read them. The layout
    :class:`.layout.PackedContextParallel` gathers the CP ranks' tokens back into the row, then cuts
    it into [mbs, S]."""
    cp = mesh.cp_size
    b, s = ids.shape
    total = mbs * s
    multiple = (2 * cp if cp > 1 else 1) * (mesh.tp_size if mesh.sequence_parallel else 1)
    pad = (-total) % multiple
    length = total + pad
    keep, layout = slice(None), Packed((mbs, s), length)
    if cp > 1:
        from megatron.core import parallel_state as ps
        rank = ps.get_context_parallel_rank()
        keeps = [cp_positions(length // cp, r, cp) for r in range(cp)]
        keep = keeps[rank]
        layout = PackedContextParallel((mbs, s), keeps, rank, ps.get_context_parallel_group())
    out = []
    for i in range(0, b, mbs):
        rows = slice(i, i + mbs)
        cu = packing.cu_seqlens(pos[rows], None if mask is None else mask[rows])
        segments = torch.searchsorted(cu[1:].long(), torch.arange(total), right=True).reshape(mbs, s)
        padding = _padding(None if mask is None else mask[rows].reshape(1, -1), 1, total, pad)
        out.append(MicroBatch(
            input_ids=torch.cat([ids[rows].reshape(-1), ids.new_zeros(pad)])[None][:, keep].to(device),
            # (megatron's RoPE reads the positions from cu_seqlens, not from position_ids)
            position_ids=torch.arange(length)[None][:, keep].to(device),
            labels=torch.cat([shifted[rows].reshape(-1), shifted.new_full((pad,), -100)])[None][:, keep].to(device),
            padding_mask=padding[:, keep].to(device),
            packed_seq_params=packing.packed_seq_params(packing.extend(cu, length), device),
            loss_labels=shifted[rows].to(device), extras={k: v[rows].to(device) for k, v in args.items()},
            segments=segments.to(device), num_segments=len(cu) - 1, layout=layout, row_length=s))
    return out, 1, length  # the full length: megatron divides by cp (and tp with SP)


def _padding(mask, b: int, s: int, pad: int) -> torch.Tensor:
    """[b, s + pad] bool, True where ``mask`` ([b, s] or None: no padding) is 0 and in the
    ``pad`` columns appended for SP / CP."""
    real = torch.ones(b, s, dtype=torch.bool) if mask is None else torch.as_tensor(mask).bool()
    return torch.cat([~real, real.new_ones(b, pad)], 1)
