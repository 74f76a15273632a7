"""Checks that turn bad input into clear errors before any collective starts.

A rank that raises on its own while its peers enter a collective leaves them waiting (until the
process-group timeout at best). So the checks here are split in two: local checks that return a
message (or None), and :func:`agree`, one small collective after which every rank raises together,
naming the rank that failed and why.
"""
from __future__ import annotations

import json
from typing import Dict, Optional

import torch
import torch.distributed as dist

IGNORE_INDEX = -100

# the fields of a config.json that must be positive integers for a model to exist
_POSITIVE_FIELDS = (("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
                    ("num_layers", "num_hidden_layers"), ("num_heads", "num_attention_heads"),
                    ("num_kv_heads", "num_key_value_heads"), ("head_dim", "head_dim"),
                    ("intermediate_size", "intermediate_size"),
                    ("max_position_embeddings", "max_position_embeddings"))


class InputMismatchError(ValueError):
    """Ranks that must see the same batch (the TP / CP / PP ranks of one data-parallel replica)
    were given different shapes or values: of ``inputs``, or of the loss arguments and
    ``routed_experts`` (compared by checksum, :func:`argument_checksums`). Raised on every rank."""


def read_json(path: str, what: str):
    """``json.load`` that names the file when it is truncated or not JSON (``what``: the argument
    or role of the file, for the message)."""
    with open(path) as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: {path!r} is not valid JSON ({len(text)} bytes; truncated or "
                         f"corrupted?): {e}") from None


def check_model_shape(shape) -> None:
    """Refuse configs that describe no model (``num_hidden_layers=0``, a negative vocab size, ...),
    naming the config.json field."""
    for attr, field in _POSITIVE_FIELDS:
        value = getattr(shape, attr)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"config {field}={value!r} must be a positive integer")
    if shape.num_experts and shape.moe_topk < 1:
        raise ValueError(f"config num_experts_per_tok={shape.moe_topk!r} must be >= 1 for a "
                         "mixture-of-experts model")


def check_micro_batch_size(micro_batch_size, batch_size: int) -> Optional[str]:
    if micro_batch_size is None:
        return None
    if not isinstance(micro_batch_size, int) or isinstance(micro_batch_size, bool) or micro_batch_size < 1:
        return f"micro_batch_size must be None or a positive int, got {micro_batch_size!r}"
    if batch_size % micro_batch_size:
        return f"batch size {batch_size} is not divisible by micro_batch_size={micro_batch_size}"
    return None


def check_batch(batch: Dict[str, torch.Tensor], vocab_size: int) -> Optional[str]:
    """Local checks of a normalised batch (dict of [B, S] tensors): integer ids in
    ``[0, vocab_size)``, labels in ``[0, vocab_size)`` or -100, no empty batch or sequence.
    Returns the first problem as a message naming the argument, or None."""
    ids = batch["input_ids"]
    b, s = ids.shape
    if b == 0 or s == 0:
        return f"inputs['input_ids'] is empty (shape {tuple(ids.shape)}): need at least one row of at least one token"
    for key in ("input_ids", "labels", "position_ids"):
        t = batch.get(key)
        if t is None:
            continue
        if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
            return f"inputs[{key!r}] must hold integers, got dtype {t.dtype}"
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        return f"inputs['input_ids'] holds {bad}, outside the vocabulary [0, {vocab_size})"
    labels = batch.get("labels")
    if labels is not None:
        wrong = ((labels < 0) & (labels != IGNORE_INDEX)) | (labels >= vocab_size)
        if bool(wrong.any()):
            bad = int(labels[wrong].reshape(-1)[0])
            return (f"inputs['labels'] holds {bad}: labels must be in [0, {vocab_size}) or "
                    f"{IGNORE_INDEX} (ignored)")
    pos = batch.get("position_ids")
    if pos is not None and int(pos.min()) < 0:
        return f"inputs['position_ids'] holds {int(pos.min())}: positions must be >= 0"
    mask = batch.get("attention_mask")
    if mask is not None and mask.dtype != torch.bool and ((mask != 0) & (mask != 1)).any():
        return "inputs['attention_mask'] must hold only 0 and 1 (or be bool)"
    return None


