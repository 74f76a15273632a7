"""Checkpoints of a MegatronModel: HF-format weights plus per-rank optimizer/scheduler/RNG state.

Layout of ``<output_dir>/<name>/``::

    config.json                      the Hugging Face config
    model.safetensors.index.json     weight map over the files below (transformers loads this)
    model-rank00000.safetensors ...  one file per rank that owns unique weights
    trainer_state.json               {'cur_step', 'consumed_train_samples', 'mesh', ...}
    optimizer/rank00000.pt ...       (save_optimizer) optimizer, lr scheduler and RNG state
    manifest.json                    size and sha256 of every file above; written last

The directory is written as ``<name>.tmp``; rank 0 writes the manifest (the completion marker)
only after every rank's files are on disk, then swaps it into place (``<name>`` -> ``<name>.old``,
``<name>.tmp`` -> ``<name>``). A crash part-way leaves the previous checkpoint intact and never a
directory that :func:`load` accepts; a crash between the two renames is finished by the next
:func:`load`. Loading verifies every file it reads against the manifest and unpickles optimizer
state with ``weights_only=True``. Optimizer state is per rank: resuming it needs the same mesh
(checked).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pickle
import shutil
from typing import Dict

import torch
import torch.distributed as dist

from . import convert, validate
from .parallel.mesh import facade_group

logger = logging.getLogger(__name__)

_TRAINER_STATE = "trainer_state.json"
MANIFEST = "manifest.json"


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

    final = os.path.join(output_dir, name)
    tmp = begin_save(final)
    dense, experts = convert.export_hf_state(model.unwrapped_chunks(), model.shape, model.dtype)
    for key, delta in (merge or {}).items():
        for held in (dense, experts):   # experts: only this rank's hold their keys
            if key in held:
                held[key] = (held[key].float() + delta).to(held[key].dtype)
    tensors = {}
    if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0:
        tensors.update(dense)
    if ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0:
        tensors.update(experts)
    filename = f"model-rank{dist.get_rank():05d}.safetensors"
    written = []
    if tensors:
        save_file(tensors, os.path.join(tmp, filename), metadata={"format": "pt"})
        written.append(filename)
    if save_optimizer:
        written.append(save_rank_state(model, tmp))
    if consumed_train_samples is not None:
        model.consumed_train_samples = int(consumed_train_samples)

    def finish(gathered):   # rank 0, once every rank's files are on disk
        weight_map, total = {}, 0
        for fname, sizes in gathered:
            for key, nbytes in sizes.items():
                weight_map[key] = fname
                total += nbytes
        _write_json(os.path.join(tmp, "model.safetensors.index.json"),
                    {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
        cfg = dict(model.hf_config)
        cfg["torch_dtype"] = "bfloat16" if model.dtype == torch.bfloat16 else "float32"
        _write_json(os.path.join(tmp, "config.json"), cfg)
        _write_json(os.path.join(tmp, _TRAINER_STATE),
                    {"cur_step": model.cur_step,
                     "consumed_train_samples": model.consumed_train_samples,
                     "has_optimizer": bool(save_optimizer),
                     "mesh": dataclasses.asdict(model.mesh)})

    sizes = {k: v.numel() * v.element_size() for k, v in tensors.items()}
    return commit_save(tmp, final, written, (filename, sizes), finish)


def begin_save(final: str) -> str:
    """Collective: a fresh, empty ``<final>.tmp`` (with ``optimizer/``) to write into."""
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "optimizer"))
    dist.barrier(group=facade_group())
    return tmp


def save_rank_state(model, tmp: str) -> str:
    """This rank's optimizer, lr scheduler and RNG state into ``tmp``; returns its relative path."""
    if model.optimizer is None:
        raise RuntimeError("save_optimizer=True but no optimizer was set")
    rel = f"optimizer/rank{dist.get_rank():05d}.pt"
    torch.save({"optimizer": _optimizer_snapshot(model.optimizer),
                "lr_scheduler": model.lr_scheduler.state_dict() if model.lr_scheduler else None,
                "rng": _rng_state()},
               os.path.join(tmp, rel))
    return rel


def commit_save(tmp: str, final: str, written, payload, finish) -> str:
    """Collective end of a save. Each rank syncs and hashes the files it wrote (``written``, paths
    relative to ``tmp``), in parallel; the gather of those digests (with each rank's ``payload``)
    is the barrier before the completion marker. Rank 0 then calls ``finish(payloads)`` to write
    its own files, hashes everything else in ``tmp``, writes the manifest last and swaps ``tmp``
    into ``final`` (``final`` -> ``final.old``, ``tmp`` -> ``final``). Returns ``final``."""
    group = facade_group()
    digests = {f: _digest_and_sync(os.path.join(tmp, f)) for f in written}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (payload, digests), group=group)
    if dist.get_rank() == 0:
        finish([p for p, _ in gathered])
        files = {}
        for _, d in gathered:
            files.update(d)
        for dirpath, _, names in os.walk(tmp):
            for n in names:
                rel = os.path.relpath(os.path.join(dirpath, n), tmp).replace(os.sep, "/")
                if rel not in files:
                    files[rel] = _digest_and_sync(os.path.join(tmp, rel))
        # the completion marker, written last: a directory without it is never loaded
        _write_json(os.path.join(tmp, MANIFEST), {"version": 1, "files": dict(sorted(files.items()))})
        _sync_dir(tmp)
    dist.barrier(group=group)
    if dist.get_rank() == 0:
        old = final + ".old"
        if os.path.exists(final):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        # a kill here leaves <name>.old and a complete <name>.tmp: load() finishes the swap
        os.rename(tmp, final)
        _sync_dir(os.path.dirname(os.path.abspath(final)))
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier(group=group)
    return final


