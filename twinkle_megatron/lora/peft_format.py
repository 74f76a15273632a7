"""The adapter's full (unsharded) weights, and peft's saved format of them: key names, routed
experts fused per parameter, ``adapter_config.json``; merged deltas for the HF export."""
from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Dict, List, Optional, Tuple

import torch

from . import linear as lora_linear
from .adapter import Adapter
from .config import scaling

# ``<module>.<expert>.<parameter>``: one routed expert's adapter (see expert_keys)
_EXPERT_KEY = re.compile(r"^(.+)\.(\d+)\.([^.]+)$")


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
        part = lora_linear.gather_full(m, group, grads=grads)
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
    (A ``[r * E, in]``, B ``[out, r * E]``, see :func:`lora_linear.expert_factors`)."""
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
        a, b = lora_linear.fuse_experts([per[e] for e in range(len(per))])
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
            out[f"{module}.{e}.{param}"] = lora_linear.expert_factors(a, b, e, num_experts)
    for key in tensors:
        m = re.fullmatch(r"base_model\.model\.(.+)\.lora_A(?:\.[^.]+)?\.weight", key)
        if m:
            b = key.replace(".lora_A", ".lora_B")
            if b not in tensors:
                raise KeyError(f"adapter checkpoint has {key!r} but no {b!r}")
            out[m.group(1)] = (tensors[key].float(), tensors[b].float())
    return out


def peft_rewritten_targets(model_type: str, targets: List[str]) -> List[str]:
    """The module names of ``targets`` that the installed peft would not adapt as named when it
    reads an adapter config of a ``model_type`` model: peft (0.21, on transformers 5) rewrites the
    configs of model types whose checkpoints transformers converts like Mixtral's / Qwen2-MoE's
    (glm4_moe, deepseek_v3, qwen3_next, ...), taking every ``gate_proj`` / ``up_proj`` /
    ``down_proj`` target (whatever module it is: a dense or shared-expert MLP too) for a pre-fusion
    routed expert and moving it to the fused experts (or refusing a gate without its up). Asked of
    peft's own conversion (``convert_peft_config_for_transformers``) once per module leaf name,
    which is all it looks at; ``[]`` without peft or on transformers < 5 (nothing is rewritten)."""
    try:
        import types
        import peft
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:
        return []
    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type=model_type))
    rewritten = set()
    for leaf in dict.fromkeys(t.rsplit(".", 1)[-1] for t in targets):
        cfg = peft.LoraConfig(r=1, target_modules=[leaf])
        try:
            convert_peft_config_for_transformers(cfg, model=model, conversions=None)
        except ValueError:   # a fused half alone ("gate_proj without up_proj"): refused
            rewritten.add(leaf)
            continue
        if set(cfg.target_modules or ()) != {leaf} or cfg.target_parameters:
            rewritten.add(leaf)
    return [t for t in targets if t.rsplit(".", 1)[-1] in rewritten]


def adapter_config_dict(adapter: Adapter, base_model_name_or_path) -> dict:
    """adapter_config.json contents: the user's config with target_modules resolved to the exact
    module names trained (so peft on transformers adapts exactly those). Modules peft would
    rewrite as routed experts (:func:`peft_rewritten_targets`: the dense and shared-expert MLPs of
    glm4_moe, deepseek_v3, qwen3_next) are named by their weight in ``target_parameters`` instead
    (``model.layers.0.mlp.gate_proj.weight``): peft adapts a 2-D weight there with the same LoRA
    (``W + scaling * B @ A``, same saved keys) and leaves those entries alone. With
    ``lora_dropout`` it cannot (peft's ParamWrapper refuses dropout): they stay in
    ``target_modules`` with a UserWarning naming them and the peft version."""
    rewritten = set(peft_rewritten_targets(adapter.model_type, adapter.targets)) if adapter.model_type else set()
    if rewritten and float(adapter.config.lora_dropout) != 0.0:
        import peft
        names = sorted(rewritten, key=adapter.targets.index)
        warnings.warn(f"adapter {adapter.name!r}: peft {peft.__version__} reads the {adapter.model_type} "
                      f"adapter config's targets {', '.join(names[:4])}{' ...' if len(names) > 4 else ''} "
                      f"({len(names)} modules) as routed experts, and with lora_dropout={adapter.config.lora_dropout} "
                      "they cannot be named by weight in target_parameters instead (peft refuses dropout there): "
                      "PeftModel.from_pretrained will not load them as trained; save with lora_dropout=0 "
                      "(or leave those MLPs untargeted) for a peft-loadable adapter", UserWarning, stacklevel=2)
        rewritten = set()
    modules = [t for t in adapter.targets if t not in rewritten]
    parameters = list(adapter.parameters) + [t + ".weight" for t in adapter.targets if t in rewritten]
    cfg = dataclasses.replace(adapter.config, target_modules=modules or None, exclude_modules=None,
                              target_parameters=parameters or None,
                              base_model_name_or_path=base_model_name_or_path, inference_mode=True)
    d = cfg.to_dict()
    for k, v in list(d.items()):
        if isinstance(v, set):
            d[k] = sorted(v)
    return d


class MergedDeltas:
    """``{HF weight name: scaling * B @ A}`` (fp32), computed one weight at a time when asked
    (``deltas[name]``), so merging never holds more than one weight's delta; ``full``: the
    adapter's :func:`full_weights`."""

    def __init__(self, adapter: Adapter, full):
        self.full, self.scaling = full, scaling(adapter.config)
        self._where: Dict[str, Tuple[str, int, int]] = {}   # HF weight -> (full key, part, parts)
        for name in full:
            key = _expert_key(name, adapter.expert_weights)
            if key is None:
                self._where[name + ".weight"] = (name, 0, 1)
                continue
            # the HF export names experts' weights one by one: the fused delta's row blocks
            weights = adapter.expert_weights[key[0]]
            for i, weight in enumerate(weights):
                self._where[weight.format(e=key[1])] = (name, i, len(weights))

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __getitem__(self, name: str) -> torch.Tensor:
        key, part, parts = self._where[name]
        a, b = self.full[key]
        delta = (b.double() @ a.double() * self.scaling).float()
        return delta.chunk(parts, 0)[part] if parts > 1 else delta

    def merge(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` (HF ``name``) with its delta added in fp32, back in ``weight.dtype``; a new
        tensor (``weight`` is never changed); ``weight`` itself when the adapter leaves it alone."""
        if name not in self._where:
            return weight
        return (weight.float() + self[name]).to(weight.dtype)


def merged_delta(adapter: Adapter, full) -> Dict[str, torch.Tensor]:
    """``{HF weight name: scaling * B @ A}`` (fp32) to add to the base weights, all at once
    (:class:`MergedDeltas` computes them one at a time)."""
    deltas = MergedDeltas(adapter, full)
    return {name: deltas[name] for name in deltas}


def read_adapter_file(path: str) -> Dict[str, torch.Tensor]:
    """Every tensor of a PEFT ``adapter_model.safetensors``; a file safetensors cannot read
    (truncated, corrupted, not safetensors) is a ValueError naming ``path``."""
    from safetensors.torch import load_file
    try:
        return load_file(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"adapter weights file {path!r} is missing") from None
    except Exception as e:   # safetensors' own error type does not name the file
        raise ValueError(f"cannot read adapter weights file {path!r} (truncated or corrupted?): {e}") from None


def check_weights(adapter: Adapter, full) -> None:
    """That ``full`` (:func:`from_peft_state_dict`) fits ``adapter`` exactly: no module it does not
    target, every target present, A ``[r, in]`` and B ``[out, r]`` floating point. Changes nothing
    (:func:`load_weights` runs it before its first copy)."""
    unexpected = set(full) - set(adapter.targets) - set(expert_keys(adapter))
    if unexpected:
        raise ValueError(f"the adapter checkpoint has weights for modules this adapter does not "
                         f"target: {sorted(unexpected)[:4]}")
    for m in adapter.modules:
        for t in m.targets:
            if t.full_name not in full:
                raise KeyError(f"the adapter checkpoint has no weights for {t.full_name!r}")
            a, b = full[t.full_name]
            if tuple(a.shape) != (m.r, t.in_features) or tuple(b.shape) != (t.out_features, m.r):
                raise ValueError(f"{t.full_name}: checkpoint gives A {tuple(a.shape)}, B {tuple(b.shape)}; "
                                 f"this adapter has A ({m.r}, {t.in_features}), B ({t.out_features}, {m.r})")
            if not (a.is_floating_point() and b.is_floating_point()):
                raise ValueError(f"{t.full_name}: checkpoint gives A {a.dtype}, B {b.dtype}; LoRA factors "
                                 "are floating point")


def load_weights(adapter: Adapter, full) -> None:
    """Copy ``full`` into ``adapter``'s shards, after :func:`check_weights` (so a misfit changes
    nothing)."""
    check_weights(adapter, full)
    for m in adapter.modules:
        lora_linear.load_full(m, full)
