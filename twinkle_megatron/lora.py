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

from . import convert
from .layers import lora as lora_layers

logger = logging.getLogger(__name__)

# Hugging Face linears (suffix after the layer prefix) this module cannot adapt, and why.
UNSUPPORTED = {
    "mlp.gate": "the MoE router (megatron's TopKRouter applies its weight directly, not through a linear layer)",
    "mlp.experts": "routed experts through target_modules (transformers keeps them as fused "
                   "parameters: target them with target_parameters=['mlp.experts.gate_up_proj', "
                   "'mlp.experts.down_proj'], as peft does)",
    "mlp.shared_expert_gate": "the shared-expert gate (megatron applies its weight directly)",
    "embed_tokens": "the embeddings",
    "lm_head": "the LM head",
}
# LoraConfig fields this implementation honours (or that carry no behaviour); any other field set
# away from peft's default is refused with its name.
_HONOURED = {"r", "lora_alpha", "lora_dropout", "use_rslora", "bias", "init_lora_weights",
             "target_modules", "exclude_modules", "task_type", "peft_type", "auto_mapping",
             "peft_version", "base_model_name_or_path", "revision", "inference_mode", "runtime_config",
             "megatron_core", "target_parameters"}
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")   # transformers' fused expert parameters, in
# registration order (peft nests its ParamWrappers in this order; see peft_state_dict)

_COLUMN = {"self_attention.linear_qkv", "mlp.linear_fc1", "mlp.shared_experts.linear_fc1"}
_ROW = {"self_attention.linear_proj": "self_attn.o_proj", "mlp.linear_fc2": "mlp.down_proj",
        "mlp.shared_experts.linear_fc2": "mlp.shared_expert.down_proj"}
_EXPERT_MODULE = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)$")
_EXPERT_KEY = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate_up_proj|down_proj)$")
_MODULE = re.compile(r"^decoder\.layers\.(\d+)\.(self_attention\.linear_qkv|self_attention\.linear_proj|"
                     r"self_attention\.in_proj|self_attention\.out_proj|mlp\.linear_fc1|mlp\.linear_fc2|"
                     r"mlp\.shared_experts\.linear_fc1|mlp\.shared_experts\.linear_fc2)$")


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
    """Every linear module name peft would see on the transformers model, in order."""
    names = [shape.hf_prefix + "embed_tokens"]
    for layer in range(shape.num_layers):
        p = f"{shape.hf_prefix}layers.{layer}."
        if shape.is_linear(layer):
            names += [p + f"linear_attn.{x}" for x in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")]
        else:
            names += [p + f"self_attn.{x}_proj" for x in "qkvo"]
        if shape.num_experts:
            names += [p + "mlp.gate", p + "mlp.experts"]
            if shape.shared_expert_intermediate_size:
                names += [p + f"mlp.shared_expert.{x}_proj" for x in ("gate", "up", "down")]
                names.append(p + "mlp.shared_expert_gate")
        else:
            names += [p + f"mlp.{x}_proj" for x in ("gate", "up", "down")]
    return names + ["lm_head"]


def hf_expert_parameter_names(shape) -> List[str]:
    """Every routed-expert parameter peft's ``target_parameters`` can name, in order."""
    if not shape.num_experts:
        return []
    return [f"{shape.hf_prefix}layers.{layer}.mlp.experts.{x}" for layer in range(shape.num_layers)
            for x in EXPERT_PARAMETERS]


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
            what = (f"routed-expert parameter of this {shape.model_type} model (names like {names[0]!r})"
                    if names else f"parameter: this {shape.model_type} model has no routed experts")
            raise ValueError(f"target_parameters entry {entry!r} matches no {what}; only the experts' "
                             f"{' / '.join(EXPERT_PARAMETERS)} can be targeted by parameter here")
    return [n for n in names if _matches(list(spec), n)]


def _unsupported_reason(name: str) -> Optional[str]:
    for suffix, why in UNSUPPORTED.items():
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
    spec = config.target_modules
    if spec is None or (not isinstance(spec, str) and not spec and config.target_parameters):
        return []
    if isinstance(spec, str) and spec == "all-linear":
        chosen = [n for n in names if _unsupported_reason(n) is None]
        skipped = sorted({n.rsplit("layers.", 1)[-1].split(".", 1)[-1] for n in names
                          if _unsupported_reason(n) and "layers." in n})
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
        why = _unsupported_reason(n)
        if why:
            raise ValueError(f"target_modules selects {n!r}: LoRA on {why} is not supported")
    if not chosen and not config.target_parameters:
        raise ValueError("target_modules minus exclude_modules selects no module")
    return chosen


def _column_layout(shape, module: str, prefix: str, out_full: int, tps: int):
    """``[(suffix, out_rows)]`` of the HF targets inside a column-parallel ``module`` and, per TP
    rank, the target-tagged HF row ids its local output rows hold (``offset_t + row``)."""
    ar = torch.arange
    if module == "self_attention.linear_qkv":
        kv = shape.num_kv_heads * shape.head_dim
        nq = out_full - 2 * kv
        targets = [("self_attn.q_proj", nq), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)]
        q, k, v = ar(nq), ar(kv) + nq, ar(kv) + nq + kv
        if shape.attention_output_gate:
            q, gate = convert._q_and_gate(shape, q)
            full = convert._fused_qkv(shape, q, k, v, gate)
        else:
            full = convert._fused_qkv(shape, q, k, v)
        return targets, [convert._shard(full, 0, r, tps) for r in range(tps)]
    if module in ("mlp.linear_fc1", "mlp.shared_experts.linear_fc1"):
        mlp = "mlp." if module == "mlp.linear_fc1" else "mlp.shared_expert."
        n = out_full // 2
        targets = [(mlp + "gate_proj", n), (mlp + "up_proj", n)]
        return targets, [convert._shard_sections([ar(n), ar(n) + n], r, tps) for r in range(tps)]
    if module == "self_attention.in_proj":   # Gated DeltaNet
        qk, _, v, z, b, a = convert._gdn_sections(shape, "in_proj")
        targets = [("linear_attn.in_proj_qkv", 2 * qk + v), ("linear_attn.in_proj_z", z),
                   ("linear_attn.in_proj_b", b), ("linear_attn.in_proj_a", a)]
        off = 2 * qk + v
        parts = list(ar(off).split([qk, qk, v])) + [ar(z) + off, ar(b) + off + z, ar(a) + off + z + b]
        return targets, [convert._shard_sections(parts, r, tps) for r in range(tps)]
    raise KeyError(module)


