"""The adapter's full (unsharded) weights, and peft's saved format of them: key names, routed
experts fused per parameter, ``adapter_config.json``; merged deltas for the HF export."""
from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Optional, Tuple

import torch

from . import layers as lora_layers
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


def load_weights(adapter: Adapter, full) -> None:
    unexpected = set(full) - set(adapter.targets) - set(expert_keys(adapter))
    if unexpected:
        raise ValueError(f"the adapter checkpoint has weights for modules this adapter does not "
                         f"target: {sorted(unexpected)[:4]}")
    for m in adapter.modules:
        lora_layers.load_full(m, full)
