"""Hugging Face <-> megatron-core weight conversion, with TP / PP / EP sharding.

Megatron layouts handled here (local layer spec):
- ``linear_qkv``: rows grouped per query group ``g``: ``[q heads of g, k_g, v_g] * head_dim``; TP
  ranks hold contiguous runs of whole groups (so GQA splits cleanly when kv_heads % tp == 0).
- ``linear_fc1`` (dense and per expert): ``[gate_shard; up_shard]`` per TP rank.
- ``linear_proj`` / ``linear_fc2``: row-parallel, split along the input dimension.
- embeddings / output layer: vocab-parallel rows.
- experts: ``mlp.experts.local_experts.{j}`` is global expert ``ep_rank * E / ep + j``, split over
  the expert-TP group like a dense MLP.
- Qwen3.5 gated attention: ``linear_qkv`` rows per query group are ``[q heads, gate heads, k, v]``;
  HF's ``q_proj`` interleaves ``[q_h, gate_h]`` per head.
- Qwen3.5 Gated DeltaNet (``self_attention`` of a linear-attention layer): each TP rank's
  ``in_proj`` is ``[q, k, v, z, beta, alpha]`` of its heads (HF: ``in_proj_qkv`` = ``[q; k; v]``,
  ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), ``conv1d`` channels ``[q, k, v]`` likewise;
  ``A_log`` / ``dt_bias`` split by value head.
Layer indices are global (``layer.layer_number - 1``), so pipeline stages need no special case.
"""
from __future__ import annotations

import os
import re
from typing import Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist

from .config import ModelShape
from .validate import read_json

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_ADAPTER = re.compile(r"(^|\.)lora\.lora_[AB]\.")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")


class HFCheckpoint:
    """Lazy reader of a safetensors checkpoint directory (single file or sharded with an index)."""

    def __init__(self, path: str):
        from safetensors import safe_open
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            files = sorted(set(read_json(index, "safetensors index")["weight_map"].values()))
        elif os.path.isfile(os.path.join(path, "model.safetensors")):
            files = ["model.safetensors"]
        else:
            raise FileNotFoundError(f"no safetensors weights (model.safetensors or its index) in {path!r}")
        self._handles = []
        for f in files:
            try:
                self._handles.append(safe_open(os.path.join(path, f), framework="pt"))
            except Exception as e:   # safetensors' own error type does not name the file
                raise ValueError(f"cannot read weights file {os.path.join(path, f)!r} "
                                 f"(truncated or corrupted?): {e}") from None
        self._where = {k: h for h in self._handles for k in h.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"weight {name!r} is missing from the Hugging Face checkpoint")
        return self._where[name].get_tensor(name)


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


def _split_qkv(shape: ModelShape, qkv):
    """Inverse of :func:`_fused_qkv`: ``(q, k, v)`` or, with the output gate, ``(q, k, v, gate)``."""
    groups, per = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads
    gated = shape.attention_output_gate
    tail = qkv.shape[1:]
    qkv = qkv.reshape(groups, per * (2 if gated else 1) + 2, shape.head_dim, *tail)
    q = qkv[:, :per].reshape(-1, *tail)
    k, v = qkv[:, -2].reshape(-1, *tail), qkv[:, -1].reshape(-1, *tail)
    if gated:
        return q, k, v, qkv[:, per:2 * per].reshape(-1, *tail)
    return q, k, v


def _q_and_gate(shape: ModelShape, q_proj: torch.Tensor):
    """HF Qwen3.5 ``q_proj`` rows ``[q_h, gate_h]`` per head -> (q, gate)."""
    t = q_proj.reshape(shape.num_heads, 2, shape.head_dim, *q_proj.shape[1:])
    return t[:, 0].reshape(-1, *q_proj.shape[1:]), t[:, 1].reshape(-1, *q_proj.shape[1:])


def _interleave_q_gate(shape: ModelShape, q, gate):
    tail = q.shape[1:]
    return torch.stack([q.reshape(shape.num_heads, shape.head_dim, *tail),
                        gate.reshape(shape.num_heads, shape.head_dim, *tail)], 1).reshape(-1, *tail)


