"""Model and optimizer state in megatron's own sharded format (``dist_checkpointing``, the
``torch_dist`` strategy), so that a run resumes under a different TP / PP / DP / EP / CP layout,
or with and without the distributed optimizer.

``MegatronModel.save(..., save_optimizer=True, sharded=True)`` writes, next to the Hugging Face
weights (or the PEFT adapter) and in place of the per-rank ``optimizer/rank*.pt`` files::

    dist_ckpt/.metadata, dist_ckpt/__<rank>_<i>.distcp ...   torch.distributed.checkpoint files
    dist_ckpt/common.pt, dist_ckpt/metadata.json             megatron's common state (inside the
                                                             checkpoint from megatron-core 0.19) and metadata

holding what megatron's ``checkpointing.generate_state_dict`` holds:

- ``model``: every chunk's ``sharded_state_dict()`` (global layer numbers and global TP / EP
  offsets, so any layout reads it). With a LoRA adapter only that adapter's parameters, with
  their TP axis: ``lora_B`` of a column-parallel linear and ``lora_A`` of a row-parallel one
  are sharded like the base weight's output / input (in the HF target's row / column order),
  the other factor replicated; a routed expert's factors also along megatron's expert axis
  (global expert index, so EP may change) and over expert-TP;
- ``optimizer``: ``optimizer.sharded_state_dict(model)``: Adam's moments and step and, under
  bf16 / fp16, the fp32 main params, keyed by the parameter they belong to (the distributed
  optimizer's in megatron's ``fully_reshardable`` layout: the same per-parameter tensors, so a
  run may also switch the distributed optimizer on or off (tests/megatron/test_reshard.py covers fp32,
  plain -> distributed); in fp32 the plain optimizer's weights are written again under the
  distributed optimizer's main-param keys for that);
- ``opt_param_scheduler``: the LR scheduler's ``state_dict()`` (common state);
- ``rng_state``: every rank's torch and model-parallel RNG tracker states, restored only on the
  same mesh (as megatron does when TP / PP change: another layout draws other streams).

The step counters and the data position (``cur_step``, ``consumed_train_samples``) are in
``trainer_state.json``, the manifest covers every file (a corrupted shard is refused, naming
it), and ``common.pt`` is read with ``weights_only=True`` before megatron reads it. Entries
that megatron would pickle (``ShardedObject``: the ``_extra_state`` of its linears, None without
TransformerEngine) are left out, so nothing of this format is unpickled beyond what
``weights_only=True`` admits.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
from typing import Dict, List

import torch
import torch.distributed as dist

from ..parallel.mesh import facade_group

logger = logging.getLogger(__name__)

DIST_DIR = "dist_ckpt"
# what megatron's checkpointing passes for a reshardable distributed-optimizer checkpoint (its
# other format, dp_reshardable, reshards over DP only); no "chained_0." key prefix, so the keys
# do not depend on how many optimizers the chain holds
METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True,
            "singleton_local_shards": False}
COMMON = "common.pt"


def save(model, tmp: str, adapter=None) -> List[str]:
    """Collective: write ``model``'s sharded state into ``<tmp>/dist_ckpt`` (``adapter``: only
    that LoRA adapter's parameters and their optimizer state). Returns the files this rank wrote
    (relative to ``tmp``); rank 0's shared ones are hashed by the atomic core."""
    from megatron.core import dist_checkpointing
    target = os.path.join(tmp, DIST_DIR)
    if dist.get_rank() == 0:
        os.makedirs(target)
    dist.barrier(group=facade_group())
    state = state_dict(model, adapter, is_loading=False)
    dist_checkpointing.save(state, target, validate_access_integrity=True)
    mine = f"__{dist.get_rank()}_"
    return sorted(f"{DIST_DIR}/{n}" for n in os.listdir(target) if n.startswith(mine))


