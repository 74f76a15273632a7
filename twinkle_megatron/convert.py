"""Hugging Face <-> megatron-core weight conversion, with TP / PP / EP sharding.

Megatron layouts handled here (local layer spec):
- ``linear_qkv``: rows grouped per query group ``g``: ``[q heads of g, k_g, v_g] * head_dim``; TP
  ranks hold contiguous runs of whole groups (so GQA splits cleanly when kv_heads % tp == 0).
- ``linear_fc1`` (dense and per expert): ``[gate_shard; up_shard]`` per TP rank.
- ``linear_proj`` / ``linear_fc2``: row-parallel, split along the input dimension.
- embeddings / output layer: vocab-parallel rows.
- experts: ``mlp.experts.local_experts.{j}`` is global expert ``ep_rank * E / ep + j``, split over
  the expert-TP group like a dense MLP.
Layer indices are global (``layer.layer_number - 1``), so pipeline stages need no special case.
"""
from __future__ import annotations

import json
import os
import re
from typing import Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist

from .hf_config import ModelShape

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")


class HFCheckpoint:
    """Lazy reader of a safetensors checkpoint directory (single file or sharded with an index)."""

    def __init__(self, path: str):
        from safetensors import safe_open
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.isfile(os.path.join(path, "model.safetensors")):
            files = ["model.safetensors"]
        else:
            raise FileNotFoundError(f"no safetensors weights (model.safetensors or its index) in {path!r}")
        self._handles = [safe_open(os.path.join(path, f), framework="pt") for f in files]
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


def _fused_qkv(shape: ModelShape, q, k, v) -> torch.Tensor:
    groups, per = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads
    tail = q.shape[1:]
    q = q.reshape(groups, per, shape.head_dim, *tail)
    k = k.reshape(groups, 1, shape.head_dim, *tail)
    v = v.reshape(groups, 1, shape.head_dim, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def _split_qkv(shape: ModelShape, qkv):
    groups, per = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads
    tail = qkv.shape[1:]
    qkv = qkv.reshape(groups, per + 2, shape.head_dim, *tail)
    return (qkv[:, :per].reshape(-1, *tail), qkv[:, per].reshape(-1, *tail),
            qkv[:, per + 1].reshape(-1, *tail))


def _hf_expert(ckpt: HFCheckpoint, layer: int, e: int, which: str) -> torch.Tensor:
    """Per-expert weight ``which`` in gate/up/down, from per-expert or fused HF layouts."""
    name = f"model.layers.{layer}.mlp.experts.{e}.{which}_proj.weight"
    if name in ckpt:
        return ckpt.get(name)
    if which == "down":
        return ckpt.get(f"model.layers.{layer}.mlp.experts.down_proj")[e]
    gate_up = ckpt.get(f"model.layers.{layer}.mlp.experts.gate_up_proj")[e]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if which == "gate" else gate_up[half:]


def _layer_param_from_hf(shape, ckpt, r, layer: int, rest: str) -> torch.Tensor:
    p = f"model.layers.{layer}."
    tp, tps = r["tp"], r["tp_size"]
    m = _EXPERT.match(rest)
    if m:
        e = r["ep"] * (shape.num_experts // r["ep_size"]) + int(m.group(1))
        if m.group(2) == "linear_fc1":
            gate = _shard(_hf_expert(ckpt, layer, e, "gate"), 0, r["etp"], r["etp_size"])
            up = _shard(_hf_expert(ckpt, layer, e, "up"), 0, r["etp"], r["etp_size"])
            return torch.cat([gate, up], 0)
        return _shard(_hf_expert(ckpt, layer, e, "down"), 1, r["etp"], r["etp_size"])
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        fused = _fused_qkv(shape, *(ckpt.get(f"{p}self_attn.{x}_proj.{kind}") for x in "qkv"))
        return _shard(fused, 0, tp, tps)
    if rest == "self_attention.linear_proj.weight":
        return _shard(ckpt.get(f"{p}self_attn.o_proj.weight"), 1, tp, tps)
    if rest == "mlp.linear_fc1.weight":
        gate = _shard(ckpt.get(f"{p}mlp.gate_proj.weight"), 0, tp, tps)
        up = _shard(ckpt.get(f"{p}mlp.up_proj.weight"), 0, tp, tps)
        return torch.cat([gate, up], 0)
    if rest == "mlp.linear_fc2.weight":
        return _shard(ckpt.get(f"{p}mlp.down_proj.weight"), 1, tp, tps)
    simple = {
        "input_layernorm.weight": "input_layernorm.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        "mlp.router.weight": "mlp.gate.weight",
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
                value = _shard(ckpt.get("model.embed_tokens.weight"), 0, r["tp"], r["tp_size"])
            elif name == "decoder.final_layernorm.weight":
                value = ckpt.get("model.norm.weight")
            elif name == "output_layer.weight":
                src = "model.embed_tokens.weight" if shape.tie_word_embeddings else "lm_head.weight"
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
    rows = t.shape[0] // (2 * size)
    t = t.reshape(size, 2, rows, *t.shape[1:])
    return t[:, 0].reshape(-1, *t.shape[3:]), t[:, 1].reshape(-1, *t.shape[3:])


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
            p = f"model.layers.{layer}."
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
                target = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
                          "decoder.final_layernorm.weight": "model.norm.weight",
                          "output_layer.weight": "lm_head.weight"}[name]
                if target == "lm_head.weight" and shape.tie_word_embeddings:
                    continue
                dense[target] = t
            elif name.startswith("self_attention.linear_qkv."):
                kind_ = name.rsplit(".", 1)[1]
                for x, part in zip("qkv", _split_qkv(shape, t)):
                    dense[f"{p}self_attn.{x}_proj.{kind_}"] = part.contiguous()
            elif name == "mlp.linear_fc1.weight":
                dense[p + "mlp.gate_proj.weight"], dense[p + "mlp.up_proj.weight"] = _unshard_fc1(t, r["tp_size"])
            else:
                dense[p + {
                    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
                    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
                    "input_layernorm.weight": "input_layernorm.weight",
                    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
                    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
                    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
                    "mlp.router.weight": "mlp.gate.weight",
                }[name]] = t
    dense = {k: v.contiguous() for k, v in dense.items()}
    experts = {k: v.contiguous() for k, v in experts.items()}
    return dense, experts