def _build(base, module: str, layer: int, shape, chosen: set, config, seed, tp_rank, tps, sp, dtype, device):
    """The LoraAdapter for one megatron linear, or None when no chosen target lives in it."""
    prefix = f"{shape.hf_prefix}layers.{layer}."
    targets = []
    if module in _COLUMN or module == "self_attention.in_proj":
        kind, out_full, in_full = "column", base.output_size_per_partition * tps, base.input_size
        layout, ids = _column_layout(shape, module, prefix, out_full, tps)
        offset = 0
        for suffix, n in layout:
            full_name = prefix + suffix
            if full_name in chosen:
                rows = [(i[(i >= offset) & (i < offset + n)] - offset) for i in ids]
                positions = ((ids[tp_rank] >= offset) & (ids[tp_rank] < offset + n)).nonzero().reshape(-1)
                targets.append(lora_layers.LoraTarget(suffix.rsplit(".", 1)[1], full_name, in_full, n,
                                                      rows=rows, positions=positions))
            offset += n
        out_local = base.output_size_per_partition
    else:
        kind, in_full = "row", base.input_size
        suffix = "linear_attn.out_proj" if module == "self_attention.out_proj" else _ROW[module]
        full_name = prefix + suffix
        if full_name in chosen:
            cols = [convert._shard(torch.arange(in_full), 0, r, tps) for r in range(tps)]
            targets.append(lora_layers.LoraTarget(suffix.rsplit(".", 1)[1], full_name, in_full,
                                                  base.output_size, cols=cols))
        out_local = base.output_size
    if not targets:
        return None
    full = {t.name: lora_layers.init_full(t, config.r, bool(config.init_lora_weights), seed) for t in targets}
    return lora_layers.LoraAdapter(kind, targets, full, r=config.r, scaling=scaling(config),
                                   dropout=float(config.lora_dropout), out_local=out_local,
                                   tp_rank=tp_rank, tp_size=tps, sequence_parallel=sp, dtype=dtype,
                                   device=device)


