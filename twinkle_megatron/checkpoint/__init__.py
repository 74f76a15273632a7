"""Checkpoints of a MegatronModel: one atomic-save core and the formats built on it.

- :mod:`.core`: :class:`~.core.CheckpointFormat` (the base class: write into ``<name>.tmp``,
  manifest last, swap into place; a load reads and checks everything, every rank agreeing,
  before it changes anything: all or nothing) and the public
  helpers every format shares (per-rank optimizer / scheduler / RNG state, trainer state);
- :mod:`.full`: Hugging Face weights (``MegatronModel.save``; ``merge_lora=True``: with the
  adapter merged in);
- :mod:`.adapter`: a LoRA adapter in PEFT's format (``save(..., adapter_name=...)``);
- :mod:`.sharded`: with ``save(..., save_optimizer=True, sharded=True)``, the model and optimizer
  state in megatron's ``dist_checkpointing`` format (``dist_ckpt/``), resumable under any mesh.

:func:`save` and :func:`load` pick the format; both are collective (every rank calls them).
"""
from __future__ import annotations

import os

from typing import Dict, Optional

from . import adapter, core, full


def save(model, name: str, output_dir: str, *, adapter_name: Optional[str] = None, save_optimizer: bool = False,
         consumed_train_samples: Optional[int] = None, merge_lora: bool = False, sharded: bool = False) -> str:
    """Write ``<output_dir>/<name>``: adapter ``adapter_name``'s PEFT directory (None: the model's
    only one) when the model has adapters (unless ``merge_lora``), else the HF weights (with that
    adapter merged in for ``merge_lora``). ``sharded``: the optimizer state (with the model's)
    in megatron's dist_checkpointing format, resumable under another mesh (:mod:`.sharded`)."""
    merge = adapter.check_save_args(model, adapter_name, merge_lora)
    if model.adapters and not merge_lora:
        fmt = adapter.AdapterCheckpoint(adapter_name)
    else:
        fmt = full.HFCheckpoint(merge=merge)
    return fmt.save(model, name, output_dir, save_optimizer, consumed_train_samples, sharded)


def load(model, path: str, load_optimizer=True, adapter_name: Optional[str] = None) -> Dict[str, int]:
    """Restore ``path`` (written by :func:`save`, or a PEFT adapter directory) into ``model``, all
    or nothing (:meth:`.core.CheckpointFormat.load`); returns ``{'consumed_train_samples',
    'cur_step'}``. ``load_optimizer``: True, False or ``"if_present"``
    (:func:`.core.check_load_optimizer`); None: True, except for a PEFT adapter folder written by
    peft or upstream Twinkle (no manifest, no trainer state), whose weights are all it has."""
    core.recover(path)   # an interrupted save's swap, before looking at what path holds
    if load_optimizer is None:
        # the default: everything for a checkpoint this package wrote; a PEFT adapter folder that
        # peft (or upstream Twinkle) wrote carries no optimizer state by its format: its weights
        plain_peft = adapter.is_adapter_dir(path) and not any(
            os.path.isfile(os.path.join(path, f)) for f in (core.MANIFEST, core.TRAINER_STATE))
        load_optimizer = False if plain_peft else True
    if adapter.is_adapter_dir(path) or adapter_name is not None:
        return adapter.AdapterCheckpoint(adapter_name).load(model, path, load_optimizer)
    return full.HFCheckpoint().load(model, path, load_optimizer)
