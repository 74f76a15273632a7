"""Hugging Face <-> megatron-core weight conversion, with TP / PP / EP sharding: the generic engine.

What each megatron parameter is made of is its family's name table (``layer_table`` /
``model_table`` in :mod:`twinkle_megatron.models`, vocabulary in :mod:`twinkle_megatron.models.table`);
import (:func:`load_hf_weights`) and export (:func:`export_hf_state`) read the same table, one
direction each, so they cannot drift apart. The layouts, on the local layer spec:

- ``qkv``: rows grouped per query group ``g``: ``[q heads of g, k_g, v_g] * head_dim``; TP ranks hold
  contiguous runs of whole groups (so GQA splits cleanly when kv_heads % tp == 0); ``gated_qkv``
  adds the output gate heads after the q heads of each group;
- ``sections`` (``linear_fc1`` dense and per expert: ``[gate_shard; up_shard]`` per TP rank);
- ``row`` (``linear_proj`` / ``linear_fc2``): split along the input dimension;
- ``column`` (embeddings / output layer): vocab-parallel rows;
- experts: ``mlp.experts.local_experts.{j}`` is global expert ``ep_rank * E / ep + j``, split over
  the expert-TP group like a dense MLP.

Layer indices are global (``layer.layer_number - 1``), so pipeline stages need no special case.
"""
from __future__ import annotations

import os
import re
from typing import Dict, Iterator, List, Sequence, Tuple

import torch
import torch.distributed as dist

from . import models
from .models.shape import ModelShape
from .models.table import Entry, Table
from .validate import read_json

LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")   # a chunk's layer i, the name inside it
_ADAPTER = re.compile(r"(^|\.)lora\.[^.]+\.lora_[AB]\.")   # lora.<adapter name>.lora_A...
_EXPERT = re.compile(r"^(.+\.local_experts)\.(\d+)\.(.+)$")


class HFCheckpoint:
    """Lazy reader of a safetensors checkpoint directory (single file or sharded with an index).
    ``renames``: ``(old, new)`` substrings; a stored name is also found under its renamed form."""

    def __init__(self, path: str, renames=(), *, allow_bin: bool = False):
        from safetensors import safe_open
        files, kind = weight_files(path, allow_bin=allow_bin)
        self._handles = []
        for f in files:
            full = os.path.join(path, f)
            if not os.path.isfile(full):
                raise FileNotFoundError(f"weights file {full!r} is missing (listed in the index)")
            try:
                self._handles.append(safe_open(full, framework="pt") if kind == "safetensors" else _TorchFile(full))
            except Exception as e:   # safetensors' own error type does not name the file
                raise ValueError(f"cannot read weights file {full!r} (truncated or corrupted?): {e}") from None
        self._where = {k: h for h in self._handles for k in h.keys()}
        self._stored = {k: k for k in self._where}
        for k in list(self._where):
            new = k
            for old, repl in renames:
                new = new.replace(old, repl)
            if new not in self._where:
                self._where[new], self._stored[new] = self._where[k], k

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"weight {name!r} is missing from the Hugging Face checkpoint")
        return self._where[name].get_tensor(self._stored[name])

    def get_row(self, name: str, index: int) -> torch.Tensor:
        """``get(name)[index]`` reading only that row of the file (e.g. one expert of
        transformers' fused ``[E, 2I, H]``: the whole tensor is 0.8 GB per layer for Qwen3-30B-A3B,
        and a rank reads each of its experts)."""
        if name not in self._where:
            raise KeyError(f"weight {name!r} is missing from the Hugging Face checkpoint")
        rows = self._where[name].get_slice(self._stored[name])
        count = rows.get_shape()[0]
        if not 0 <= index < count:
            raise IndexError(f"weight {name!r}: row {index} asked, it has {count}")
        return rows[index]


SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
# files that hold weights in a format this reader does not take by default (found in a model
# folder without safetensors weights, they make it an error rather than a random init)
_OTHER_WEIGHTS = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf|npz)$|.*\.bin\.index\.json$")


def other_weight_files(path: str) -> List[str]:
    """The files in ``path`` that look like weights (``pytorch_model.bin``, ``*.pt``, ``*.gguf``,
    safetensors shards without their index, ...), sorted."""
    return sorted(f for f in os.listdir(path) if _OTHER_WEIGHTS.fullmatch(f)
                  and os.path.isfile(os.path.join(path, f)))


