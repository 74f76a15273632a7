"""Checkpoints of a MegatronModel: HF-format weights plus per-rank optimizer/scheduler/RNG state.

Layout of ``<output_dir>/<name>/``::

    config.json                      the Hugging Face config
    model.safetensors.index.json     weight map over the files below (transformers loads this)
    model-rank00000.safetensors ...  one file per rank that owns unique weights
    trainer_state.json               {'cur_step', 'consumed_train_samples', 'mesh', ...}
    optimizer/rank00000.pt ...       (save_optimizer) optimizer, lr scheduler and RNG state

The directory is written as ``<name>.tmp`` and renamed into place only after every rank has
finished, so a crash part-way never leaves a checkpoint that looks complete. Optimizer state is
per rank: resuming it needs the same mesh (checked).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Dict

import torch
import torch.distributed as dist

from . import convert

_TRAINER_STATE = "trainer_state.json"


def _inner_optimizers(opt):
    return getattr(opt, "chained_optimizers", [opt])


def _optimizer_snapshot(opt) -> list:
    out = []
    for o in _inner_optimizers(opt):
        inner = o.optimizer
        params = [p.detach().clone() for g in inner.param_groups for p in g["params"]]
        out.append({"state": inner.state_dict(), "main_params": params})
    return out


@torch.no_grad()
def _restore_optimizer(opt, snapshot: list) -> None:
    optimizers = _inner_optimizers(opt)
    if len(optimizers) != len(snapshot):
        raise ValueError(f"checkpoint has {len(snapshot)} optimizers, this model has {len(optimizers)}")
    for o, snap in zip(optimizers, snapshot):
        inner = o.optimizer
        params = [p for g in inner.param_groups for p in g["params"]]
        if len(params) != len(snap["main_params"]):
            raise ValueError("optimizer parameters do not match the checkpoint (different mesh or model)")
        for p, saved in zip(params, snap["main_params"]):
            p.copy_(saved)
        inner.load_state_dict(snap["state"])


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    state = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(model, name: str, output_dir: str, save_optimizer: bool, consumed_train_samples=None,
         merge=None) -> str:
    """Write a checkpoint (collective: every rank calls it). Returns the final directory.
    ``merge``: ``{HF weight name: fp32 delta}`` added to those weights before writing (a merged
    LoRA adapter)."""
    from safetensors.torch import save_file
    from megatron.core import parallel_state as ps

    rank = dist.get_rank()
    final = os.path.join(output_dir, name)
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "optimizer"))
    dist.barrier()

    dense, experts = convert.export_hf_state(model.unwrapped_chunks(), model.shape, model.dtype)
    for key, delta in (merge or {}).items():
        if key in dense:
            dense[key] = (dense[key].float() + delta).to(dense[key].dtype)
    tensors = {}
    if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0:
        tensors.update(dense)
    if ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0:
        tensors.update(experts)
    filename = f"model-rank{rank:05d}.safetensors"
    if tensors:
        save_file(tensors, os.path.join(tmp, filename), metadata={"format": "pt"})
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, (filename, {k: v.numel() * v.element_size() for k, v in tensors.items()}))

    if save_optimizer:
        if model.optimizer is None:
            raise RuntimeError("save_optimizer=True but no optimizer was set")
        torch.save({"optimizer": _optimizer_snapshot(model.optimizer),
                    "lr_scheduler": model.lr_scheduler.state_dict() if model.lr_scheduler else None,
                    "rng": _rng_state()},
                   os.path.join(tmp, "optimizer", f"rank{rank:05d}.pt"))
    if consumed_train_samples is not None:
        model.consumed_train_samples = int(consumed_train_samples)

    if rank == 0:
        weight_map, total = {}, 0
        for fname, sizes in names:
            for key, nbytes in sizes.items():
                weight_map[key] = fname
                total += nbytes
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        cfg = dict(model.hf_config)
        cfg["torch_dtype"] = "bfloat16" if model.dtype == torch.bfloat16 else "float32"
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        with open(os.path.join(tmp, _TRAINER_STATE), "w") as f:
            json.dump({"cur_step": model.cur_step,
                       "consumed_train_samples": model.consumed_train_samples,
                       "has_optimizer": bool(save_optimizer),
                       "mesh": dataclasses.asdict(model.mesh)}, f, indent=2)
    dist.barrier()
    if rank == 0:
        old = final + ".old"
        if os.path.exists(final):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load(model, path: str, load_optimizer: bool = True) -> Dict[str, int]:
    """Load weights (and, with ``load_optimizer``, optimizer / scheduler / RNG state) written by
    :func:`save`. Returns ``{'consumed_train_samples', 'cur_step'}``."""
    state_file = os.path.join(path, _TRAINER_STATE)
    if not os.path.isfile(state_file):
        raise FileNotFoundError(f"{path!r} is not a complete checkpoint (no {_TRAINER_STATE})")
    with open(state_file) as f:
        state = json.load(f)
    convert.load_hf_weights(model.unwrapped_chunks(), model.shape, path)
    if load_optimizer:
        if not state.get("has_optimizer"):
            raise ValueError(f"{path!r} was saved without optimizer state (save_optimizer=False)")
        if model.optimizer is None:
            raise RuntimeError("call set_optimizer (and set_lr_scheduler) before resuming optimizer state")
        saved_mesh = state["mesh"]
        if saved_mesh != dataclasses.asdict(model.mesh):
            raise ValueError(f"optimizer state was saved with mesh {saved_mesh}, this run uses "
                             f"{dataclasses.asdict(model.mesh)}: resume with resume_only_model=True")
        blob = torch.load(os.path.join(path, "optimizer", f"rank{dist.get_rank():05d}.pt"),
                          weights_only=False)
        _restore_optimizer(model.optimizer, blob["optimizer"])
        if blob["lr_scheduler"] is not None and model.lr_scheduler is not None:
            model.lr_scheduler.load_state_dict(blob["lr_scheduler"])
        _set_rng_state(blob["rng"])
        model.cur_step = int(state["cur_step"])
        model.consumed_train_samples = int(state["consumed_train_samples"])
    elif model.optimizer is not None:
        # fp32 main params must follow the newly loaded model weights.
        model.optimizer.reload_model_params()
    return {"consumed_train_samples": int(state["consumed_train_samples"]),
            "cur_step": int(state["cur_step"])}