def prepare(model, path: str, saved_mesh: dict, restore, adapter=None):
    """Collective: read ``<path>/dist_ckpt`` with megatron's ``dist_checkpointing.load`` into
    buffers of its own (not the live parameters and optimizer state, which it would otherwise
    write in place), check the parameters against this model, and add to ``restore`` (a
    :class:`~.core.Restore`) the commit that copies them and loads the optimizer state (and the
    RNG states when ``saved_mesh`` is this run's mesh), whatever the layout it was saved with.
    Reading needs an optimizer with Adam state; one without gets empty state first, which
    ``restore.rollback()`` removes again. Call after the manifest check. Returns the saved LR
    scheduler state (None: none), which the caller checks and sets."""
    from megatron.core import dist_checkpointing
    source = os.path.join(path, DIST_DIR)
    if not os.path.isdir(source):
        raise FileNotFoundError(f"{source!r} is missing: the checkpoint was not saved with sharded=True")
    common = _read_common(source)
    same_mesh = saved_mesh == dataclasses.asdict(model.mesh)
    optimizer = model.optimizer
    empty = [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer]) if not opt.optimizer.state]
    restore.on_rollback(lambda: [inner.state.clear() for inner in empty])
    state = state_dict(model, adapter, is_loading=True, with_rng=same_mesh)
    template = optimizer.state_dict()   # this optimizer's own layout of its scalars
    _match_main_params(state["optimizer"], set(dist_checkpointing.load_tensors_metadata(source)))
    _own_buffers(state)
    loaded = _read(state, source)
    params = _checked_params(model, loaded, adapter)
    opt_state = _in_own_layout(optimizer, loaded["optimizer"], common.get("optimizer", {}), template)

    def commit():
        with torch.no_grad():
            for param, value in params:
                param.copy_(value)
        # no reload_model_params: the optimizer's state dict carries its fp32 main params
        with _step_kept_apart(optimizer):
            optimizer.load_state_dict(opt_state)
        if same_mesh:
            _set_rng(loaded["rng_state"])
        else:
            logger.info("resuming on mesh %s from %s: RNG states not restored (they are per rank)",
                        dataclasses.asdict(model.mesh), saved_mesh)
    restore.then(commit)
    return loaded.get("opt_param_scheduler")


def _read(state: dict, source: str) -> dict:
    """``dist_checkpointing.load(state, source)``; torch's CheckpointException (a BaseException,
    raised on every rank, its message every rank's traceback) becomes a ValueError naming
    ``source`` and megatron's reason."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        return dist_checkpointing.load(state, source)
    except CheckpointException as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        reasons = [ln for ln in lines if "Exception:" in ln or "Error:" in ln] or lines[-1:]
        reason = reasons[-1] if reasons else ""
        raise ValueError(f"{source!r}: megatron's dist_checkpointing cannot read it into this model: "
                         f"{reason}") from None


def _own_buffers(state: dict) -> None:
    """Point every sharded entry of ``state`` at a new tensor of its shape: megatron's torch_dist
    load reads in place into an entry's data, which for the model's parameters and the plain
    optimizer's Adam state are the live tensors."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    for entry in nested_values(state):
        if isinstance(entry, (ShardedTensor, ShardedTensorFactory)) and entry.data is not None:
            entry.data = torch.empty_like(entry.data)


def state_dict(model, adapter=None, *, is_loading: bool, with_rng: bool = True) -> dict:
    """The sharded state dict megatron's checkpointing builds (see the module docstring)."""
    model.model   # the optimizer's DDP wrap exists
    chunks = model.unwrapped_chunks()
    state = {}
    for i, chunk in enumerate(chunks):
        sd = _params(chunk, adapter)
        state["model" if len(chunks) == 1 else f"model{i}"] = sd
    if is_loading:
        _init_empty_states(model.optimizer)
    state["optimizer"] = model.optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=METADATA)
    _drop_objects(state["optimizer"])
    if not is_loading:
        state["fp32_main_params"] = _fp32_main_params(model, state)
    state["opt_param_scheduler"] = model.lr_scheduler.state_dict() if model.lr_scheduler is not None else None
    if with_rng:
        state["rng_state"] = _rng_entries()
    return state


