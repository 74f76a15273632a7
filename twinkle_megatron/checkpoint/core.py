"""The atomic-save core every checkpoint format shares: write into ``<name>.tmp``, hash every file,
write the manifest last, swap the directory into place; on load, finish an interrupted swap,
verify every file read against the manifest, unpickle optimizer state with ``weights_only=True``
and raise on every rank when any rank fails.

A format (:class:`CheckpointFormat` subclass) says only what it writes and reads:
:meth:`~CheckpointFormat.write_rank_files` (every rank, collective),
:meth:`~CheckpointFormat.write_shared_files` (rank 0, once every rank's files are on disk) and
:meth:`~CheckpointFormat.prepare` (read and check, change nothing: a :class:`Restore` that a
later commit applies, so a load is all or nothing). The per-rank optimizer / scheduler / RNG
state (``optimizer/rank<r>.pt``) and the trainer state (``trainer_state.json``) are the same in
every format: :func:`save_rank_state`, :func:`trainer_state`, :func:`prepare_training_state`.

Crash safety: rank 0 writes the manifest (the completion marker) only after every rank's files
are on disk, then renames ``<name>`` -> ``<name>.old`` and ``<name>.tmp`` -> ``<name>``. A crash
part-way leaves the previous checkpoint intact and never a directory that loads; a crash between
the two renames is finished by the next load (:func:`recover`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pickle
import shutil
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import validate
from ..parallel.mesh import facade_group

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def rank_state_file(r: int) -> str:
    """The path of rank ``r``'s optimizer / scheduler / RNG state, relative to the checkpoint."""
    return f"optimizer/rank{r:05d}.pt"


class CheckpointFormat:
    """One kind of checkpoint directory, saved atomically and loaded verified (see the module
    docstring). Subclasses implement the three hooks; :meth:`save` and :meth:`load` are
    collective (every rank calls them)."""

    def write_rank_files(self, model, tmp: str) -> Tuple[List[str], object]:
        """Every rank, collective: write this rank's files into ``tmp``. Returns (their paths
        relative to ``tmp``, a picklable payload handed to rank 0's :meth:`write_shared_files`)."""
        raise NotImplementedError

    def write_shared_files(self, model, tmp: str, payloads: Sequence[object], save_optimizer: bool) -> None:
        """Rank 0, once every rank's files are on disk: the files written once (configs, index,
        :func:`trainer_state`). ``payloads``: every rank's, in rank order."""
        raise NotImplementedError

    def sharded_adapter(self, model):
        """The LoRA adapter whose state a ``sharded=True`` save holds (None: the base model's)."""
        return None

    def needs_manifest(self, path: str) -> bool:
        """Whether ``path`` must carry a manifest to load (False: a directory another tool wrote)."""
        return True

    sharded = False   # this save's optimizer state is in megatron's dist_checkpointing format

    def save(self, model, name: str, output_dir: str, save_optimizer: bool,
             consumed_train_samples: Optional[int] = None, sharded: bool = False) -> str:
        """Write ``<output_dir>/<name>`` (collective). Returns the final directory. ``sharded``:
        the model and optimizer state go in megatron's sharded format (:mod:`.sharded`) instead
        of the per-rank files."""
        if save_optimizer and model.optimizer is None:
            raise RuntimeError("save_optimizer=True but no optimizer was set")
        if sharded and not save_optimizer:
            raise ValueError("sharded=True needs save_optimizer=True (it is the optimizer state that "
                             "is per rank; the weights load under any mesh as they are)")
        self.sharded = bool(sharded)
        final = os.path.join(output_dir, name)
        tmp = begin_save(final)
        written, payload = self.write_rank_files(model, tmp)
        if save_optimizer and sharded:
            from . import sharded as sharded_format
            written += sharded_format.save(model, tmp, self.sharded_adapter(model))
        elif save_optimizer:
            written.append(save_rank_state(model, tmp))
        if consumed_train_samples is not None:
            model.consumed_train_samples = int(consumed_train_samples)
        def finish(payloads):
            self.write_shared_files(model, tmp, payloads, save_optimizer)
            copy_tokenizer(getattr(model, "model_dir", None), tmp)

        return commit_save(tmp, final, written, payload, finish)

    def load(self, model, path: str, load_optimizer=True) -> Dict[str, int]:
        """Restore ``path`` into ``model`` (collective), all or nothing: first finish an
        interrupted swap, then check every file this load reads against the manifest (size and
        sha256; the work is split over the ranks), then :meth:`prepare` (read and check
        everything, change nothing), and only once every rank prepared without error, commit.
        Any failure before the commit, on any rank (a missing, truncated or altered file, an
        unexpected pickled type, a shape or layer count that does not fit, optimizer state asked
        for and absent), raises on every rank and leaves every parameter, optimizer state,
        scheduler, RNG state and counter as it was. ``load_optimizer``: :func:`check_load_optimizer`."""
        load_optimizer = check_load_optimizer(load_optimizer)
        recover(path)
        if self.needs_manifest(path):
            verify(path, load_optimizer is not False)
        restore = agreed(lambda: self.prepare(model, path, load_optimizer))
        if restore.collective is not None:   # the same on every rank (read from the shared trainer state)
            try:
                agreed(restore.collective)
            except BaseException:
                restore.rollback()
                raise
        return agreed(restore.commit)

    def prepare(self, model, path: str, load_optimizer) -> "Restore":
        """Every rank, after :func:`verify`, no collectives: read ``path`` and check it against
        ``model`` without changing anything; returns the :class:`Restore` that applies it."""
        raise NotImplementedError