def load(model, path: str, load_optimizer: bool = True) -> Dict[str, int]:
    """Load weights (and, with ``load_optimizer``, optimizer / scheduler / RNG state) written by
    :func:`save`. Returns ``{'consumed_train_samples', 'cur_step'}``.

    Collective. First finishes a save that was interrupted between its two renames (``path`` gone,
    a complete ``path.tmp`` or ``path.old`` left). Then every file this load reads is checked
    against the manifest (size and sha256; the work is split over the ranks) and optimizer state
    is unpickled with ``weights_only=True``. Any failure on any rank (a missing, truncated or
    altered file, an unexpected pickled type) raises on every rank, naming the file."""
    recover(path)
    verify(path, load_optimizer)
    return agreed(lambda: _load_verified(model, path, _rank(), load_optimizer))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def agreed(fn):
    """Run ``fn`` on every rank; if it raised on any rank, raise on every rank (collective)."""
    result, error = None, None
    try:
        result = fn()
    except Exception as e:  # re-raised by agree(), here or as a RuntimeError on the other ranks
        error = e
    validate.agree(error, "the checkpoint", group=facade_group() if dist.is_initialized() else None)
    return result


def recover(path: str) -> None:
    """Collective: rank 0 finishes a save that was interrupted between its two renames."""
    agreed(lambda: _finish_interrupted_swap(path) if _rank() == 0 else None)


def verify(path: str, load_optimizer: bool) -> None:
    """Collective: check the files a load reads against ``path``'s manifest (no manifest: not a
    complete checkpoint); raises on every rank, naming the file."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    agreed(lambda: _verify(path, _read_manifest(path), _rank(), world, load_optimizer))


def _load_verified(model, path: str, rank: int, load_optimizer: bool) -> Dict[str, int]:
    state = validate.read_json(os.path.join(path, _TRAINER_STATE), "checkpoint trainer state")
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
        blob = load_rank_state(os.path.join(path, "optimizer", f"rank{rank:05d}.pt"))
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


def load_rank_state(path: str) -> dict:
    """Unpickle one rank's optimizer / scheduler / RNG state with ``weights_only=True``: tensors,
    containers and plain values only (all that megatron's AdamW state, its scheduler and the RNG
    states hold), so a crafted file cannot run code. Anything else is a ValueError naming
    ``path``."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message suggests weights_only=False; keep only the line that names the type
        why = [ln.split("error:", 1)[-1].split(". Please use")[0].strip()
               for ln in str(e).splitlines() if "WeightsUnpickler" in ln]
        raise ValueError(f"{path!r} holds a type a checkpoint never contains and is refused "
                         f"(unpickled with weights_only=True){': ' + why[0] if why else ''}") from None


# ---- manifest ---------------------------------------------------------------------------------

def _read_manifest(path: str) -> dict:
    manifest_file = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_file):
        raise FileNotFoundError(f"{path!r} is not a complete checkpoint (no {MANIFEST}; an "
                                "interrupted save, or not written by MegatronModel.save)")
    manifest = validate.read_json(manifest_file, "checkpoint manifest")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{manifest_file!r} is not a checkpoint manifest")
    return manifest


def _verify(path: str, manifest: dict, rank: int, world: int, load_optimizer: bool) -> None:
    """Sizes of every file this load reads (each rank, cheap); sha256 of a share of them (rank r:
    its own optimizer file and every world-th shared file)."""
    shared, own = [], f"optimizer/rank{rank:05d}.pt"
    for rel, entry in manifest["files"].items():
        if rel.startswith("optimizer/"):
            if not load_optimizer or rel != own:
                continue
        else:
            shared.append(rel)
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            raise FileNotFoundError(f"checkpoint file {full!r} is missing (listed in {MANIFEST})")
        size = os.path.getsize(full)
        if size != entry["size"]:
            raise ValueError(f"checkpoint file {full!r} has {size} bytes, the manifest says "
                             f"{entry['size']} (truncated or overwritten)")
    if (load_optimizer and own not in manifest["files"]
            and any(rel.startswith("optimizer/") for rel in manifest["files"])):
        raise ValueError(f"{os.path.join(path, own)!r} is not listed in {MANIFEST} (a different "
                         "mesh, or an altered checkpoint)")
    mine = sorted(shared)[rank::world] + ([own] if load_optimizer and own in manifest["files"] else [])
    for rel in mine:
        digest = _digest(os.path.join(path, rel))
        if digest != manifest["files"][rel]["sha256"]:
            raise ValueError(f"checkpoint file {os.path.join(path, rel)!r} does not match its "
                             f"sha256 in {MANIFEST} (corrupted or altered)")


def _finish_interrupted_swap(path: str) -> None:
    """``save`` renames ``path`` to ``path.old`` and then ``path.tmp`` (complete) to ``path``. A
    kill between the two leaves no ``path``: finish the swap, or fall back to the old one."""
    path = path.rstrip("/" + os.sep) or path
    if os.path.exists(path):
        return
    tmp, old = path + ".tmp", path + ".old"
    for candidate in (tmp, old):
        if os.path.isfile(os.path.join(candidate, MANIFEST)):
            logger.warning("%s is missing: a save was interrupted; using the complete %s", path, candidate)
            os.rename(candidate, path)
            if candidate == tmp:
                shutil.rmtree(old, ignore_errors=True)
            return


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _digest_and_sync(path: str) -> dict:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    return {"size": os.path.getsize(path), "sha256": _digest(path)}


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def _sync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:   # not every platform opens directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