@torch.no_grad()
def _init_empty_states(optimizer) -> None:
    """Give an optimizer that never stepped its Adam state, so that the loading state dict has
    entries to read into: the distributed optimizer's ``state_dict()`` reads ``step`` from it
    (without Apex / TransformerEngine). One step at lr 0 on zero gradients: no parameter moves,
    and everything it sets is overwritten by the load."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        if not isinstance(opt, DistributedOptimizer) or inner.state:
            continue
        lrs = [g["lr"] for g in inner.param_groups]
        for g in inner.param_groups:
            g["lr"] = 0.0
            for p in g["params"]:
                p.grad = torch.zeros_like(p)
        inner.step()
        for g, lr in zip(inner.param_groups, lrs):
            g["lr"] = lr
            for p in g["params"]:
                p.grad = None


# where each optimizer keeps the fp32 main params: the distributed optimizer as "param", the
# bf16 / fp16 one as "fp32_param"; the fp32 one has none of its own (they are the model's
# weights), so a save from it writes them as "param" too (:func:`_fp32_main_params`)
_MAIN_PARAM_KEYS = ("optimizer.state.param.", "optimizer.state.fp32_param.")


def _fp32_main_params(model, state: dict) -> dict:
    """For the parameters a plain fp32 optimizer holds, their entries again under the
    distributed optimizer's main-param keys, so that a run with it can resume from this save
    (one more copy of those weights on disk)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.optimizer.optimizer import FP32Optimizer
    held = {id(p) for opt in getattr(model.optimizer, "chained_optimizers", [model.optimizer])
            if isinstance(opt, FP32Optimizer) for g in opt.optimizer.param_groups for p in g["params"]}
    out = {}
    for key, sd in state.items():
        if not key.startswith("model"):
            continue
        for entry in nested_values(sd):
            # (a factory: megatron's split of a fused SwiGLU fc1 into its halves)
            if isinstance(entry, (ShardedTensor, ShardedTensorFactory)) and id(entry.data) in held:
                out[str(len(out))] = dataclasses.replace(entry, key=_MAIN_PARAM_KEYS[0] + entry.key)
    return out


def _match_main_params(sd, saved_keys: set) -> None:
    """Point the main-param entries this optimizer reads at the ones the saving optimizer wrote,
    when the run switched the distributed optimizer on or off (same values, other keys)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    for entry in nested_values(sd):
        if not isinstance(entry, (ShardedTensor, ShardedTensorFactory)) or entry.key in saved_keys:
            continue
        for prefix in _MAIN_PARAM_KEYS[:2]:
            if entry.key.startswith(prefix):
                name = entry.key[len(prefix):]
                for other in _MAIN_PARAM_KEYS:
                    if other + name in saved_keys:
                        entry.key = other + name
                        break
                break


# ---- the model's entries ------------------------------------------------------------------

def _params(chunk, adapter) -> dict:
    """``chunk.sharded_state_dict()`` with only parameters (no pickled ``_extra_state``): the base
    weights without adapters; with ``adapter`` its LoRA factors, re-sharded along their TP axis."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    sd = chunk.sharded_state_dict()
    _drop_objects(sd)
    lora = _lora_axes(chunk, adapter.name if adapter is not None else None)
    out = {}
    for name, entry in sd.items():
        is_lora = ".lora." in name
        if adapter is None:
            if not is_lora:
                out[name] = entry
            continue
        if not name_in_adapter(name, adapter.name):
            continue
        if not isinstance(entry, ShardedTensor) or id(entry.data) not in lora:
            raise RuntimeError(f"{name}: not a LoRA parameter of adapter {adapter.name!r}")
        out[name] = _lora_entry(entry, lora[id(entry.data)])
    return out