class Restore:
    """A load read and checked, not yet applied: ``commit()`` applies it and returns the load's
    progress. ``collective``: a step every rank runs after all of them prepared (megatron's
    sharded read, :mod:`.sharded`), which adds to the commit; ``rollback()`` undoes what that
    step had to change before the commit (an optimizer's empty state initialised to read into)."""

    def __init__(self, result: Dict[str, int]):
        self.result = result
        self.collective: Optional[Callable[[], None]] = None
        self._commits: List[Callable[[], None]] = []
        self._undo: List[Callable[[], None]] = []

    def then(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` at commit, after the ones added before it."""
        self._commits.append(fn)

    def on_rollback(self, fn: Callable[[], None]) -> None:
        self._undo.append(fn)

    def rollback(self) -> None:
        for fn in reversed(self._undo):
            fn()

    def commit(self) -> Dict[str, int]:
        # nothing here reads a file or checks a value: whatever could fail was checked in prepare
        for fn in self._commits:
            fn()
        return self.result


def check_load_optimizer(load_optimizer):
    """``True`` (resume the optimizer, scheduler, RNG and step: a checkpoint without that state is
    an error), ``False`` (weights only) or ``"if_present"`` (resume them when the checkpoint has
    them, else load the weights only)."""
    if load_optimizer is True or load_optimizer is False or load_optimizer == "if_present":
        return load_optimizer
    raise ValueError(f"load_optimizer must be True, False or 'if_present', got {load_optimizer!r}")


# ---- saving -----------------------------------------------------------------------------------

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
    rel = rank_state_file(dist.get_rank())
    torch.save({"optimizer": _optimizer_snapshot(model.optimizer),
                "lr_scheduler": model.lr_scheduler.state_dict() if model.lr_scheduler else None,
                "rng": _rng_state()},
               os.path.join(tmp, rel))
    return rel


def trainer_state(model, save_optimizer: bool, sharded: bool = False, **extra) -> dict:
    """The ``trainer_state.json`` of every format: step, samples, whether optimizer state was
    saved and whether sharded (:mod:`.sharded`), the mesh it was saved with (per-rank optimizer
    state needs the same one), plus the format's ``extra``."""
    return {"cur_step": model.cur_step, "consumed_train_samples": model.consumed_train_samples,
            "has_optimizer": bool(save_optimizer), "sharded": bool(sharded), **extra,
            "mesh": dataclasses.asdict(model.mesh)}


def commit_save(tmp: str, final: str, written: Sequence[str], payload,
                finish: Callable[[List[object]], None]) -> str:
    """Collective end of a save. Each rank syncs and hashes the files it wrote (``written``, paths
    relative to ``tmp``), in parallel; the gather of those digests (with each rank's ``payload``)
    is the barrier before the completion marker. Rank 0 then calls ``finish(payloads)`` to write
    its own files, hashes everything else in ``tmp``, writes the manifest last and swaps ``tmp``
    into ``final`` (``final`` -> ``final.old``, ``tmp`` -> ``final``). Returns ``final``."""
    group = facade_group()
    digests = {f: digest_and_sync(os.path.join(tmp, f)) for f in written}
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
                    files[rel] = digest_and_sync(os.path.join(tmp, rel))
        # the completion marker, written last: a directory without it is never loaded
        write_json(os.path.join(tmp, MANIFEST), {"version": 1, "files": dict(sorted(files.items()))})
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


# the files of a Hugging Face tokenizer (fast or slow) and its chat template, as save_pretrained
# writes them
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
                   "chat_template.jinja", "chat_template.json")


def copy_tokenizer(model_dir: Optional[str], tmp: str) -> List[str]:
    """Copy the tokenizer files of the folder the model was loaded from (when it has them) into
    the checkpoint being written, so the checkpoint loads with ``AutoTokenizer`` as the original
    did (as upstream Twinkle's save writes the tokenizer beside the weights); returns their names."""
    if not model_dir or not os.path.isdir(model_dir):
        return []
    copied = []
    for name in TOKENIZER_FILES:
        src = os.path.join(model_dir, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(tmp, name))
            copied.append(name)
    return copied


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def digest_and_sync(path: str) -> dict:
    """fsync ``path``; its manifest entry ``{'size', 'sha256'}``."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    return {"size": os.path.getsize(path), "sha256": _digest(path)}


# ---- loading ----------------------------------------------------------------------------------

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
    """Collective: rank 0 finishes a save that was interrupted between its two renames (``path``
    gone, a complete ``path.tmp`` or ``path.old`` left)."""
    agreed(lambda: _finish_interrupted_swap(path) if rank() == 0 else None)


def verify(path: str, load_optimizer: bool) -> None:
    """Collective: check the files a load reads against ``path``'s manifest (no manifest: not a
    complete checkpoint); raises on every rank, naming the file."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    agreed(lambda: verify_files(path, read_manifest(path), rank(), world, load_optimizer))


def read_manifest(path: str) -> dict:
    manifest_file = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_file):
        raise FileNotFoundError(f"{path!r} is not a complete checkpoint (no {MANIFEST}; an "
                                "interrupted save, or not written by MegatronModel.save)")
    manifest = validate.read_json(manifest_file, "checkpoint manifest")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{manifest_file!r} is not a checkpoint manifest")
    return manifest


def verify_files(path: str, manifest: dict, rank: int, world: int, load_optimizer: bool) -> None:
    """Sizes of every file a load on ``rank`` reads (each rank, cheap); sha256 of a share of them
    (rank r: its own optimizer file and every world-th shared file)."""
    shared, own = [], rank_state_file(rank)
    for rel, entry in manifest["files"].items():
        if rel.startswith("optimizer/"):
            if not load_optimizer or rel != own:
                continue
        elif rel.startswith("dist_ckpt/") and not load_optimizer:
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


def prepare_training_state(model, path: str, state: dict, load_optimizer, restore: Restore,
                           adapter=None) -> bool:
    """After the weights, into ``restore``: with ``load_optimizer``, the optimizer, scheduler and
    RNG state and the step counters, read and checked now, applied at commit (refused when the
    checkpoint has none, unless ``load_optimizer == "if_present"``; per-rank state also when it
    was saved with another mesh; sharded state (:mod:`.sharded`) is resharded onto this one,
    ``adapter``'s when given, in ``restore.collective``); without, the optimizer's fp32 main
    params follow the newly loaded weights. Returns whether the optimizer state is restored."""
    if load_optimizer == "if_present":
        load_optimizer = bool(state.get("has_optimizer"))
    if not load_optimizer:
        if model.optimizer is not None:
            optimizer = model.optimizer
            restore.then(optimizer.reload_model_params)
        return False
    if not state.get("has_optimizer"):
        raise ValueError(f"{path!r} was saved without optimizer state (save_optimizer=False) and "
                         "load_optimizer=True asks for it: pass load_optimizer=False (or "
                         "resume_only_model=True) for its weights only, or load_optimizer='if_present'")
    if model.optimizer is None:
        raise RuntimeError("call set_optimizer (and set_lr_scheduler) before resuming optimizer state")
    for key in ("mesh", "cur_step", "consumed_train_samples"):
        if key not in state:
            raise ValueError(f"{os.path.join(path, TRAINER_STATE)!r} has no {key!r}")
    saved_mesh = state["mesh"]
    optimizer, scheduler = model.optimizer, model.lr_scheduler
    if state.get("sharded"):
        from . import sharded

        def collective():
            saved = sharded.prepare(model, path, saved_mesh, restore, adapter)
            if saved is not None and scheduler is not None:
                check_scheduler(scheduler, saved, os.path.join(path, sharded.DIST_DIR))
                restore.then(lambda: load_scheduler(scheduler, saved))
        restore.collective = collective
    elif saved_mesh != dataclasses.asdict(model.mesh):
        raise ValueError(f"optimizer state was saved with mesh {saved_mesh}, this run uses "
                         f"{dataclasses.asdict(model.mesh)}: resume with resume_only_model=True "
                         "(or save with sharded=True, which reshards)")
    else:
        file = os.path.join(path, rank_state_file(rank()))
        blob = load_rank_state(file)
        if not isinstance(blob, dict) or not {"optimizer", "lr_scheduler", "rng"} <= set(blob):
            raise ValueError(f"{file!r} is not a rank's optimizer state (no optimizer / lr_scheduler / rng)")
        check_optimizer(optimizer, blob["optimizer"], file)
        if blob["lr_scheduler"] is not None and scheduler is not None:
            check_scheduler(scheduler, blob["lr_scheduler"], file)
        check_rng_state(blob["rng"], file)
        restore.then(lambda: _restore_optimizer(optimizer, blob["optimizer"]))
        if blob["lr_scheduler"] is not None and scheduler is not None:
            restore.then(lambda: load_scheduler(scheduler, blob["lr_scheduler"]))
        restore.then(lambda: _set_rng_state(blob["rng"]))
    cur_step, samples = int(state["cur_step"]), int(state["consumed_train_samples"])

    def counters():
        model.cur_step = cur_step
        model.consumed_train_samples = samples
    restore.then(counters)
    return True


def check_optimizer(opt, snapshot, file: str) -> None:
    """That the per-rank ``snapshot`` (:func:`_optimizer_snapshot`) fits optimizer ``opt``: as
    many optimizers, parameters per group and main params, each main param and each per-parameter
    state tensor of its parameter's shape and dtype. Changes nothing; ValueError naming ``file``."""
    optimizers = _inner_optimizers(opt)
    if not isinstance(snapshot, list) or len(snapshot) != len(optimizers):
        n = len(snapshot) if isinstance(snapshot, list) else type(snapshot).__name__
        raise ValueError(f"{file!r} holds {n} optimizers, this model has {len(optimizers)} (a different model "
                         "or adapter)")
    for k, (o, snap) in enumerate(zip(optimizers, snapshot)):
        inner = o.optimizer
        groups = inner.param_groups
        params = [p for g in groups for p in g["params"]]
        saved = snap.get("main_params") if isinstance(snap, dict) else None
        sd = snap.get("state") if isinstance(snap, dict) else None
        if not isinstance(saved, list) or not isinstance(sd, dict) or not {"state", "param_groups"} <= set(sd):
            raise ValueError(f"{file!r}: optimizer {k} is not a saved optimizer state")
        if len(saved) != len(params):
            raise ValueError(f"{file!r}: optimizer {k} has {len(saved)} parameters, this model's has "
                             f"{len(params)} (a different model, adapter or mesh)")
        for i, (p, t) in enumerate(zip(params, saved)):
            if not isinstance(t, torch.Tensor) or t.shape != p.shape or t.dtype != p.dtype:
                got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{file!r}: optimizer {k} parameter {i} is {got}, this model's is "
                                 f"{(tuple(p.shape), p.dtype)}")
        saved_groups = sd["param_groups"]
        if len(saved_groups) != len(groups) or any(len(a["params"]) != len(b["params"])
                                                   for a, b in zip(saved_groups, groups)):
            raise ValueError(f"{file!r}: optimizer {k}'s parameter groups do not match this model's")
        by_id = {pid: p for a, b in zip(saved_groups, groups) for pid, p in zip(a["params"], b["params"])}
        for pid, entry in sd["state"].items():
            if pid not in by_id or not isinstance(entry, dict):
                raise ValueError(f"{file!r}: optimizer {k} has state for an unknown parameter {pid!r}")
            p = by_id[pid]
            for key, t in entry.items():
                if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape != p.shape:
                    raise ValueError(f"{file!r}: optimizer {k} state {key!r} of parameter {pid} has shape "
                                     f"{tuple(t.shape)}, the parameter {tuple(p.shape)}")


def check_scheduler(scheduler, saved: dict, file: str) -> None:
    """Run megatron's ``load_state_dict`` of ``saved`` on a copy of ``scheduler`` driving copies of
    its param groups: whatever it refuses (a changed schedule, a missing key) is a ValueError
    naming ``file``, and the real scheduler and optimizer are untouched."""
    import copy
    import types
    trial = copy.copy(scheduler)
    trial.optimizer = types.SimpleNamespace(param_groups=[dict(g) for g in scheduler.optimizer.param_groups])
    try:
        load_scheduler(trial, saved)
    except (AssertionError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{file!r}: the LR scheduler state does not fit this run's scheduler: "
                         f"{type(e).__name__}: {e}") from None


def load_scheduler(scheduler, saved: dict) -> None:
    """megatron's ``OptimizerParamScheduler.load_state_dict``, which advances the scheduler by the
    saved step count (``step(increment=num_steps)``): from step 0, so that a scheduler that
    already stepped ends at the saved step, not at the sum of both."""
    scheduler.num_steps = 0
    scheduler.load_state_dict(saved)


def check_rng_state(saved, file: str) -> None:
    """That ``saved`` (:func:`_rng_state`) has this process's RNG streams, each a uint8 state of
    the size the generator takes."""
    mine = _rng_state()
    ok = isinstance(saved, dict) and isinstance(saved.get("tracker"), dict)
    ok = ok and set(saved["tracker"]) == set(mine["tracker"])
    pairs = [(saved.get("torch"), mine["torch"])] + ([(saved["tracker"][k], v) for k, v in mine["tracker"].items()]
                                                    if ok else [])
    if "cuda" in saved and "cuda" in mine:
        pairs.append((saved["cuda"], mine["cuda"]))
    for a, b in pairs:
        if not isinstance(a, torch.Tensor) or a.dtype != torch.uint8 or a.numel() != b.numel():
            ok = False
    if not ok:
        raise ValueError(f"{file!r}: the RNG state is not this run's RNG streams "
                         f"({sorted(mine['tracker'])} and torch's)")


def progress(state: dict) -> Dict[str, int]:
    """What a load returns: ``{'consumed_train_samples', 'cur_step'}`` of a trainer state (0 for a
    directory without one)."""
    return {"consumed_train_samples": int(state.get("consumed_train_samples", 0)),
            "cur_step": int(state.get("cur_step", 0))}


# ---- internals --------------------------------------------------------------------------------

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
