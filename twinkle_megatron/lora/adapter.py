"""Building an adapter: a :class:`LoraAdapter` (:mod:`.layers`) on every megatron linear that holds
a targeted HF module, with the row layout of fused projections taken from the converter's own
layout functions run on index tensors (so it cannot drift from how the weights are sharded)."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

import torch

from .. import convert
from ..models import table
from . import linear as lora_linear
from .config import lora_config, scaling
from .targets import hf_linear_names, resolve_parameters, resolve_targets


def _row_ids(entry, shape, rows: int, size: int):
    """``(row counts of entry's HF tensors, per TP rank the HF row ids its local output rows hold)``:
    the converter's own layout run on index tensors (``offset_t + row`` for HF tensor ``t``)."""
    counts = convert.hf_rows(entry, shape, rows)
    offsets = [sum(counts[:i]) for i in range(len(counts))]
    parts = [torch.arange(n) + o for n, o in zip(counts, offsets)]
    return counts, offsets, [convert.from_hf(entry, parts, shape, r, size) for r in range(size)]


def _col_ids(entry, shape, cols: int, size: int):
    """Per TP rank, the HF input columns a row-parallel ``entry``'s local shard holds."""
    return [convert.from_hf(entry, [torch.arange(cols)[None]], shape, r, size).reshape(-1) for r in range(size)]


def _build(base, entry, layer: int, shape, chosen: set, config, seed, tp_rank, tps, sp, dtype, device):
    """The LoraAdapter for one megatron linear (its name-table ``entry``), or None when no chosen
    target lives in it."""
    prefix = convert.layer_prefix(shape, layer)
    modules = [table.module_of(h) for h in entry.hf]
    targets = []
    if entry.layout != "row":
        kind, out_full, in_full = "column", base.output_size_per_partition * tps, base.input_size
        counts, offsets, ids = _row_ids(entry, shape, out_full, tps)
        for module, n, offset in zip(modules, counts, offsets):
            full_name = prefix + module
            if full_name in chosen:
                rows = [(i[(i >= offset) & (i < offset + n)] - offset) for i in ids]
                positions = ((ids[tp_rank] >= offset) & (ids[tp_rank] < offset + n)).nonzero().reshape(-1)
                targets.append(lora_linear.LoraTarget(module.rsplit(".", 1)[1], full_name, in_full, n,
                                                      rows=rows, positions=positions))
        out_local = base.output_size_per_partition
    else:
        kind, in_full = "row", base.input_size
        full_name = prefix + modules[0]
        if full_name in chosen:
            targets.append(lora_linear.LoraTarget(modules[0].rsplit(".", 1)[1], full_name, in_full,
                                                  base.output_size, cols=_col_ids(entry, shape, in_full, tps)))
        out_local = base.output_size
    if not targets:
        return None
    full = {t.name: lora_linear.init_full(t, config.r, bool(config.init_lora_weights), seed) for t in targets}
    return lora_linear.LoraAdapter(kind, targets, full, r=config.r, scaling=scaling(config),
                                   dropout=float(config.lora_dropout), out_local=out_local,
                                   tp_rank=tp_rank, tp_size=tps, sequence_parallel=sp, dtype=dtype,
                                   device=device)


def _build_expert(base, entry, layer: int, expert: int, shape, chosen: set, config, fused: dict,
                  seed, etp_rank, etps, group, dtype, device):
    """The LoraAdapter of global expert ``expert``'s linear (its name-table ``entry``: peft targets
    the fused HF parameter ``entry.fused``), or None when that parameter is not targeted.
    ``fused``: a cache of peft's fused initial factors per HF parameter (built once, so every rank
    slices the same full matrices)."""
    prefix = convert.layer_prefix(shape, layer)
    hf = prefix + entry.fused
    if hf not in chosen:
        return None
    module, param = entry.fused.rsplit(".", 1)
    full_name = f"{prefix}{module}.{expert}.{param}"
    if entry.layout != "row":
        kind, out_full, in_full = "column", base.output_size_per_partition * etps, base.input_size
        _, _, ids = _row_ids(entry, shape, out_full, etps)
        target = lora_linear.LoraTarget(param, full_name, in_full, out_full, rows=ids,
                                        positions=torch.arange(ids[etp_rank].numel()))
        out_local = base.output_size_per_partition
    else:
        kind, in_full, out_full = "row", base.input_size, base.output_size
        target = lora_linear.LoraTarget(param, full_name, in_full, out_full,
                                        cols=_col_ids(entry, shape, in_full, etps))
        out_local = out_full
    if hf not in fused:
        fused[hf] = lora_linear.init_expert_full(hf, shape.num_experts, config.r, in_full, out_full,
                                                 bool(config.init_lora_weights), seed)
    full = {param: lora_linear.expert_factors(*fused[hf], expert, shape.num_experts)}
    return lora_linear.LoraAdapter(kind, [target], full, r=config.r, scaling=scaling(config), dropout=0.0,
                                   out_local=out_local, tp_rank=etp_rank, tp_size=etps,
                                   sequence_parallel=False, dtype=dtype, device=device, expert=True,
                                   group=group)


@dataclasses.dataclass
class Adapter:
    """What a MegatronModel keeps about one of its adapters (``MegatronModel.adapters[name]``)."""
    name: str
    config: object                      # the checked peft.LoraConfig
    targets: List[str]                  # HF module names, all stages
    modules: List[lora_linear.LoraAdapter]
    handles: list
    gradient_accumulation_steps: int = 1
    trainable_params: int = 0           # whole model, all ranks (counted once, when added)
    total_params: int = 0
    parameters: List[str] = dataclasses.field(default_factory=list)   # HF expert parameters
    num_experts: int = 0
    # HF expert parameter -> its per-expert HF weights ("{e}" for the expert), from the name table
    expert_weights: Dict[str, List[str]] = dataclasses.field(default_factory=dict)
    model_type: str = ""                # the HF model_type (how peft reads the saved adapter config)


def add_adapter(model, adapter_name: str, config, gradient_accumulation_steps: int = 1) -> Adapter:
    """Freeze ``model``'s base weights and attach a LoRA adapter to its megatron linears (this
    rank's stages). See :meth:`MegatronModel.add_adapter_to_model`."""
    from megatron.core import parallel_state as ps
    if not isinstance(adapter_name, str) or not adapter_name or "." in adapter_name:
        raise ValueError(f"adapter_name must be a non-empty string without '.' (it names the adapter's "
                         f"modules), got {adapter_name!r}")
    if (not isinstance(gradient_accumulation_steps, int) or isinstance(gradient_accumulation_steps, bool)
            or gradient_accumulation_steps < 1):
        raise ValueError(f"gradient_accumulation_steps must be an int >= 1, got {gradient_accumulation_steps!r}")
    config = lora_config(config)
    chosen = set(resolve_targets(config, model.shape))
    chosen_params = resolve_parameters(config, model.shape)
    tp_rank, tps = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    sp = bool(model.mesh.sequence_parallel)
    tables = convert.Tables(model.shape)
    modules, handles, fused, expert_weights = [], [], {}, {}
    for chunk in model.unwrapped_chunks():
        for p in chunk.parameters():
            p.requires_grad_(False)
        numbers = convert.layer_numbers(chunk)
        for name, base in chunk.named_modules():
            m = convert.LAYER.match(name)
            if not m:
                continue
            layer = numbers[int(m.group(1))]
            key, local = convert.expert_key(m.group(2) + ".weight") or (m.group(2) + ".weight", -1)
            entry = tables.layer(layer).get(key)
            if entry is None or not entry.linear or entry.layout not in table.PARALLEL_LINEAR_LAYOUTS:
                continue
            if entry.expert:
                if not chosen_params:
                    continue
                per_rank = model.shape.num_experts // ps.get_expert_model_parallel_world_size()
                expert = ps.get_expert_model_parallel_rank() * per_rank + local
                adapter = _build_expert(base, entry, layer, expert, model.shape,
                                        set(chosen_params), config, fused, model.seed,
                                        ps.get_expert_tensor_parallel_rank(),
                                        ps.get_expert_tensor_parallel_world_size(),
                                        ps.get_expert_tensor_parallel_group(), model.dtype, model.device)
            else:
                adapter = _build(base, entry, layer, model.shape, chosen, config, model.seed, tp_rank,
                                 tps, sp, model.dtype, model.device)
            if adapter is not None:
                handles.append(lora_linear.attach(base, adapter_name, adapter))
                modules.append(adapter)
    # every targeted expert parameter's per-expert HF weights (for merged_delta), on every rank
    for layer in range(model.shape.num_layers):
        prefix = convert.layer_prefix(model.shape, layer)
        for entry in tables.layer(layer).values():
            if entry.expert and prefix + entry.fused in chosen_params:
                expert_weights[prefix + entry.fused] = [prefix + h for h in entry.hf]
    adapter = Adapter(adapter_name, config, sorted(chosen, key=hf_linear_names(model.shape).index),
                      modules, handles, gradient_accumulation_steps, parameters=chosen_params,
                      num_experts=model.shape.num_experts, expert_weights=expert_weights,
                      model_type=model.shape.model_type)
    # counted here, where every rank takes part, so get_train_configs stays local
    adapter.trainable_params, adapter.total_params = parameter_counts(model)
    return adapter


def parameter_counts(model) -> Tuple[int, int]:
    """(trainable, total) parameters of the whole model (all ranks; collective over the model-
    parallel and the expert tensor/model/pipeline-parallel groups). Dense parameters are summed
    over TP x PP, each TP duplicate once, a tied embedding's last-stage copy (megatron's
    ``shared``) left out; expert parameters over expert-TP x EP x PP, each expert-TP duplicate
    once (the experts of every EP rank, also when EP spans TP). Expert means under megatron's
    ``experts`` module, or marked ``allreduce=False``: megatron marks its expert weights so only
    when EP > 1, and with EP 1 and expert-TP 1 they are whole on every TP rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared
    dense, experts = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    etp_rank = ps.get_expert_tensor_parallel_rank()
    for chunk in model.unwrapped_chunks():
        for name, p in chunk.named_parameters():
            if not param_is_not_shared(p):
                continue
            expert = getattr(p, "allreduce", True) is False or "experts" in name.split(".")
            if expert:
                if not (getattr(p, "tensor_model_parallel", False) or etp_rank == 0):
                    continue
            elif not param_is_not_tensor_parallel_duplicate(p):
                continue
            (experts if expert else dense).add_(torch.tensor([p.numel() * p.requires_grad, p.numel()],
                                                             dtype=torch.float64))
    if dist.is_initialized():
        for counts, group in ((dense, ps.get_model_parallel_group()),
                              (experts, ps.get_expert_tensor_model_pipeline_parallel_group())):
            if group.size() > 1:
                reduced = counts.to(model.device)
                dist.all_reduce(reduced, group=group)
                counts.copy_(reduced.cpu())
    counts = dense + experts
    return int(counts[0]), int(counts[1])