def name_in_adapter(name: str, adapter_name: str) -> bool:
    return f".lora.{adapter_name}.lora_" in name


def _lora_axes(chunk, adapter_name) -> Dict[int, tuple]:
    """``{id(param): (tp axis or None, LoraAdapter, target)}`` of ``adapter_name``'s factors (a
    routed expert's: its axis over expert-TP; megatron's entry already carries the expert axis)."""
    from ..lora.linear import LoraAdapter
    axes = {}
    if adapter_name is None:
        return axes
    for name, module in chunk.named_modules():
        if not isinstance(module, LoraAdapter) or not name.endswith(f".lora.{adapter_name}"):
            continue
        for t in module.targets:
            split = module.kind == "column"
            axes[id(module.lora_A[t.name])] = (None if split else 1, module, t)
            axes[id(module.lora_B[t.name])] = (0 if split else None, module, t)
    return axes


def _lora_entry(entry, info):
    """The sharded entry of one LoRA factor, in the Hugging Face (layout-free) order of its
    target: replicated as the base linear made it, or split over (expert-)TP along ``axis``.
    This rank's rows / columns (``target.rows`` / ``cols``) are one or more equal runs of
    consecutive HF indices, each at a multiple of its length (one block per rank for a plain
    projection; a gate and an up block for a routed expert's fused ``gate_up_proj``, as megatron
    splits its SwiGLU fc1): each run is a fragment of the full factor, several of them through a
    ``ShardedTensorFactory`` (megatron's way for its fc1 halves). The leading axes megatron
    prepended (layer, and for an expert its global index) and the data-parallel replica id (for
    an expert: over expert-DP) are kept from ``entry``."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    axis, module, target = info
    if axis is None or module.tp_size == 1:
        return entry
    index = (target.rows if axis == 0 else target.cols)[module.tp_rank].cpu()
    full = target.out_features if axis == 0 else target.in_features
    runs = _runs(index, full, target.full_name)
    n = entry.prepend_axis_num
    prepend = tuple((i, entry.global_offset[i], entry.global_shape[i]) for i in range(n))
    replica_id = (entry.replica_id[0], 0, entry.replica_id[2])   # the same on every TP rank: none

    def pieces(key, data, replica_id, flattened_range):
        if flattened_range is not None:
            raise NotImplementedError("a flattened LoRA factor (the dp_reshardable layout) is not written")
        out, at = [], 0
        for fragment, fragments, length in runs:
            # (one run: the parameter itself, by which the optimizer finds its entry)
            part = data if len(runs) == 1 else data.narrow(axis, at, length)
            out.append(ShardedTensor.from_rank_offsets(key, part, *prepend, (n + axis, fragment, fragments),
                                                       replica_id=replica_id, prepend_axis_num=n))
            at += length
        return out

    if len(runs) == 1:
        return pieces(entry.key, entry.data, replica_id, None)[0]
    return ShardedTensorFactory(entry.key, entry.data, pieces, lambda loaded: torch.cat(loaded, axis),
                                replica_id)


def _runs(index: torch.Tensor, full: int, name: str) -> List[tuple]:
    """``index`` (this rank's HF indices along the split axis, in its local order) as
    ``[(fragment, fragments, length)]``: consecutive runs of equal ``length`` that each start at
    a multiple of it, fragment ``fragment`` of the ``full // length`` ones."""
    breaks = (torch.nonzero(index[1:] - index[:-1] != 1).flatten() + 1).tolist()
    bounds = [0] + breaks + [index.numel()]
    lengths = {b - a for a, b in zip(bounds, bounds[1:])}
    length = lengths.pop()
    starts = [int(index[a]) for a in bounds[:-1]]
    if lengths or full % length or any(s % length for s in starts):
        raise NotImplementedError(f"{name}: this rank's LoRA rows are not equal aligned blocks of the full "
                                  "factor; save with sharded=False")
    return [(s // length, full // length, length) for s in starts]


def _checked_params(model, loaded: dict, adapter) -> list:
    """``[(parameter, loaded value)]`` for the model's (``adapter``'s) parameters, every one of
    them present with its shape; KeyError / ValueError naming the first that is not."""
    out = []
    chunks = model.unwrapped_chunks()
    for i, chunk in enumerate(chunks):
        sd = loaded["model" if len(chunks) == 1 else f"model{i}"]
        params = dict(chunk.named_parameters())
        for name, value in sd.items():
            if name not in params:
                raise KeyError(f"the sharded checkpoint has {name!r}, which this model does not")
            if tuple(value.shape) != tuple(params[name].shape):
                raise ValueError(f"{name}: the sharded checkpoint gives shape {tuple(value.shape)}, this model "
                                 f"has {tuple(params[name].shape)}")
            out.append((params[name], value))
        want = [n for n in params if (name_in_adapter(n, adapter.name) if adapter is not None
                                      else ".lora." not in n)]
        missing = sorted(set(want) - set(sd))
        if missing:
            raise KeyError(f"the sharded checkpoint lacks {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    return out


def _drop_objects(sd) -> None:
    """Remove every ShardedObject (pickled by torch_dist) from ``sd`` in place; they are the
    ``_extra_state`` entries megatron's linears add (None here)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    if isinstance(sd, dict):
        for k in [k for k, v in sd.items() if isinstance(v, ShardedObject)]:
            del sd[k]
        for v in sd.values():
            _drop_objects(v)
    elif isinstance(sd, list):
        if any(isinstance(v, ShardedObject) for v in sd):
            raise ValueError("a ShardedObject inside a list cannot be left out of a sharded checkpoint")
        for v in sd:
            _drop_objects(v)


# ---- RNG -------------------------------------------------------------------------------------

def _rng_entries() -> dict:
    """This rank's RNG states as uint8 ShardedTensors over the world (row = global rank)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    r, world = dist.get_rank(), dist.get_world_size()
    states = {"torch": torch.get_rng_state()}
    states.update({f"tracker.{k}": v for k, v in get_cuda_rng_tracker().get_states().items()})
    return {k: ShardedTensor.from_rank_offsets(f"rng_state.{k}", v.clone().view(1, -1), (0, r, world),
                                               replica_id=0)
            for k, v in states.items()}


def _set_rng(loaded: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    torch.set_rng_state(loaded["torch"].reshape(-1).contiguous())
    tracker = {k.split(".", 1)[1]: v.reshape(-1).contiguous() for k, v in loaded.items() if k.startswith("tracker.")}
    get_cuda_rng_tracker().set_states(tracker)


def _read_common(source: str) -> dict:
    """The checkpoint's common state: its ``common.pt`` when there is one (what torch_dist wrote up to
    megatron-core 0.18, and what megatron-core 0.19 still reads first), else, from 0.19, the common
    state inside the checkpoint, which megatron itself reads with ``weights_only=True``
    (``versions.CHANGES["common_state_in_checkpoint"]``)."""
    from .. import versions
    path = os.path.join(source, COMMON)
    if os.path.exists(path) or not versions.CHANGES["common_state_in_checkpoint"].active:
        return _check_common(path)
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict
    return load_common_state_dict(source)


def _check_common(path: str) -> dict:
    """Megatron's common state, read with ``weights_only=True`` (before torch_dist's own read,
    which may not be): a crafted file is refused, naming it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(f"{path!r} holds a type a checkpoint never contains and is refused "
                         "(unpickled with weights_only=True)") from None


@contextlib.contextmanager
def _step_kept_apart(optimizer):
    """Around the distributed optimizer's ``load_state_dict``: megatron-core 0.16.1 copies every
    per-parameter state tensor from the checkpoint (``_set_main_param_and_optimizer_states``),
    and without Apex / TransformerEngine torch's Adam keeps a per-parameter ``step``, which the
    ``fully_reshardable`` layout carries in the param groups instead (KeyError 'step'). During
    the call, each copy leaves ``step`` aside; the load itself sets it from the param groups
    (one tensor for all parameters: afterwards each gets its own copy)."""
    patched = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not _is_distributed(opt):
            continue
        original = opt._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, opt=opt, original=original):
            group, order = opt.model_param_group_index_map[model_param]
            state = opt.optimizer.state.get(opt.optimizer.param_groups[group]["params"][order], {})
            step = state.pop("step", None)
            try:
                original(model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step
        opt._set_main_param_and_optimizer_states = set_states
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states
    for opt in patched:
        # the load gives every parameter the same step tensor, which torch's Adam would then
        # increment once per parameter per step: each gets its own
        for state in opt.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


# ---- switching the distributed optimizer on or off --------------------------------------------

def _is_distributed(opt) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    return isinstance(opt, DistributedOptimizer)


def _in_own_layout(optimizer, loaded: dict, saved_common: dict, template: dict) -> dict:
    """The loaded optimizer state in the layout ``optimizer.load_state_dict`` reads. The tensors
    always are (they were requested in it); the scalars come from the saved common state, laid
    out by the optimizer chain that saved them. When that chain differs from this one (the
    distributed optimizer switched on or off, or another number of chained optimizers: expert
    parameters get their own under EP), the scalars are this chain's own (``template``: its
    param groups, which the restored LR scheduler drives) with the saved Adam step."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    saved = [saved_common[k] for k in sorted(saved_common)] if 0 in saved_common else [saved_common]
    if len(saved) == len(inner) and all(_is_distributed(o) == ("param_state_sharding_type" in c)
                                        for o, c in zip(inner, saved)):
        return loaded
    step = _saved_step(saved[0])
    if len(inner) == 1:
        return _own(inner[0], loaded, template, step)
    return {i: _own(o, loaded[i], template[i], step) for i, o in enumerate(inner)}


def _own(opt, loaded: dict, template: dict, step: float) -> dict:
    """One optimizer's state: ``loaded``'s tensors, ``template``'s scalars, Adam step ``step``."""
    if _is_distributed(opt):
        own = {k: v for k, v in template.items() if k not in ("optimizer", "param_state")}
        own["optimizer"] = {"param_groups": [dict(g, step=step) for g in template["optimizer"]["param_groups"]]}
        own["param_state"] = loaded["param_state"]
        own["param_state_sharding_type"] = METADATA["distrib_optim_sharding_type"]
        return own
    if "optimizer" in template:   # bf16 / fp16: the mixed-precision wrapper's layout
        state = {k: v for k, v in loaded["optimizer"]["state"].items() if k != "common_step"}
        state["common_step"] = torch.tensor(float(step))
        own = {k: v for k, v in template.items() if k not in ("optimizer", "fp32_from_fp16_params")}
        own["optimizer"] = {"state": state, "param_groups": template["optimizer"]["param_groups"]}
        own["fp32_from_fp16_params"] = loaded["fp32_from_fp16_params"]
        return own
    state = {k: v for k, v in loaded["state"].items() if k != "common_step"}
    state["common_step"] = torch.tensor(float(step))
    return {"state": state, "param_groups": template["param_groups"]}


def _saved_step(common: dict) -> float:
    """Adam's step count in a saved common state, distributed (per param group) or not."""
    for holder in (common, common.get("optimizer", {})):
        step = holder.get("state", {}).get("common_step") if isinstance(holder, dict) else None
        if step is not None:
            return float(step)
    steps = {g["step"] for g in common.get("optimizer", {}).get("param_groups", []) if "step" in g}
    if len(steps) != 1:
        raise ValueError(f"the sharded checkpoint's optimizer holds no single step count ({sorted(steps)})")
    return float(steps.pop())
