"""Adapter checkpoints of a MegatronModel with LoRA, in PEFT's own format.

Layout of ``<output_dir>/<name>/``::

    adapter_config.json          peft's LoraConfig (target_modules: the exact HF modules trained)
    adapter_model.safetensors    base_model.model.<module>.lora_A.weight / lora_B.weight, fp32
                                 (routed experts: peft's fused ParamWrapper keys)
    trainer_state.json           {'cur_step', 'consumed_train_samples', 'adapter_name', 'mesh', ...}
    optimizer/rank00000.pt ...   (save_optimizer) optimizer, lr scheduler and RNG state per rank

    manifest.json                size and sha256 of every file above; written last

``peft.PeftModel.from_pretrained(transformers_model, path)`` loads the directory as it is. Written
as ``<name>.tmp`` and swapped into place once every rank is done, verified and loaded
``weights_only`` on resume, like :mod:`twinkle_megatron.checkpoint` (whose helpers it uses).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, Optional

import torch.distributed as dist

from . import checkpoint, lora
from .validate import read_json

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_STATE = "trainer_state.json"


def is_adapter_dir(path) -> bool:
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def check_save_args(model, adapter_name, merge_lora: bool):
    """Validate ``save``'s adapter arguments; returns the merge deltas for ``merge_lora`` (else
    None). Collective when merging (the adapter is gathered)."""
    if adapter_name is not None and not isinstance(adapter_name, str):
        raise TypeError(f"adapter_name must be a string or None, got {type(adapter_name).__name__}")
    if adapter_name is not None and adapter_name not in model.adapters:
        have = ", ".join(f"adapter {n!r}" for n in model.adapters) or "no adapter"
        raise ValueError(f"adapter_name={adapter_name!r}: this model has {have}")
    if merge_lora and not model.adapters:
        raise ValueError("merge_lora=True needs an adapter (add_adapter_to_model first)")
    if merge_lora:
        adapter = _adapter(model, adapter_name)
        return lora.merged_delta(adapter, lora.full_weights(adapter))
    return None


def _adapter(model, adapter_name: Optional[str]):
    """The model's adapter ``adapter_name`` (None: its only one)."""
    return model.adapters[adapter_name] if adapter_name is not None else next(iter(model.adapters.values()))


def save(model, name: str, output_dir: str, save_optimizer: bool, consumed_train_samples=None,
         adapter_name: Optional[str] = None) -> str:
    """Write the directory of adapter ``adapter_name`` (None: the model's only one; collective).
    Returns its path."""
    from safetensors.torch import save_file
    if save_optimizer and model.optimizer is None:
        raise RuntimeError("save_optimizer=True but no optimizer was set")
    final = os.path.join(output_dir, name)
    tmp = checkpoint.begin_save(final)
    adapter = _adapter(model, adapter_name)
    full = lora.full_weights(adapter)
    written = [checkpoint.save_rank_state(model, tmp)] if save_optimizer else []
    if consumed_train_samples is not None:
        model.consumed_train_samples = int(consumed_train_samples)

    def finish(_):   # rank 0, once every rank's optimizer file is on disk
        save_file(lora.peft_state_dict(full, adapter.parameters), os.path.join(tmp, ADAPTER_WEIGHTS),
                  metadata={"format": "pt"})
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
            json.dump(lora.adapter_config_dict(adapter, model.model_dir), f, indent=2, sort_keys=True)
        with open(os.path.join(tmp, _STATE), "w") as f:
            json.dump({"cur_step": model.cur_step, "consumed_train_samples": model.consumed_train_samples,
                       "has_optimizer": bool(save_optimizer), "adapter_name": adapter.name,
                       "accumulated_calls": model._accumulated_calls,
                       "mesh": dataclasses.asdict(model.mesh)}, f, indent=2)

    return checkpoint.commit_save(tmp, final, written, None, finish)


