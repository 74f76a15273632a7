"""LoRA adapters on a MegatronModel: config checks, Hugging Face target names, attaching
:class:`twinkle_megatron.layers.lora.LoraAdapter` to megatron's linears, and PEFT-format export.

Targets are named as peft names them on the transformers model (``model.layers.3.self_attn.q_proj``);
``target_modules`` is matched against those names the way peft matches it (a string is a regex
that must match the whole name; a list entry matches a name equal to it or ending in ``.entry``;
``"all-linear"``: every linear this module supports, see :data:`UNSUPPORTED`). Megatron module ->
HF targets:

- ``self_attention.linear_qkv``: ``self_attn.q_proj``, ``k_proj``, ``v_proj`` (Qwen3.5: q_proj also
  carries the output gate, interleaved per head as transformers has it);
- ``self_attention.linear_proj``: ``self_attn.o_proj``;
- ``mlp.linear_fc1`` / ``linear_fc2``: ``mlp.gate_proj``, ``up_proj`` / ``down_proj``; the same under
  ``mlp.shared_experts`` for ``mlp.shared_expert.*`` (Qwen3.5-MoE);
- Gated DeltaNet ``self_attention.in_proj`` / ``out_proj``: ``linear_attn.in_proj_qkv``,
  ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` / ``linear_attn.out_proj``.

Routed experts are targeted as peft targets transformers' fused expert parameters: by
``target_parameters`` (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``, matched like a
``target_modules`` list against ``model.layers.N.mlp.experts.<param>``), never by ``target_modules``
(transformers has no per-expert ``gate_proj`` module to name, so peft would not adapt experts for
it either). One adapter per expert: ``gate_up_proj`` -> every local expert's ``linear_fc1`` (gate
and up share it, as the fused parameter does), ``down_proj`` -> ``linear_fc2``. Exported in peft's
ParamWrapper format (:func:`peft_state_dict`); peft refuses ``lora_dropout`` on parameters, and so
does this module.

The per-rank row layout of each fused projection is computed by running the weight converter's
own layout functions on index tensors, so it cannot drift from how the weights are sharded.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import re
from typing import Dict, List, Optional, Tuple

import torch

from . import convert, models
from .layers import lora as lora_layers
from .models import table

logger = logging.getLogger(__name__)

# LoraConfig fields this implementation honours (or that carry no behaviour); any other field set
# away from peft's default is refused with its name.
_HONOURED = {"r", "lora_alpha", "lora_dropout", "use_rslora", "bias", "init_lora_weights",
             "target_modules", "exclude_modules", "task_type", "peft_type", "auto_mapping",
             "peft_version", "base_model_name_or_path", "revision", "inference_mode", "runtime_config",
             "megatron_core", "target_parameters"}
# ``<module>.<expert>.<parameter>``: one routed expert's adapter (see expert_keys)
_EXPERT_KEY = re.compile(r"^(.+)\.(\d+)\.([^.]+)$")


def lora_config(config):
    """A ``peft.LoraConfig`` from ``config`` (a LoraConfig or a dict of its fields), checked: a field
    this implementation does not honour, set away from its default, raises ValueError naming it."""
    try:
        from peft import LoraConfig
    except ImportError as e:  # pragma: no cover - peft is in the hf and test extras
        raise ImportError("LoRA needs peft (pip install peft)") from e
    if isinstance(config, dict):
        try:
            config = LoraConfig(**config)
        except TypeError as e:
            raise ValueError(f"config: {e}") from e
    if not isinstance(config, LoraConfig):
        raise TypeError(f"config must be a peft.LoraConfig or a dict of its fields, got {type(config).__name__}")
    default = LoraConfig()
    for f in dataclasses.fields(LoraConfig):
        if f.name not in _HONOURED and getattr(config, f.name) != getattr(default, f.name):
            raise ValueError(f"LoraConfig.{f.name}={getattr(config, f.name)!r} is not supported by the "
                             f"Megatron LoRA (leave it at {getattr(default, f.name)!r})")
    if config.bias != "none":
        raise ValueError(f"LoraConfig.bias={config.bias!r} is not supported (only 'none')")
    if config.init_lora_weights not in (True, False):
        raise ValueError(f"LoraConfig.init_lora_weights={config.init_lora_weights!r} is not supported "
                         "(True: peft's default init, False: random A and B)")
    if not isinstance(config.r, int) or config.r <= 0:
        raise ValueError(f"LoraConfig.r must be a positive int, got {config.r!r}")
    if not 0.0 <= float(config.lora_dropout) < 1.0:
        raise ValueError(f"LoraConfig.lora_dropout must be in [0, 1), got {config.lora_dropout!r}")
    if config.target_modules is None and not config.target_parameters:
        raise ValueError("LoraConfig.target_modules is required (HF names, a regex or 'all-linear'), "
                         "or target_parameters for routed experts")
    if config.target_parameters and float(config.lora_dropout) != 0.0:
        raise ValueError(f"LoraConfig.lora_dropout={config.lora_dropout!r} with target_parameters: peft "
                         "cannot apply dropout to a parameter adapter (its ParamWrapper refuses it), "
                         "so neither does this one")
    return config


def scaling(config) -> float:
    return config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)


def hf_linear_names(shape) -> List[str]:
    """Every linear module name peft would see on the transformers model, in order (from the
    family's name table)."""
    tables = convert.Tables(shape)
    before, after = tables.family.model_linears(shape)
    names = list(before)
    for layer in range(shape.num_layers):
        names += table.linear_modules(tables.layer(layer), convert.layer_prefix(shape, layer))
    return names + list(after)


def hf_expert_parameter_names(shape) -> List[str]:
    """Every routed-expert parameter peft's ``target_parameters`` can name, in order."""
    tables = convert.Tables(shape)
    return [n for layer in range(shape.num_layers)
            for n in table.expert_parameters(tables.layer(layer), convert.layer_prefix(shape, layer))]


def resolve_parameters(config, shape) -> List[str]:
    """The HF expert parameter names ``config.target_parameters`` selects (peft's matching: equal
    to an entry or ending in ``.entry``); ValueError naming an entry that matches none."""
    spec = config.target_parameters
    if not spec:
        return []
    if isinstance(spec, str):
        raise ValueError(f"target_parameters must be a list of parameter names, got the string {spec!r}")
    names = hf_expert_parameter_names(shape)
    for entry in spec:
        if not any(_matches([entry], n) for n in names):
            if names:
                params = " / ".join(dict.fromkeys(n.rsplit(".", 1)[1] for n in names))
                raise ValueError(f"target_parameters entry {entry!r} matches no routed-expert parameter of "
                                 f"this {shape.model_type} model (names like {names[0]!r}); only the "
                                 f"experts' {params} can be targeted by parameter here")
            raise ValueError(f"target_parameters entry {entry!r} matches no parameter: this "
                             f"{shape.model_type} model has no routed experts")
    return [n for n in names if _matches(list(spec), n)]


def _unsupported_reason(name: str, unsupported: Dict[str, str]) -> Optional[str]:
    for suffix, why in unsupported.items():
        if name == suffix or name.endswith("." + suffix):
            return why
    return None


def _matches(spec, name: str) -> bool:
    if isinstance(spec, str):
        return re.fullmatch(spec, name) is not None
    return any(name == t or name.endswith("." + t) for t in spec)


def resolve_targets(config, shape) -> List[str]:
    """The HF module names ``config.target_modules`` selects (minus ``exclude_modules``); raises
    ValueError naming an entry that matches nothing or a module that cannot carry LoRA. ``[]``
    when only ``target_parameters`` is set."""
    names = hf_linear_names(shape)
    unsupported = models.family(shape.model_type).lora_unsupported
    spec = config.target_modules
    if spec is None or (not isinstance(spec, str) and not spec and config.target_parameters):
        return []
    if isinstance(spec, str) and spec == "all-linear":
        chosen = [n for n in names if _unsupported_reason(n, unsupported) is None]
        skipped = sorted({n.rsplit("layers.", 1)[-1].split(".", 1)[-1] for n in names
                          if _unsupported_reason(n, unsupported) and "layers." in n})
        if skipped:
            logger.warning("target_modules='all-linear' leaves out %s (not supported here; peft's own "
                           "'all-linear' on transformers would adapt them)", ", ".join(skipped))
    else:
        spec = spec if isinstance(spec, str) else sorted(spec)
        if not isinstance(spec, str):
            for entry in spec:
                if not any(_matches([entry], n) for n in names):
                    raise ValueError(f"target_modules entry {entry!r} matches no module of this "
                                     f"{shape.model_type} model (names like {names[1]!r})")
        chosen = [n for n in names if _matches(spec, n)]
        if not chosen:
            raise ValueError(f"target_modules={config.target_modules!r} matches no module of this "
                             f"{shape.model_type} model (names like {names[1]!r})")
    exclude = config.exclude_modules
    if exclude:
        chosen = [n for n in chosen if not _matches(exclude if isinstance(exclude, str) else list(exclude), n)]
    for n in chosen:
        why = _unsupported_reason(n, unsupported)
        if why:
            raise ValueError(f"target_modules selects {n!r}: LoRA on {why} is not supported")
    if not chosen and not config.target_parameters:
        raise ValueError("target_modules minus exclude_modules selects no module")
    return chosen


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
                targets.append(lora_layers.LoraTarget(module.rsplit(".", 1)[1], full_name, in_full, n,
                                                      rows=rows, positions=positions))
        out_local = base.output_size_per_partition
    else:
        kind, in_full = "row", base.input_size
        full_name = prefix + modules[0]
        if full_name in chosen:
            targets.append(lora_layers.LoraTarget(modules[0].rsplit(".", 1)[1], full_name, in_full,
                                                  base.output_size, cols=_col_ids(entry, shape, in_full, tps)))
        out_local = base.output_size
    if not targets:
        return None
    full = {t.name: lora_layers.init_full(t, config.r, bool(config.init_lora_weights), seed) for t in targets}
    return lora_layers.LoraAdapter(kind, targets, full, r=config.r, scaling=scaling(config),
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
        target = lora_layers.LoraTarget(param, full_name, in_full, out_full, rows=ids,
                                        positions=torch.arange(ids[etp_rank].numel()))
        out_local = base.output_size_per_partition
    else:
        kind, in_full, out_full = "row", base.input_size, base.output_size
        target = lora_layers.LoraTarget(param, full_name, in_full, out_full,
                                        cols=_col_ids(entry, shape, in_full, etps))
        out_local = out_full
    if hf not in fused:
        fused[hf] = lora_layers.init_expert_full(hf, shape.num_experts, config.r, in_full, out_full,
                                                 bool(config.init_lora_weights), seed)
    full = {param: lora_layers.expert_factors(*fused[hf], expert, shape.num_experts)}
    return lora_layers.LoraAdapter(kind, [target], full, r=config.r, scaling=scaling(config), dropout=0.0,
                                   out_local=out_local, tp_rank=etp_rank, tp_size=etps,
                                   sequence_parallel=False, dtype=dtype, device=device, expert=True,
                                   group=group)


@dataclasses.dataclass
class Adapter:
    """What a MegatronModel keeps about its adapter."""
    name: str
    config: object                      # the checked peft.LoraConfig
    targets: List[str]                  # HF module names, all stages
    modules: List[lora_layers.LoraAdapter]
    handles: list
    gradient_accumulation_steps: int = 1
    trainable_params: int = 0           # whole model, all ranks (counted once, when added)
    total_params: int = 0
    parameters: List[str] = dataclasses.field(default_factory=list)   # HF expert parameters
    num_experts: int = 0
    # HF expert parameter -> its per-expert HF weights ("{e}" for the expert), from the name table
    expert_weights: Dict[str, List[str]] = dataclasses.field(default_factory=dict)


def add_adapter(model, adapter_name: str, config, gradient_accumulation_steps: int = 1) -> Adapter:
    """Freeze ``model``'s base weights and attach a LoRA adapter to its megatron linears (this
    rank's stages). See :meth:`MegatronModel.add_adapter_to_model`."""
    from megatron.core import parallel_state as ps
    if not isinstance(adapter_name, str) or not adapter_name:
        raise ValueError(f"adapter_name must be a non-empty string, got {adapter_name!r}")
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
        numbers = convert._layer_numbers(chunk)
        for name, base in chunk.named_modules():
            m = convert._LAYER.match(name)
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
                handles.append(lora_layers.attach(base, adapter))
                modules.append(adapter)
    # every targeted expert parameter's per-expert HF weights (for merged_delta), on every rank
    for layer in range(model.shape.num_layers):
        prefix = convert.layer_prefix(model.shape, layer)
        for entry in tables.layer(layer).values():
            if entry.expert and prefix + entry.fused in chosen_params:
                expert_weights[prefix + entry.fused] = [prefix + h for h in entry.hf]
    adapter = Adapter(adapter_name, config, sorted(chosen, key=hf_linear_names(model.shape).index),
                      modules, handles, gradient_accumulation_steps, parameters=chosen_params,
                      num_experts=model.shape.num_experts, expert_weights=expert_weights)
    # counted here, where every rank takes part, so get_train_configs stays local
    adapter.trainable_params, adapter.total_params = parameter_counts(model)
    return adapter


def parameter_counts(model) -> Tuple[int, int]:
    """(trainable, total) parameters of the whole model (all ranks; collective over the model-
    parallel group)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    counts = torch.zeros(2, dtype=torch.float64)
    for chunk in model.unwrapped_chunks():
        for p in chunk.parameters():
            if not param_is_not_tensor_parallel_duplicate(p):
                continue
            scale = model.mesh.ep_size if getattr(p, "allreduce", True) is False else 1
            counts += torch.tensor([p.numel() * p.requires_grad, p.numel()], dtype=torch.float64) * scale
    if dist.is_initialized() and ps.get_model_parallel_group().size() > 1:
        counts = counts.to(model.device)
        dist.all_reduce(counts, group=ps.get_model_parallel_group())
    return int(counts[0]), int(counts[1])


def expert_keys(adapter: Adapter) -> List[str]:
    """The per-expert keys of :func:`full_weights` (``<layer>.mlp.experts.<e>.gate_up_proj``)."""
    out = []
    for name in adapter.parameters:
        module, param = name.rsplit(".", 1)
        out += [f"{module}.{e}.{param}" for e in range(adapter.num_experts)]
    return out


def full_weights(adapter: Adapter, grads: bool = False) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """``{HF module name: (A, B)}`` fp32 CPU for the whole model, on every rank (collective over
    the world); routed experts under :func:`expert_keys` (expert ``e``'s ``(A_e, B_e)``);
    ``grads=True``: their gradients instead."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    mine = {}
    for m in adapter.modules:
        group = m.group if m.expert else ps.get_tensor_model_parallel_group()
        part = lora_layers.gather_full(m, group, grads=grads)
        first = (ps.get_expert_tensor_parallel_rank() if m.expert else ps.get_tensor_model_parallel_rank()) == 0
        if first:
            mine.update(part)
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, mine)
    out = {}
    for part in everything:
        out.update(part)
    missing = set(adapter.targets) | set(expert_keys(adapter))
    missing -= set(out)
    if missing:
        raise RuntimeError(f"adapter weights missing after the gather: {sorted(missing)[:4]}")
    return out


def _peft_expert_prefix(name: str, parameters: List[str]) -> str:
    """peft's key prefix of the adapter on expert parameter ``name`` (``<...>.mlp.experts.<param>``)
    when the expert parameters ``parameters`` (in transformers' registration order, as
    :func:`resolve_parameters` lists them) carry adapters: peft wraps the experts module once per
    targeted parameter, in registration order, so each earlier parameter's adapter sits one
    ``base_layer`` deeper per later one."""
    module = name.rsplit(".", 1)[0]
    later = [p for p in parameters[list(parameters).index(name) + 1:] if p.rsplit(".", 1)[0] == module]
    return f"base_model.model.{module}" + ".base_layer" * len(later)


def _expert_key(name: str, parameters) -> Optional[Tuple[str, int]]:
    """``(expert parameter, expert)`` of a :func:`expert_keys` name, else None."""
    m = _EXPERT_KEY.match(name)
    if m and f"{m.group(1)}.{m.group(3)}" in parameters:
        return f"{m.group(1)}.{m.group(3)}", int(m.group(2))
    return None


def peft_state_dict(full, parameters=()) -> Dict[str, torch.Tensor]:
    """PEFT's saved key names: ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``;
    routed experts (keys of :func:`expert_keys` for the HF expert ``parameters`` the adapter
    targets, ``Adapter.parameters``) fused per parameter as peft's ParamWrapper keeps them
    (A ``[r * E, in]``, B ``[out, r * E]``, see :func:`lora_layers.expert_factors`)."""
    parameters = list(parameters)
    out, experts = {}, {}
    for name, (a, b) in full.items():
        key = _expert_key(name, parameters)
        if key:
            experts.setdefault(key[0], {})[key[1]] = (a, b)
            continue
        out[f"base_model.model.{name}.lora_A.weight"] = a.contiguous()
        out[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
    for name, per in experts.items():
        if sorted(per) != list(range(len(per))):
            raise RuntimeError(f"{name}: adapters of experts {sorted(per)} only")
        a, b = lora_layers.fuse_experts([per[e] for e in range(len(per))])
        prefix = _peft_expert_prefix(name, [p for p in parameters if p in experts])
        out[f"{prefix}.lora_A.weight"] = a.contiguous()
        out[f"{prefix}.lora_B.weight"] = b.contiguous()
    return out


def from_peft_state_dict(tensors: Dict[str, torch.Tensor], parameters=(), num_experts: int = 0
                         ) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """Inverse of :func:`peft_state_dict`; ``parameters``: the HF expert parameters the adapter
    targets (their keys are read as peft nests them), ``num_experts`` their expert count."""
    tensors, out = dict(tensors), {}
    for name in parameters:
        prefix = _peft_expert_prefix(name, parameters)
        ka, kb = f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"
        if ka not in tensors or kb not in tensors:
            raise KeyError(f"adapter checkpoint has no {ka!r} / {kb!r} (for {name})")
        a, b = tensors.pop(ka).float(), tensors.pop(kb).float()
        if a.shape[0] % num_experts or b.shape[1] != a.shape[0]:
            raise ValueError(f"{name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} are not peft's "
                             f"fused factors of {num_experts} experts")
        module, param = name.rsplit(".", 1)
        for e in range(num_experts):
            out[f"{module}.{e}.{param}"] = lora_layers.expert_factors(a, b, e, num_experts)
    for key in tensors:
        m = re.fullmatch(r"base_model\.model\.(.+)\.lora_A(?:\.[^.]+)?\.weight", key)
        if m:
            b = key.replace(".lora_A", ".lora_B")
            if b not in tensors:
                raise KeyError(f"adapter checkpoint has {key!r} but no {b!r}")
            out[m.group(1)] = (tensors[key].float(), tensors[b].float())
    return out


def adapter_config_dict(adapter: Adapter, base_model_name_or_path) -> dict:
    """adapter_config.json contents: the user's config with target_modules resolved to the exact
    module names trained (so peft on transformers adapts exactly those)."""
    cfg = dataclasses.replace(adapter.config, target_modules=list(adapter.targets) or None, exclude_modules=None,
                              target_parameters=list(adapter.parameters) or None,
                              base_model_name_or_path=base_model_name_or_path, inference_mode=True)
    d = cfg.to_dict()
    for k, v in list(d.items()):
        if isinstance(v, set):
            d[k] = sorted(v)
    return d


def merged_delta(adapter: Adapter, full) -> Dict[str, torch.Tensor]:
    """``{HF weight name: scaling * B @ A}`` (fp32) to add to the base weights."""
    s = scaling(adapter.config)
    out = {}
    for name, (a, b) in full.items():
        delta = (b.double() @ a.double() * s).float()
        key = _expert_key(name, adapter.expert_weights)
        if key is None:
            out[name + ".weight"] = delta
            continue
        # the HF export names experts' weights one by one: the fused delta's row blocks
        weights = adapter.expert_weights[key[0]]
        for weight, part in zip(weights, delta.chunk(len(weights), 0)):
            out[weight.format(e=key[1])] = part
    return out


def load_weights(adapter: Adapter, full) -> None:
    unexpected = set(full) - set(adapter.targets) - set(expert_keys(adapter))
    if unexpected:
        raise ValueError(f"the adapter checkpoint has weights for modules this adapter does not "
                         f"target: {sorted(unexpected)[:4]}")
    for m in adapter.modules:
        lora_layers.load_full(m, full)
