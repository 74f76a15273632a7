"""Adapter checkpoints of a MegatronModel with LoRA, in PEFT's own format, saved and loaded by
the atomic core (:mod:`.core`).

Layout of ``<output_dir>/<name>/``::

    adapter_config.json          peft's LoraConfig (target_modules: the exact HF modules trained)
    adapter_model.safetensors    base_model.model.<module>.lora_A.weight / lora_B.weight, fp32
                                 (routed experts: peft's fused ParamWrapper keys)
    trainer_state.json           {'cur_step', 'consumed_train_samples', 'adapter_name', 'mesh', ...}
    optimizer/rank00000.pt ...   (save_optimizer) optimizer, lr scheduler and RNG state per rank
    dist_ckpt/ ...               (save_optimizer, sharded=True) instead of optimizer/: the adapter's
                                 parameters, optimizer, scheduler and RNG, megatron's torch_dist

    manifest.json                size and sha256 of every file above; written last

``peft.PeftModel.from_pretrained(transformers_model, path)`` loads the directory as it is. Any
PEFT LoRA directory for the same targets loads too (weights only: it has no manifest).
"""
from __future__ import annotations

import json
import os
from typing import Optional

from .. import lora
from ..lora import peft_format
from ..validate import read_json
from . import core

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def is_adapter_dir(path) -> bool:
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def check_save_args(model, adapter_name, merge_lora: bool):
    """Validate ``save``'s adapter arguments; returns the merge deltas (a
    :class:`~twinkle_megatron.lora.MergedDeltas`) for ``merge_lora``, else None. Collective when
    merging (the adapter is gathered)."""
    if adapter_name is not None and not isinstance(adapter_name, str):
        raise TypeError(f"adapter_name must be a string or None, got {type(adapter_name).__name__}")
    if adapter_name is not None and adapter_name not in model.adapters:
        have = ", ".join(f"adapter {n!r}" for n in model.adapters) or "no adapter"
        raise ValueError(f"adapter_name={adapter_name!r}: this model has {have}")
    if merge_lora and not model.adapters:
        raise ValueError("merge_lora=True needs an adapter (add_adapter_to_model first)")
    if merge_lora:
        adapter = adapter_of(model, adapter_name)
        return lora.MergedDeltas(adapter, lora.full_weights(adapter))
    return None


def adapter_of(model, adapter_name: Optional[str]):
    """The model's adapter ``adapter_name`` (None: its only one)."""
    return model.adapters[adapter_name] if adapter_name is not None else next(iter(model.adapters.values()))


class AdapterCheckpoint(core.CheckpointFormat):
    """The LoRA adapter named ``adapter_name`` (None: the model's only one) as a PEFT directory."""

    def __init__(self, adapter_name: Optional[str] = None):
        self.adapter_name = adapter_name

    def write_rank_files(self, model, tmp):
        # gathered on every rank (collective); rank 0 writes it in write_shared_files
        self._adapter = adapter_of(model, self.adapter_name)
        self._full = lora.full_weights(self._adapter)
        return [], None

    def write_shared_files(self, model, tmp, payloads, save_optimizer):
        from safetensors.torch import save_file
        adapter = self._adapter
        save_file(lora.peft_state_dict(self._full, adapter.parameters), os.path.join(tmp, ADAPTER_WEIGHTS),
                  metadata={"format": "pt"})
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
            json.dump(lora.adapter_config_dict(adapter, model.model_dir), f, indent=2, sort_keys=True)
        core.write_json(os.path.join(tmp, core.TRAINER_STATE), core.trainer_state(
            model, save_optimizer, self.sharded, adapter_name=adapter.name,
            accumulated_calls=model.accumulated_calls))

    def sharded_adapter(self, model):
        return adapter_of(model, self.adapter_name)

    def needs_manifest(self, path):
        # a directory this format wrote has a manifest (or at least a trainer state); one that
        # peft wrote has neither and loads as weights only
        return (os.path.isfile(os.path.join(path, core.MANIFEST))
                or os.path.isfile(os.path.join(path, core.TRAINER_STATE)))

    def prepare(self, model, path, load_optimizer):
        adapter_name = self.adapter_name
        if not is_adapter_dir(path):
            raise FileNotFoundError(f"{path!r} is not an adapter directory (no {ADAPTER_CONFIG})")
        if not model.adapters:
            raise ValueError(f"adapter_name={adapter_name!r}: {path!r} holds a LoRA adapter; call "
                             "add_adapter_to_model (same config) before loading it")
        state = {}
        if os.path.isfile(os.path.join(path, core.TRAINER_STATE)):
            state = read_json(os.path.join(path, core.TRAINER_STATE), "adapter trainer state")
        saved_name = state.get("adapter_name")
        if adapter_name is not None and adapter_name not in model.adapters:
            raise ValueError(f"adapter_name={adapter_name!r}: this model's adapter is "
                             f"{', '.join(repr(n) for n in model.adapters)}")
        adapter = adapter_of(model, adapter_name)
        if adapter_name is not None and saved_name is not None and adapter_name != saved_name:
            raise ValueError(f"adapter_name={adapter_name!r}: {path!r} holds adapter {saved_name!r}")
        saved_cfg = read_json(os.path.join(path, ADAPTER_CONFIG), "adapter config")
        mine = adapter.config
        for key in ("r", "lora_alpha", "use_rslora"):
            if saved_cfg.get(key) != getattr(mine, key):
                raise ValueError(f"{path!r} was saved with {key}={saved_cfg.get(key)!r}, this adapter has "
                                 f"{key}={getattr(mine, key)!r}")
        restore = core.Restore(core.progress(state))
        full = lora.from_peft_state_dict(peft_format.read_adapter_file(os.path.join(path, ADAPTER_WEIGHTS)),
                                         adapter.parameters, adapter.num_experts)
        peft_format.check_weights(adapter, full)   # every target present, every shape this adapter's
        restore.then(lambda: lora.load_weights(adapter, full))
        if core.prepare_training_state(model, path, state, load_optimizer, restore, adapter):
            calls = int(state.get("accumulated_calls", 0))
            restore.then(lambda: setattr(model, "accumulated_calls", calls))
        return restore