def _gdn_sections(shape: ModelShape, what: str):
    """Row counts of the full (unsharded) sections of the GDN ``in_proj`` or ``conv1d``."""
    qk = shape.linear_key_head_dim * shape.linear_num_key_heads
    v = shape.linear_value_head_dim * shape.linear_num_value_heads
    hv = shape.linear_num_value_heads
    return [qk, qk, v] if what == "conv1d" else [qk, qk, v, v, hv, hv]


def _shard_sections(parts, rank: int, size: int) -> torch.Tensor:
    """Each full section split over TP along dim 0; this rank's pieces concatenated."""
    return torch.cat([_shard(p, 0, rank, size) for p in parts], 0)


def _unshard_sections(t: torch.Tensor, full_sizes, size: int):
    """Inverse of :func:`_shard_sections` on the rank-order concatenation ``t``: the full sections."""
    local = [n // size for n in full_sizes]
    per_rank = [block.split(local, 0) for block in t.split(sum(local), 0)]
    return [torch.cat([r[i] for r in per_rank], 0) for i in range(len(full_sizes))]


def _gdn_param_from_hf(shape, ckpt, p: str, tp: int, tps: int, rest: str) -> torch.Tensor:
    a = f"{p}linear_attn."
    if rest == "in_proj.weight":
        q, k, v = ckpt.get(a + "in_proj_qkv.weight").split(_gdn_sections(shape, "conv1d"), 0)
        parts = [q, k, v] + [ckpt.get(f"{a}in_proj_{x}.weight") for x in "zba"]
        return _shard_sections(parts, tp, tps)
    if rest in ("conv1d.weight", "conv1d.bias"):
        return _shard_sections(ckpt.get(a + rest).split(_gdn_sections(shape, "conv1d"), 0), tp, tps)
    if rest in ("A_log", "dt_bias"):
        return _shard(ckpt.get(a + rest), 0, tp, tps)
    if rest == "out_norm.weight":
        return ckpt.get(a + "norm.weight")
    if rest == "out_proj.weight":
        return _shard(ckpt.get(a + "out_proj.weight"), 1, tp, tps)
    raise KeyError(f"no Hugging Face mapping for megatron parameter decoder.layers.N.self_attention.{rest}")


def _gdn_param_to_hf(shape, p: str, rest: str, t: torch.Tensor, tps: int) -> Dict[str, torch.Tensor]:
    a = f"{p}linear_attn."
    if rest == "in_proj.weight":
        q, k, v, z, b, al = _unshard_sections(t, _gdn_sections(shape, "in_proj"), tps)
        return {a + "in_proj_qkv.weight": torch.cat([q, k, v], 0), a + "in_proj_z.weight": z,
                a + "in_proj_b.weight": b, a + "in_proj_a.weight": al}
    if rest in ("conv1d.weight", "conv1d.bias"):
        return {a + rest: torch.cat(_unshard_sections(t, _gdn_sections(shape, "conv1d"), tps), 0)}
    name = {"A_log": "A_log", "dt_bias": "dt_bias", "out_norm.weight": "norm.weight",
            "out_proj.weight": "out_proj.weight"}[rest]
    return {a + name: t}


def _hf_expert(ckpt: HFCheckpoint, p: str, e: int, which: str) -> torch.Tensor:
    """Per-expert weight ``which`` in gate/up/down of the layer whose HF prefix is ``p``, from
    per-expert or fused HF layouts."""
    name = f"{p}mlp.experts.{e}.{which}_proj.weight"
    if name in ckpt:
        return ckpt.get(name)
    if which == "down":
        return ckpt.get(f"{p}mlp.experts.down_proj")[e]
    gate_up = ckpt.get(f"{p}mlp.experts.gate_up_proj")[e]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if which == "gate" else gate_up[half:]


def _layer_param_from_hf(shape, ckpt, r, layer: int, rest: str) -> torch.Tensor:
    p = f"{shape.hf_prefix}layers.{layer}."
    tp, tps = r["tp"], r["tp_size"]
    m = _EXPERT.match(rest)
    if m:
        e = r["ep"] * (shape.num_experts // r["ep_size"]) + int(m.group(1))
        if m.group(2) == "linear_fc1":
            return _shard_sections([_hf_expert(ckpt, p, e, x) for x in ("gate", "up")], r["etp"], r["etp_size"])
        return _shard(_hf_expert(ckpt, p, e, "down"), 1, r["etp"], r["etp_size"])
    if shape.is_linear(layer) and rest.startswith("self_attention."):
        return _gdn_param_from_hf(shape, ckpt, p, tp, tps, rest[len("self_attention."):])
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        q, k, v = (ckpt.get(f"{p}self_attn.{x}_proj.{kind}") for x in "qkv")
        gate = None
        if shape.attention_output_gate:
            q, gate = _q_and_gate(shape, q)
        return _shard(_fused_qkv(shape, q, k, v, gate), 0, tp, tps)
    if rest == "self_attention.linear_proj.weight":
        return _shard(ckpt.get(f"{p}self_attn.o_proj.weight"), 1, tp, tps)
    if rest in ("mlp.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight"):
        mlp = "mlp." if rest.startswith("mlp.linear") else "mlp.shared_expert."
        return _shard_sections([ckpt.get(f"{p}{mlp}{x}_proj.weight") for x in ("gate", "up")], tp, tps)
    if rest in ("mlp.linear_fc2.weight", "mlp.shared_experts.linear_fc2.weight"):
        mlp = "mlp." if rest.startswith("mlp.linear") else "mlp.shared_expert."
        return _shard(ckpt.get(f"{p}{mlp}down_proj.weight"), 1, tp, tps)
    simple = {
        "input_layernorm.weight": "input_layernorm.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        "mlp.router.weight": "mlp.gate.weight",
        "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
    }
    if rest in simple:
        return ckpt.get(p + simple[rest])
    raise KeyError(f"no Hugging Face mapping for megatron parameter decoder.layers.N.{rest}")


def _layer_numbers(chunk) -> Dict[int, int]:
    return {i: layer.layer_number - 1 for i, layer in enumerate(chunk.decoder.layers)}


def iter_params(chunk) -> Iterator[Tuple[str, int, str, torch.nn.Parameter]]:
    """(kind, global layer or -1, name within the layer or model, param) for a GPTModel chunk."""
    numbers = _layer_numbers(chunk) if hasattr(chunk, "decoder") else {}
    for name, param in chunk.named_parameters():
        if _ADAPTER.search(name):   # LoRA adapters (twinkle_megatron.lora) are no HF weight
            continue
        m = _LAYER.match(name)
        if m:
            yield "layer", numbers[int(m.group(1))], m.group(2), param
        else:
            yield "model", -1, name, param


@torch.no_grad()
def load_hf_weights(chunks: List[torch.nn.Module], shape: ModelShape, path: str) -> int:
    """Copy an HF safetensors checkpoint into this rank's megatron GPTModel chunks.
    Returns the number of parameters set; raises KeyError naming a missing weight."""
    ckpt = HFCheckpoint(path)
    r = _ranks()
    count = 0
    for chunk in chunks:
        for kind, layer, name, param in iter_params(chunk):
            if kind == "layer":
                value = _layer_param_from_hf(shape, ckpt, r, layer, name)
            elif name == "embedding.word_embeddings.weight":
                value = _shard(ckpt.get(shape.hf_prefix + "embed_tokens.weight"), 0, r["tp"], r["tp_size"])
            elif name == "decoder.final_layernorm.weight":
                value = ckpt.get(shape.hf_prefix + "norm.weight")
            elif name == "output_layer.weight":
                src = shape.hf_prefix + "embed_tokens.weight" if shape.tie_word_embeddings else "lm_head.weight"
                value = _shard(ckpt.get(src), 0, r["tp"], r["tp_size"])
            else:
                raise KeyError(f"no Hugging Face mapping for megatron parameter {name}")
            if value.shape != param.shape:
                raise ValueError(f"{name}: checkpoint gives shape {tuple(value.shape)}, "
                                 f"the sharded model expects {tuple(param.shape)}")
            param.copy_(value.to(param.dtype))
            count += 1
    return count


def _gather(t: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    if size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _unshard_fc1(t: torch.Tensor, size: int):
    """megatron's fc1 ``[gate_shard; up_shard]`` per TP rank, gathered in rank order -> (gate, up)."""
    return tuple(_unshard_sections(t, [t.shape[0] // 2] * 2, size))


@torch.no_grad()
def export_hf_state(chunks: List[torch.nn.Module], shape: ModelShape, dtype: torch.dtype
                    ) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """Gather this rank's parameters over TP (experts: over expert-TP) and name them as HF does.

    Collective over the TP / expert-TP groups: every rank must call it. Returns
    ``(dense, experts)``: HF tensors this rank's stage holds (identical on every TP and DP rank
    of the stage) and this rank's experts (identical across expert-TP and expert-DP ranks).
    """
    from megatron.core import parallel_state as ps
    r = _ranks()
    tp_group, etp_group = ps.get_tensor_model_parallel_group(), ps.get_expert_tensor_parallel_group()
    dense: Dict[str, torch.Tensor] = {}
    experts: Dict[str, torch.Tensor] = {}

    def full(param, group, size):
        t = param.detach()
        if getattr(param, "tensor_model_parallel", False):
            t = _gather(t, param.partition_dim, group, size)
        return t.to(device="cpu", dtype=dtype).contiguous()

    for chunk in chunks:
        for kind, layer, name, param in iter_params(chunk):
            p = f"{shape.hf_prefix}layers.{layer}."
            m = _EXPERT.match(name) if kind == "layer" else None
            if m:
                e = r["ep"] * (shape.num_experts // r["ep_size"]) + int(m.group(1))
                t = full(param, etp_group, r["etp_size"])
                q = f"{p}mlp.experts.{e}."
                if m.group(2) == "linear_fc1":
                    experts[q + "gate_proj.weight"], experts[q + "up_proj.weight"] = _unshard_fc1(t, r["etp_size"])
                else:
                    experts[q + "down_proj.weight"] = t
                continue
            t = full(param, tp_group, r["tp_size"])
            if kind == "model":
                target = {"embedding.word_embeddings.weight": shape.hf_prefix + "embed_tokens.weight",
                          "decoder.final_layernorm.weight": shape.hf_prefix + "norm.weight",
                          "output_layer.weight": "lm_head.weight"}[name]
                if target == "lm_head.weight" and shape.tie_word_embeddings:
                    continue
                dense[target] = t
            elif shape.is_linear(layer) and name.startswith("self_attention."):
                dense.update(_gdn_param_to_hf(shape, p, name[len("self_attention."):], t, r["tp_size"]))
            elif name.startswith("self_attention.linear_qkv."):
                kind_ = name.rsplit(".", 1)[1]
                parts = _split_qkv(shape, t)
                if shape.attention_output_gate:
                    q, k, v, gate = parts
                    parts = (_interleave_q_gate(shape, q, gate), k, v)
                for x, part in zip("qkv", parts):
                    dense[f"{p}self_attn.{x}_proj.{kind_}"] = part.contiguous()
            elif name in ("mlp.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight"):
                mlp = "mlp." if name.startswith("mlp.linear") else "mlp.shared_expert."
                dense[p + mlp + "gate_proj.weight"], dense[p + mlp + "up_proj.weight"] = _unshard_fc1(t, r["tp_size"])
            else:
                dense[p + {
                    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
                    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
                    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
                    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
                    "input_layernorm.weight": "input_layernorm.weight",
                    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
                    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
                    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
                    "mlp.router.weight": "mlp.gate.weight",
                }[name]] = t
    dense = {k: v.contiguous() for k, v in dense.items()}
    experts = {k: v.contiguous() for k, v in experts.items()}
    return dense, experts