def has_safetensors(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in ("model.safetensors", SAFETENSORS_INDEX))


def weight_files(path: str, *, allow_bin: bool = False) -> Tuple[List[str], str]:
    """``(files, "safetensors" | "bin")``: the weight files of the Hugging Face model folder
    ``path`` (``model.safetensors`` or the files of its index; with ``allow_bin`` and no
    safetensors, ``pytorch_model.bin`` or the files of its index). Otherwise FileNotFoundError
    naming the weight-like files the folder has."""
    index = os.path.join(path, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        return sorted(set(read_json(index, "safetensors index")["weight_map"].values())), "safetensors"
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return ["model.safetensors"], "safetensors"
    if allow_bin:
        index = os.path.join(path, BIN_INDEX)
        if os.path.isfile(index):
            return sorted(set(read_json(index, "pytorch_model.bin index")["weight_map"].values())), "bin"
        if os.path.isfile(os.path.join(path, "pytorch_model.bin")):
            return ["pytorch_model.bin"], "bin"
    found = other_weight_files(path) if os.path.isdir(path) else []
    hint = ""
    if any(f.startswith("pytorch_model") for f in found) and not allow_bin:
        hint = ("; to read pytorch_model.bin (unpickled with weights_only=True) pass "
                "MegatronModel(..., load_bin_weights=True), or convert it to safetensors")
    raise FileNotFoundError(f"no safetensors weights (model.safetensors or {SAFETENSORS_INDEX}) in {path!r}; "
                            f"it has {', '.join(found) if found else 'no weight files'}{hint}")


class _TorchFile:
    """A ``pytorch_model.bin`` read as safetensors' ``safe_open`` handle is (``keys``,
    ``get_tensor``, ``get_slice``): unpickled with ``weights_only=True`` (tensors and plain
    containers only, so a crafted file cannot run code), memory-mapped."""

    def __init__(self, path: str):
        import pickle
        try:
            self._tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError:
            raise ValueError(f"{path!r} holds a type a weights file never contains and is refused "
                             "(unpickled with weights_only=True)") from None
        if not isinstance(self._tensors, dict) or not all(isinstance(v, torch.Tensor) for v in self._tensors.values()):
            raise ValueError(f"{path!r} is not a state dict of tensors")

    def keys(self):
        return list(self._tensors)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def get_slice(self, name: str):
        t = self._tensors[name]

        class _Slice:
            def get_shape(self):
                return list(t.shape)

            def __getitem__(self, index):
                return t[index]
        return _Slice()


def _ranks():
    from megatron.core import parallel_state as ps
    return dict(tp=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
                ep=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
                etp=ps.get_expert_tensor_parallel_rank(),
                etp_size=ps.get_expert_tensor_parallel_world_size())


def _shard(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return t.chunk(size, dim=dim)[rank]


def _fused_qkv(shape: ModelShape, q, k, v, gate=None) -> torch.Tensor:
    """megatron's grouped ``linear_qkv`` rows from HF's q, k, v (and the output gate)."""
    groups, per = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads
    tail = q.shape[1:]
    parts = [q.reshape(groups, per, shape.head_dim, *tail)]
    if gate is not None:
        parts.append(gate.reshape(groups, per, shape.head_dim, *tail))
    parts += [k.reshape(groups, 1, shape.head_dim, *tail), v.reshape(groups, 1, shape.head_dim, *tail)]
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def _split_qkv(shape: ModelShape, qkv, gated: bool):
    """Inverse of :func:`_fused_qkv`: ``(q, k, v)`` or, ``gated``, ``(q, k, v, gate)``."""
    groups, per = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads
    tail = qkv.shape[1:]
    qkv = qkv.reshape(groups, per * (2 if gated else 1) + 2, shape.head_dim, *tail)
    q = qkv[:, :per].reshape(-1, *tail)
    k, v = qkv[:, -2].reshape(-1, *tail), qkv[:, -1].reshape(-1, *tail)
    if gated:
        return q, k, v, qkv[:, per:2 * per].reshape(-1, *tail)
    return q, k, v


def _q_and_gate(shape: ModelShape, q_proj: torch.Tensor):
    """HF ``q_proj`` rows ``[q_h, gate_h]`` per head -> (q, gate)."""
    t = q_proj.reshape(shape.num_heads, 2, shape.head_dim, *q_proj.shape[1:])
    return t[:, 0].reshape(-1, *q_proj.shape[1:]), t[:, 1].reshape(-1, *q_proj.shape[1:])


def _interleave_q_gate(shape: ModelShape, q, gate):
    tail = q.shape[1:]
    return torch.stack([q.reshape(shape.num_heads, shape.head_dim, *tail),
                        gate.reshape(shape.num_heads, shape.head_dim, *tail)], 1).reshape(-1, *tail)


def _shard_sections(parts, rank: int, size: int) -> torch.Tensor:
    """Each full section split over TP along dim 0; this rank's pieces concatenated."""
    return torch.cat([_shard(p, 0, rank, size) for p in parts], 0)


def _unshard_sections(t: torch.Tensor, full_sizes, size: int):
    """Inverse of :func:`_shard_sections` on the rank-order concatenation ``t``: the full sections."""
    local = [n // size for n in full_sizes]
    per_rank = [block.split(local, 0) for block in t.split(sum(local), 0)]
    return [torch.cat([r[i] for r in per_rank], 0) for i in range(len(full_sizes))]


def _section_sizes(entry: Entry, rows: int) -> List[List[int]]:
    """Per HF tensor of a ``sections`` entry, its section row counts (``rows``: all of them)."""
    if entry.splits:
        g = entry.groups or 1
        return [[n * g for n in s] for s in entry.splits]
    return [[rows // len(entry.hf)] for _ in entry.hf]


def _ungroup(t: torch.Tensor, splits, groups: int) -> List[torch.Tensor]:
    """The sections of an HF tensor whose rows are ``groups`` repeats of ``splits`` (see
    :class:`~twinkle_megatron.models.table.Entry`): section i = split i of every group."""
    if not groups:
        return list(t.split(list(splits), 0))
    tail = t.shape[1:]
    return [p.reshape(groups * n, *tail) for p, n in zip(t.reshape(groups, sum(splits), *tail).split(list(splits), 1),
                                                          splits)]


def _regroup(sections: List[torch.Tensor], groups: int) -> torch.Tensor:
    """Inverse of :func:`_ungroup`."""
    if not groups:
        return torch.cat(sections, 0) if len(sections) > 1 else sections[0]
    tail = sections[0].shape[1:]
    return torch.cat([s.reshape(groups, -1, *tail) for s in sections], 1).reshape(-1, *tail)


def from_hf(entry: Entry, parts: Sequence[torch.Tensor], shape: ModelShape, rank: int, size: int) -> torch.Tensor:
    """This rank's megatron tensor of ``entry`` from its full HF tensors ``parts`` (``entry.hf``
    order), on a TP (or, for experts, expert-TP) group of ``size``. Works on any tensors of the
    HF shapes, index tensors included (LoRA derives its row layouts this way)."""
    layout = entry.layout
    if layout == "replicated":
        return parts[0]
    if layout == "column":
        return _shard(parts[0], 0, rank, size)
    if layout == "row":
        return _shard(parts[0], 1, rank, size)
    if layout == "sections":
        sections = ([s for p, n in zip(parts, entry.splits) for s in _ungroup(p, n, entry.groups)]
                    if entry.splits else list(parts))
        return _shard_sections(sections, rank, size)
    q, k, v = parts
    gate = None
    if layout == "gated_qkv":
        q, gate = _q_and_gate(shape, q)
    return _shard(_fused_qkv(shape, q, k, v, gate), 0, rank, size)


def to_hf(entry: Entry, t: torch.Tensor, shape: ModelShape, size: int) -> List[torch.Tensor]:
    """Inverse of :func:`from_hf`: the full HF tensors (``entry.hf`` order) from ``t``, the
    rank-order concatenation of the ``size`` shards along the parameter's partition dim."""
    layout = entry.layout
    if layout in ("replicated", "column", "row"):
        return [t]
    if layout == "sections":
        sizes = _section_sizes(entry, t.shape[0])
        sections = _unshard_sections(t, [n for s in sizes for n in s], size)
        out, i = [], 0
        for s in sizes:
            out.append(_regroup(sections[i:i + len(s)], entry.groups))
            i += len(s)
        return out
    gated = layout == "gated_qkv"
    parts = _split_qkv(shape, t, gated)
    if gated:
        q, k, v, gate = parts
        parts = (_interleave_q_gate(shape, q, gate), k, v)
    return [x.contiguous() for x in parts]


def hf_rows(entry: Entry, shape: ModelShape, rows: int) -> List[int]:
    """The row counts of ``entry``'s HF tensors when the full megatron tensor has ``rows`` rows."""
    if entry.layout in ("qkv", "gated_qkv"):
        kv = shape.num_kv_heads * shape.head_dim
        return [rows - 2 * kv, kv, kv]
    if entry.layout == "sections":
        return [sum(s) for s in _section_sizes(entry, rows)]
    return [rows]


def layer_prefix(shape: ModelShape, layer: int) -> str:
    return f"{shape.hf_prefix}layers.{layer}."


def expert_key(name: str):
    """``(table key, local expert index)`` of a routed-expert parameter name within a layer
    (``mlp.experts.local_experts.3.linear_fc1.weight`` -> ``(...local_experts.*.linear_fc1.weight, 3)``),
    or None."""
    m = _EXPERT.match(name)
    return (f"{m.group(1)}.*.{m.group(3)}", int(m.group(2))) if m else None


class Tables:
    """A model's name tables, built once per layer (the converter and LoRA look entries up here)."""

    def __init__(self, shape: ModelShape):
        self.shape = shape
        self.family = models.family(shape.model_type)
        self.model: Table = self.family.model_table(shape)
        self._layers: Dict[int, Table] = {}

    def layer(self, layer: int) -> Table:
        if layer not in self._layers:
            self._layers[layer] = self.family.layer_table(self.shape, layer)
        return self._layers[layer]

    def maps(self, kind: str, layer: int, name: str) -> bool:
        """Whether the tables have an entry for this name (as :func:`iter_params` yields it)."""
        if kind == "model":
            return name in self.model
        return (expert_key(name) or (name, -1))[0] in self.layer(layer)

    def entry(self, kind: str, layer: int, name: str) -> Tuple[Entry, int]:
        """``(entry, local expert index or -1)`` of a parameter as :func:`iter_params` yields it;
        KeyError naming it when the family's table has no mapping."""
        if kind == "model":
            if name not in self.model:
                raise KeyError(f"no Hugging Face mapping for megatron parameter {name}")
            return self.model[name], -1
        table = self.layer(layer)
        key, j = expert_key(name) or (name, -1)
        if key not in table:
            raise KeyError(f"no Hugging Face mapping for megatron parameter decoder.layers.N.{name}")
        return table[key], j


def global_expert(shape: ModelShape, r: dict, local: int) -> int:
    return r["ep"] * (shape.num_experts // r["ep_size"]) + local


def _hf_names(entry: Entry, prefix: str, expert: int) -> List[str]:
    return [prefix + (h.format(e=expert) if entry.expert else h) for h in entry.hf]


def _read(ckpt: "HFCheckpoint", entry: Entry, prefix: str, expert: int) -> List[torch.Tensor]:
    """The HF tensors of ``entry``; a routed expert's from its row of transformers' fused
    ``[E, ...]`` tensor (only that row read) when its per-expert names are absent."""
    names = _hf_names(entry, prefix, expert)
    if not entry.expert or not entry.fused or all(n in ckpt for n in names):
        return [ckpt.get(n) for n in names]
    fused = ckpt.get_row(prefix + entry.fused, expert).chunk(len(names), 0)
    return [ckpt.get(n) if n in ckpt else fused[i] for i, n in enumerate(names)]


def layer_numbers(chunk) -> Dict[int, int]:
    """``{index in chunk.decoder.layers: global layer (0-based)}``."""
    return {i: layer.layer_number - 1 for i, layer in enumerate(chunk.decoder.layers)}


def iter_params(chunk, tables: "Tables" = None) -> Iterator[Tuple[str, int, str, torch.nn.Parameter]]:
    """(kind, global layer or -1, name within the layer or model, param) for a GPTModel chunk;
    with ``tables``, then the buffers the tables map too (e.g. a router's expert bias)."""
    numbers = layer_numbers(chunk) if hasattr(chunk, "decoder") else {}

    def split(name):
        m = LAYER.match(name)
        return ("layer", numbers[int(m.group(1))], m.group(2)) if m else ("model", -1, name)

    for name, param in chunk.named_parameters():
        if _ADAPTER.search(name):   # LoRA adapters (twinkle_megatron.lora) are no HF weight
            continue
        yield (*split(name), param)
    if tables is not None:
        for name, buf in chunk.named_buffers():
            kind, layer, key = split(name)
            if tables.maps(kind, layer, key):
                yield kind, layer, key, buf


def _hf_values(chunks: List[torch.nn.Module], shape: ModelShape, path: str, *, allow_bin: bool = False
               ) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """``(parameter, its value from the checkpoint at path, in the parameter's dtype, on the CPU)``
    for every parameter of this rank's chunks (LoRA adapters aside), checked (a weight present,
    its shape, floating point); after the last one, ValueError naming any parameter left unset."""
    tables = Tables(shape)
    ckpt = HFCheckpoint(path, tables.family.checkpoint_renames, allow_bin=allow_bin)
    r = _ranks()
    done = set()
    for chunk in chunks:
        for kind, layer, name, param in iter_params(chunk, tables):
            entry, local = tables.entry(kind, layer, name)
            prefix = layer_prefix(shape, layer) if kind == "layer" else ""
            if entry.expert:
                parts = _read(ckpt, entry, prefix, global_expert(shape, r, local))
                value = from_hf(entry, parts, shape, r["etp"], r["etp_size"])
            else:
                parts = _read(ckpt, entry, prefix, -1)
                value = from_hf(entry, parts, shape, r["tp"], r["tp_size"])
            if value.shape != param.shape:
                raise ValueError(f"{name}: checkpoint gives shape {tuple(value.shape)}, "
                                 f"the sharded model expects {tuple(param.shape)}")
            if not all(p.is_floating_point() for p in parts):
                raise ValueError(f"{name}: the checkpoint's {_hf_names(entry, prefix, -1)} are "
                                 f"{[p.dtype for p in parts]}, not floating point")
            done.add(id(param))
            yield param, value.to(param.dtype)
    unset = [name for chunk in chunks for name, p in chunk.named_parameters()
             if id(p) not in done and not _ADAPTER.search(name)]
    if unset:
        raise ValueError(f"load_hf_weights: the checkpoint at {path!r} left {len(unset)} parameter(s) "
                         f"unset: {', '.join(unset[:8])}")


def read_hf_weights(chunks: List[torch.nn.Module], shape: ModelShape, path: str, *, allow_bin: bool = False
                    ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Every ``(parameter, value)`` :func:`load_hf_weights` would copy, read and checked, nothing
    changed: the first half of a load that is all or nothing (:func:`copy_weights` is the second).
    Holds this rank's weights once more, on the CPU (as megatron's ``dist_checkpointing.load``
    returns the loaded tensors before a model's ``load_state_dict`` copies them)."""
    out = []
    for param, value in _hf_values(chunks, shape, path, allow_bin=allow_bin):
        # a TP shard is a view of the full HF tensor: keep the shard, not the whole tensor
        if value.untyped_storage().nbytes() > value.numel() * value.element_size():
            value = value.clone()
        out.append((param, value))
    return out


@torch.no_grad()
def copy_weights(weights: List[Tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Copy :func:`read_hf_weights`' values into their parameters; returns how many."""
    for param, value in weights:
        param.copy_(value)
    return len(weights)


@torch.no_grad()
def load_hf_weights(chunks: List[torch.nn.Module], shape: ModelShape, path: str, *, allow_bin: bool = False) -> int:
    """Copy an HF safetensors checkpoint (``allow_bin``: or, without one, its ``pytorch_model.bin``
    files, unpickled with ``weights_only=True``) into this rank's megatron GPTModel chunks, one
    tensor at a time (the model being built: no second copy of the weights is held; a load into a
    live model goes through :func:`read_hf_weights` and :func:`copy_weights`). Returns the number
    of parameters set; raises KeyError naming a missing weight, and ValueError naming any
    parameter of the chunks (LoRA adapters aside) left unset: the chunks may be built without
    megatron's init (``initialize_weights=False``), their memory unset."""
    count = 0
    for param, value in _hf_values(chunks, shape, path, allow_bin=allow_bin):
        param.copy_(value)
        count += 1
    return count


def _gather(t: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    if size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def full_shape(param, size: int) -> Tuple[int, ...]:
    """The unsharded shape of ``param`` on a TP (or expert-TP) group of ``size``."""
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= size
    return tuple(shape)


class ExportItem:
    """One megatron parameter as the export sees it: its entry, the HF names it becomes, the
    group it is gathered over (``expert``: expert-TP, else TP) and whether this rank is the one
    that keeps the gathered result (TP / expert-TP rank 0 of data-parallel replica 0)."""

    def __init__(self, key, entry: Entry, names: List[str], param, expert: bool, r: dict):
        from megatron.core import parallel_state as ps
        self.key, self.entry, self.names, self.param, self.expert = key, entry, names, param, expert
        self.size = r["etp_size"] if expert else r["tp_size"]
        self.group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
        if expert:
            self.owner = r["etp"] == 0 and ps.get_expert_data_parallel_rank() == 0
        else:
            self.owner = r["tp"] == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0

    def hf_shapes(self, shape: ModelShape) -> List[Tuple[int, ...]]:
        """The HF tensors' shapes (no data is touched: computed on the meta device)."""
        meta = torch.empty(full_shape(self.param, self.size), device="meta")
        return [tuple(t.shape) for t in to_hf(self.entry, meta, shape, self.size)]

    @torch.no_grad()
    def gather(self, shape: ModelShape, dtype: torch.dtype) -> List[torch.Tensor]:
        """The HF tensors (``self.names`` order), CPU, ``dtype``. Collective over ``self.group``."""
        t = self.param.detach()
        if getattr(self.param, "tensor_model_parallel", False):
            t = _gather(t, self.param.partition_dim, self.group, self.size)
        t = t.to(device="cpu", dtype=dtype).contiguous()
        return [x.contiguous() for x in to_hf(self.entry, t, shape, self.size)]


def export_items(chunks: List[torch.nn.Module], shape: ModelShape) -> Iterator[ExportItem]:
    """This rank's exported parameters, in chunk order (no collectives)."""
    r = _ranks()
    tables = Tables(shape)
    for chunk in chunks:
        for kind, layer, name, param in iter_params(chunk, tables):
            entry, local = tables.entry(kind, layer, name)
            if not entry.export:
                continue
            prefix = layer_prefix(shape, layer) if kind == "layer" else ""
            e = global_expert(shape, r, local) if entry.expert else -1
            yield ExportItem((kind, layer, name, e), entry, _hf_names(entry, prefix, e), param, entry.expert, r)


def iter_hf_state(chunks: List[torch.nn.Module], shape: ModelShape, dtype: torch.dtype
                  ) -> Iterator[Tuple[str, torch.Tensor, bool]]:
    """``(HF name, tensor, is a routed expert's)`` for every weight of this rank's chunks, one
    megatron parameter gathered at a time. Collective over the TP / expert-TP groups: every rank
    of them iterates it to the end."""
    for item in export_items(chunks, shape):
        for name, t in zip(item.names, item.gather(shape, dtype)):
            yield name, t, item.expert


def export_hf_state(chunks: List[torch.nn.Module], shape: ModelShape, dtype: torch.dtype
                    ) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """Gather this rank's parameters over TP (experts: over expert-TP) and name them as HF does
    (:func:`iter_hf_state` collected).

    Collective over the TP / expert-TP groups: every rank must call it. Returns
    ``(dense, experts)``: HF tensors this rank's stage holds (identical on every TP and DP rank
    of the stage) and this rank's experts (identical across expert-TP and expert-DP ranks).
    """
    dense: Dict[str, torch.Tensor] = {}
    experts: Dict[str, torch.Tensor] = {}
    for name, t, expert in iter_hf_state(chunks, shape, dtype):
        (experts if expert else dense)[name] = t
    return dense, experts