def _build_expert(base, which: str, layer: int, expert: int, shape, chosen: set, config, fused: dict,
                  seed, etp_rank, etps, group, dtype, device):
    """The LoraAdapter of global expert ``expert``'s ``linear_fc1`` / ``linear_fc2`` (``which``),
    or None when its parameter is not targeted. ``fused``: a cache of peft's fused initial factors
    per HF parameter (built once, so every rank slices the same full matrices)."""
    param = "gate_up_proj" if which == "linear_fc1" else "down_proj"
    hf = f"{shape.hf_prefix}layers.{layer}.mlp.experts.{param}"
    if hf not in chosen:
        return None
    if which == "linear_fc1":
        kind, out_full, in_full = "column", base.output_size_per_partition * etps, base.input_size
        n = out_full // 2
        ids = [convert._shard_sections([torch.arange(n), torch.arange(n) + n], r, etps) for r in range(etps)]
        target = lora_layers.LoraTarget(param, f"{shape.hf_prefix}layers.{layer}.mlp.experts.{expert}.{param}",
                                        in_full, out_full, rows=ids, positions=torch.arange(ids[etp_rank].numel()))
        out_local = base.output_size_per_partition
    else:
        kind, in_full, out_full = "row", base.input_size, base.output_size
        cols = [convert._shard(torch.arange(in_full), 0, r, etps) for r in range(etps)]
        target = lora_layers.LoraTarget(param, f"{shape.hf_prefix}layers.{layer}.mlp.experts.{expert}.{param}",
                                        in_full, out_full, cols=cols)
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
    modules, handles, fused = [], [], {}
    for chunk in model.unwrapped_chunks():
        for p in chunk.parameters():
            p.requires_grad_(False)
        numbers = convert._layer_numbers(chunk)
        for name, base in chunk.named_modules():
            m = _EXPERT_MODULE.match(name)
            if m and chosen_params:
                per_rank = model.shape.num_experts // ps.get_expert_model_parallel_world_size()
                expert = ps.get_expert_model_parallel_rank() * per_rank + int(m.group(2))
                adapter = _build_expert(base, m.group(3), numbers[int(m.group(1))], expert, model.shape,
                                        set(chosen_params), config, fused, model.seed,
                                        ps.get_expert_tensor_parallel_rank(),
                                        ps.get_expert_tensor_parallel_world_size(),
                                        ps.get_expert_tensor_parallel_group(), model.dtype, model.device)
                if adapter is not None:
                    handles.append(lora_layers.attach(base, adapter))
                    modules.append(adapter)
                continue
            m = _MODULE.match(name)
            if not m:
                continue
            layer = numbers[int(m.group(1))]
            adapter = _build(base, m.group(2), layer, model.shape, chosen, config, model.seed, tp_rank,
                             tps, sp, model.dtype, model.device)
            if adapter is not None:
                handles.append(lora_layers.attach(base, adapter))
                modules.append(adapter)
    adapter = Adapter(adapter_name, config, sorted(chosen, key=hf_linear_names(model.shape).index),
                      modules, handles, gradient_accumulation_steps, parameters=chosen_params,
                      num_experts=model.shape.num_experts)
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


def _peft_expert_prefix(name: str, targeted) -> str:
    """peft's key prefix of the adapter on expert parameter ``name`` (``<...>.mlp.experts.<param>``)
    when ``targeted`` expert parameters carry adapters: peft wraps the experts module once per
    targeted parameter, in registration order, so each earlier parameter's adapter sits one
    ``base_layer`` deeper per later one."""
    module, param = name.rsplit(".", 1)
    later = [p for p in EXPERT_PARAMETERS[EXPERT_PARAMETERS.index(param) + 1:] if f"{module}.{p}" in targeted]
    return f"base_model.model.{module}" + ".base_layer" * len(later)


def peft_state_dict(full) -> Dict[str, torch.Tensor]:
    """PEFT's saved key names: ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``;
    routed experts fused per parameter as peft's ParamWrapper keeps them (A ``[r * E, in]``,
    B ``[out, r * E]``, see :func:`lora_layers.expert_factors`)."""
    out, experts = {}, {}
    for name, (a, b) in full.items():
        m = _EXPERT_KEY.match(name)
        if m:
            experts.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = (a, b)
            continue
        out[f"base_model.model.{name}.lora_A.weight"] = a.contiguous()
        out[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
    for name, per in experts.items():
        if sorted(per) != list(range(len(per))):
            raise RuntimeError(f"{name}: adapters of experts {sorted(per)} only")
        a, b = lora_layers.fuse_experts([per[e] for e in range(len(per))])
        prefix = _peft_expert_prefix(name, experts)
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
        m = _EXPERT_KEY.match(name)
        if m is None:
            out[name + ".weight"] = delta
        elif m.group(3) == "gate_up_proj":   # the HF export names experts' weights one by one
            gate, up = delta.chunk(2, 0)
            out[f"{m.group(1)}.{m.group(2)}.gate_proj.weight"] = gate
            out[f"{m.group(1)}.{m.group(2)}.up_proj.weight"] = up
        else:
            out[f"{m.group(1)}.{m.group(2)}.down_proj.weight"] = delta
    return out


def load_weights(adapter: Adapter, full) -> None:
    unexpected = set(full) - set(adapter.targets) - set(expert_keys(adapter))
    if unexpected:
        raise ValueError(f"the adapter checkpoint has weights for modules this adapter does not "
                         f"target: {sorted(unexpected)[:4]}")
    for m in adapter.modules:
        lora_layers.load_full(m, full)