def _checksum(t: Optional[torch.Tensor]) -> int:
    """A cheap position-weighted sum (int64, wrapping): equal tensors give equal sums, and a
    moved or changed value almost surely changes it."""
    if t is None:
        return 0
    if t.is_floating_point() or t.is_complex():
        t = t != 0
    flat = t.reshape(-1).to(torch.int64)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.int64) * 2654435761 + 97
    return int((flat.cpu() * weights).sum())


_CHUNK = 1 << 22    # elements per step of argument_checksums (bounds its temporary memory)


def _bits_checksum(t: torch.Tensor) -> int:
    """A position-weighted sum (int64, wrapping) of the bit patterns of ``t``'s elements: equal
    tensors (same dtype, shape and bits) give equal sums; any changed or moved value almost surely
    changes it. Computed ``_CHUNK`` elements at a time."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    flat = t.reshape(-1).contiguous()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    flat = flat.view(ints)
    # (not hash(): str hashes differ between processes)
    total = len(flat) * 1000003 + 7919 * sum(map(ord, str(t.dtype))) + sum(
        (i + 1) * 104729 * n for i, n in enumerate(t.shape))
    for at in range(0, len(flat), _CHUNK):
        part = flat[at:at + _CHUNK].to(torch.int64).cpu()
        weights = torch.arange(at + 1, at + len(part) + 1, dtype=torch.int64) * 2654435761 + 97
        total += int((part * weights).sum())
    return ((total + 2 ** 63) % 2 ** 64) - 2 ** 63


def argument_checksums(value, path: str = "") -> Dict[str, int]:
    """``{name: checksum}`` of every tensor in ``value`` (the checked loss arguments and
    ``routed_experts`` of a call: nested dicts, tuples and lists), named by their dict keys (a
    tensor outside any dict: ``routed_experts``)."""
    out = {}
    if torch.is_tensor(value):
        out[path or "routed_experts"] = _bits_checksum(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            out.update(argument_checksums(v, f"{path}.{k}" if path else str(k)))
    elif isinstance(value, (tuple, list)):
        for v in value:
            out.update(argument_checksums(v, path))
    return out


def _combine(checksums: Dict[str, int]) -> int:
    total = 0
    for name, c in sorted(checksums.items()):
        total = (total * 1000003 + sum(map(ord, name)) * 7919 + c) % 2 ** 61
    return total


_FIELDS = ("dp_rank", "batch", "seq", "micro_batches", "input_ids", "labels", "position_ids",
           "attention_mask", "loss arguments")


def agree_on_inputs(batch: Optional[Dict[str, torch.Tensor]], micro_batch_size, vocab_size: int, *,
                    dp_rank: int, same_micro_batches: bool, group=None,
                    error: Optional[BaseException] = None, arguments: Optional[Dict[str, int]] = None) -> None:
    """Validate this rank's batch and check, in one small all-gather over ``group`` (all ranks),
    that every rank of one data-parallel replica got the same shapes and values (checksums).
    ``same_micro_batches``: all ranks must also run the same number of micro-batches (expert
    parallelism exchanges tokens across replicas per micro-batch). ``error``: this rank already
    failed to build its batch (``batch`` is then None). ``arguments``: ``{name: checksum}`` of
    the call's checked loss arguments and ``routed_experts`` (:func:`argument_checksums`), which
    the ranks of a replica must also agree on (the TP / CP / PP ranks compute one loss from them);
    a mismatch names the arguments that differ. Raises on every rank (:class:`InputMismatchError`
    for a mismatch)."""
    if error is None:
        error = check_batch(batch, vocab_size)
        if error is None:
            error = check_micro_batch_size(micro_batch_size, len(batch["input_ids"]))
    if not dist.is_initialized():
        if error is not None:
            raise error if isinstance(error, BaseException) else ValueError(error)
        return
    if error is None:
        ids = batch["input_ids"]
        b, s = ids.shape
        mine = [0, dp_rank, b, s, b // (micro_batch_size or b), _checksum(ids),
                _checksum(batch.get("labels")), _checksum(batch.get("position_ids")),
                _checksum(batch.get("attention_mask")), _combine(arguments or {})]
    else:
        mine = [1, dp_rank] + [0] * 8
    world, device = dist.get_world_size(group), _group_device(group)
    local = torch.tensor(mine, dtype=torch.int64, device=device)
    table = torch.zeros(world * len(mine), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(table, local, group=group)
    rows = table.view(world, len(mine)).cpu().tolist()
    if any(r[0] for r in rows):
        agree(error, "its inputs", group=group, known_failed=True, peer_error=ValueError)
    first = {}   # dp replica -> (rank, row) of its lowest rank
    for r, row in enumerate(rows):
        ref_rank, ref = first.setdefault(row[1], (r, row))
        diff = [f for f, x, y in zip(_FIELDS[1:], ref[2:], row[2:]) if x != y]
        if diff == ["loss arguments"]:
            # every rank sees the same table, so every rank takes this second exchange
            tables = [None] * world
            dist.all_gather_object(tables, dict(arguments or {}), group=group)
            a, b_ = tables[ref_rank], tables[r]
            names = sorted(n for n in set(a) | set(b_) if a.get(n) != b_.get(n))
            raise InputMismatchError(
                f"ranks {ref_rank} and {r} are in data-parallel replica {row[1]} and must be given the "
                f"same loss arguments, but differ in {', '.join(names)} (the tensor-, context- and "
                f"pipeline-parallel ranks of a replica compute one loss from them; this is rank "
                f"{dist.get_rank(group)})")
        if diff:
            raise InputMismatchError(
                f"ranks {ref_rank} and {r} are in data-parallel replica {row[1]} and must be given "
                f"the same inputs, but differ in {', '.join(diff)} (input_ids shapes "
                f"[{ref[2]}, {ref[3]}] and [{row[2]}, {row[3]}]; this is rank {dist.get_rank(group)})")
    if same_micro_batches and len({r[4] for r in rows}) > 1:
        raise InputMismatchError(
            "with expert parallelism every rank must run the same number of micro-batches, got "
            + ", ".join(f"rank {r}: {row[4]}" for r, row in enumerate(rows)))


def agree(error, what: str, *, group=None, known_failed: bool = False,
          peer_error=RuntimeError) -> None:
    """Collective: every rank passes its own failure (an exception, a message, or None). If any rank
    failed, every rank raises: the failing rank its own error, the others ``peer_error`` naming
    the failing rank and its message. ``known_failed``: the caller already knows some rank failed
    (skips the cheap flag exchange)."""
    if not dist.is_initialized():
        if error is not None:
            raise error if isinstance(error, BaseException) else ValueError(error)
        return
    if not known_failed:
        flag = torch.tensor([int(error is not None)], dtype=torch.int64,
                            device=_group_device(group))
        dist.all_reduce(flag, group=group)
        if not int(flag):
            return
    text = None if error is None else (f"{type(error).__name__}: {error}"
                                       if isinstance(error, BaseException) else str(error))
    texts = [None] * dist.get_world_size(group)
    dist.all_gather_object(texts, text, group=group)
    if error is not None:
        raise error if isinstance(error, BaseException) else ValueError(error)
    failed = [(r, t) for r, t in enumerate(texts) if t is not None]
    raise peer_error(f"rank {failed[0][0]} refused {what}: {failed[0][1]}"
                       + (f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else ""))


def _group_device(group) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "hccl":
        return torch.device("npu", torch.npu.current_device())
    return torch.device("cpu")

