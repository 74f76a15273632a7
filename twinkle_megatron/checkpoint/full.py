"""Full checkpoints of a MegatronModel: HF-format weights plus per-rank optimizer/scheduler/RNG
state, saved and loaded by the atomic core (:mod:`.core`).

Layout of ``<output_dir>/<name>/``::

    config.json                      the Hugging Face config
    model.safetensors.index.json     weight map over the files below (transformers loads this)
    model-rank00000.safetensors ...  one file per rank that owns unique weights
    trainer_state.json               {'cur_step', 'consumed_train_samples', 'mesh', ...}
    optimizer/rank00000.pt ...       (save_optimizer) optimizer, lr scheduler and RNG state
    dist_ckpt/ ...                   (save_optimizer, sharded=True) instead of optimizer/: model,
                                     optimizer, scheduler and RNG in megatron's torch_dist format
    manifest.json                    size and sha256 of every file above; written last

Per-rank optimizer state needs the same mesh to resume (checked); sharded state
(:mod:`.sharded`) resumes under any mesh.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .. import convert, validate
from . import core


class HFCheckpoint(core.CheckpointFormat):
    """The model's weights in Hugging Face format (transformers loads the directory as it is).
    ``merge``: a :class:`~twinkle_megatron.lora.MergedDeltas` added to those weights before
    writing (a merged LoRA adapter)."""

    def __init__(self, merge=None):
        self.merge = merge

    def write_rank_files(self, model, tmp):
        from safetensors.torch import save_file
        from megatron.core import parallel_state as ps
        keep_dense = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank(
            with_context_parallel=True) == 0
        keep_experts = ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0
        tensors = {}
        # the same per-tensor export as MegatronModel.get_hf_state_dict (weight_sync)
        for name, t, expert in convert.iter_hf_state(model.unwrapped_chunks(), model.shape, model.dtype):
            if keep_experts if expert else keep_dense:
                tensors[name] = self.merge.merge(name, t) if self.merge is not None else t
        filename = f"model-rank{dist.get_rank():05d}.safetensors"
        written = []
        if tensors:
            save_file(tensors, os.path.join(tmp, filename), metadata={"format": "pt"})
            written.append(filename)
        sizes = {k: v.numel() * v.element_size() for k, v in tensors.items()}
        return written, (filename, sizes)

    def write_shared_files(self, model, tmp, payloads, save_optimizer):
        weight_map, total = {}, 0
        for fname, sizes in payloads:
            for key, nbytes in sizes.items():
                weight_map[key] = fname
                total += nbytes
        core.write_json(os.path.join(tmp, "model.safetensors.index.json"),
                        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
        cfg = dict(model.hf_config)
        cfg["torch_dtype"] = "bfloat16" if model.dtype == torch.bfloat16 else "float32"
        core.write_json(os.path.join(tmp, "config.json"), cfg)
        core.write_json(os.path.join(tmp, core.TRAINER_STATE), core.trainer_state(model, save_optimizer, self.sharded))

    def prepare(self, model, path, load_optimizer):
        state = validate.read_json(os.path.join(path, core.TRAINER_STATE), "checkpoint trainer state")
        restore = core.Restore(core.progress(state))
        # every weight read, mapped and checked against the live parameters (layer count, shapes,
        # dtype, none left unset) before any is written
        weights = convert.read_hf_weights(model.unwrapped_chunks(), model.shape, path)
        restore.then(lambda: convert.copy_weights(weights))
        core.prepare_training_state(model, path, state, load_optimizer, restore)
        return restore
