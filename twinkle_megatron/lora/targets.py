"""Which Hugging Face modules and expert parameters a LoRA config targets, named as peft names them
on the transformers model; the candidates come from the model family's name table
(:mod:`twinkle_megatron.models`)."""
from __future__ import annotations

import logging
import re
from typing import Dict, List, Optional

from .. import convert, models
from ..models import table

logger = logging.getLogger(__name__)


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
    to an entry or ending in ``.entry``); ValueError naming an entry that matches none. Entries
    naming a linear module's weight (``model.layers.0.mlp.gate_proj.weight``, as the export writes
    the MLPs peft would otherwise rewrite) select that module: :func:`resolve_targets`."""
    spec = config.target_parameters
    if not spec:
        return []
    if isinstance(spec, str):
        raise ValueError(f"target_parameters must be a list of parameter names, got the string {spec!r}")
    names = hf_expert_parameter_names(shape)
    weights = [n + ".weight" for n in hf_linear_names(shape)]
    for entry in spec:
        if not any(_matches([entry], n) for n in names) and not any(_matches([entry], w) for w in weights):
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
    """The HF module names ``config.target_modules`` selects (minus ``exclude_modules``), and those
    whose weight ``config.target_parameters`` names; raises ValueError naming an entry that
    matches nothing or a module that cannot carry LoRA. ``[]`` when only routed-expert
    ``target_parameters`` are set."""
    names = hf_linear_names(shape)
    unsupported = models.family(shape.model_type).lora_unsupported
    spec = config.target_modules
    # linear modules named by their weight in target_parameters (peft adapts a 2-D weight there
    # with the same LoRA)
    by_weight = [n for n in names if config.target_parameters and not isinstance(config.target_parameters, str)
                 and _matches(list(config.target_parameters), n + ".weight")]
    if spec is None or (not isinstance(spec, str) and not spec and config.target_parameters):
        chosen = []
    elif isinstance(spec, str) and spec == "all-linear":
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
    picked = set(chosen) | set(by_weight)
    chosen = [n for n in names if n in picked]
    for n in chosen:
        why = _unsupported_reason(n, unsupported)
        if why:
            raise ValueError(f"target_modules selects {n!r}: LoRA on {why} is not supported")
    if not chosen and not config.target_parameters:
        raise ValueError("target_modules minus exclude_modules selects no module")
    return chosen