def load(model, path: str, load_optimizer: bool = True, adapter_name: Optional[str] = None) -> Dict[str, int]:
    """Restore the adapter weights (and, with ``load_optimizer``, the optimizer / scheduler / RNG
    state) saved by :func:`save`, or any PEFT LoRA directory for the same targets (weights only).

    Collective. A directory written by :func:`save` (it has a manifest, or a trainer state) is
    verified like :func:`twinkle_megatron.checkpoint.load` before anything is read; optimizer state
    is unpickled with ``weights_only=True``; a failure on any rank raises on every rank."""
    checkpoint.recover(path)
    if os.path.isfile(os.path.join(path, checkpoint.MANIFEST)) or os.path.isfile(os.path.join(path, _STATE)):
        checkpoint.verify(path, load_optimizer)
    return checkpoint.agreed(lambda: _load(model, path, load_optimizer, adapter_name))


def _load(model, path, load_optimizer, adapter_name):
    from safetensors.torch import load_file
    if not is_adapter_dir(path):
        raise FileNotFoundError(f"{path!r} is not an adapter directory (no {ADAPTER_CONFIG})")
    if not model.adapters:
        raise ValueError(f"adapter_name={adapter_name!r}: {path!r} holds a LoRA adapter; call "
                         "add_adapter_to_model (same config) before loading it")
    state = {}
    if os.path.isfile(os.path.join(path, _STATE)):
        state = read_json(os.path.join(path, _STATE), "adapter trainer state")
    saved_name = state.get("adapter_name")
    if adapter_name is not None and adapter_name not in model.adapters:
        raise ValueError(f"adapter_name={adapter_name!r}: this model's adapter is "
                         f"{', '.join(repr(n) for n in model.adapters)}")
    adapter = _adapter(model, adapter_name)
    if adapter_name is not None and saved_name is not None and adapter_name != saved_name:
        raise ValueError(f"adapter_name={adapter_name!r}: {path!r} holds adapter {saved_name!r}")
    saved_cfg = read_json(os.path.join(path, ADAPTER_CONFIG), "adapter config")
    mine = adapter.config
    for key in ("r", "lora_alpha", "use_rslora"):
        if saved_cfg.get(key) != getattr(mine, key):
            raise ValueError(f"{path!r} was saved with {key}={saved_cfg.get(key)!r}, this adapter has "
                             f"{key}={getattr(mine, key)!r}")
    full = lora.from_peft_state_dict(load_file(os.path.join(path, ADAPTER_WEIGHTS)),
                                     adapter.parameters, adapter.num_experts)
    lora.load_weights(adapter, full)
    if load_optimizer:
        if not state.get("has_optimizer"):
            raise ValueError(f"{path!r} was saved without optimizer state (save_optimizer=False)")
        if model.optimizer is None:
            raise RuntimeError("call set_optimizer (and set_lr_scheduler) before resuming optimizer state")
        if state["mesh"] != dataclasses.asdict(model.mesh):
            raise ValueError(f"optimizer state was saved with mesh {state['mesh']}, this run uses "
                             f"{dataclasses.asdict(model.mesh)}: resume with resume_only_model=True")
        blob = checkpoint.load_rank_state(os.path.join(path, "optimizer", f"rank{dist.get_rank():05d}.pt"))
        checkpoint._restore_optimizer(model.optimizer, blob["optimizer"])
        if blob["lr_scheduler"] is not None and model.lr_scheduler is not None:
            model.lr_scheduler.load_state_dict(blob["lr_scheduler"])
        checkpoint._set_rng_state(blob["rng"])
        model.cur_step = int(state["cur_step"])
        model.consumed_train_samples = int(state["consumed_train_samples"])
        model._accumulated_calls = int(state.get("accumulated_calls", 0))
    elif model.optimizer is not None:
        model.optimizer.reload_model_params()
    return {"consumed_train_samples": int(state.get("consumed_train_samples", 0)),
            "cur_step": int(state.get("cur_step", 0))}
