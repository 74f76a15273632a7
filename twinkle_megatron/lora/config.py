"""The LoRA config: a checked ``peft.LoraConfig`` and its scaling."""
from __future__ import annotations

import dataclasses
import math

# LoraConfig fields this implementation honours (or that carry no behaviour); any other field set
# away from peft's default is refused with its name.
_HONOURED = {"r", "lora_alpha", "lora_dropout", "use_rslora", "bias", "init_lora_weights",
             "target_modules", "exclude_modules", "task_type", "peft_type", "auto_mapping",
             "peft_version", "base_model_name_or_path", "revision", "inference_mode", "runtime_config",
             "megatron_core", "target_parameters"}

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
