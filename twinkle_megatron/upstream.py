"""Upstream Twinkle's spellings of the facade's arguments (docs/upstream.md, "Coming from Twinkle").

Each alias maps onto this package's own argument with upstream's meaning, including its data
conventions (``teacher_topk_logprobs`` arrive rolled by -1, as upstream's GKD cookbook makes them).
An alias given together with the name it stands for is a TypeError naming both. Upstream keywords
that have no meaning under torchrun (Ray's ``remote_group``) are refused with what to do instead,
never ignored.
"""
from __future__ import annotations

from typing import Optional

import torch

# upstream's ddp_config keys -> MegatronModel's overlap keywords
DDP_CONFIG_KEYS = {"overlap_grad_reduce": "overlap_grad_reduce", "overlap_param_gather": "overlap_param_gather",
                   "bucket_size": "bucket_size"}
# keywords of upstream's Ray mode, refused with the reason
RAY_KEYWORDS = ("remote_group", "mode", "ray_address", "num_gpus")


def refuse_unknown(where: str, kwargs: dict) -> None:
    """A TypeError for keywords ``where`` does not take: Ray's with what to do instead."""
    if not kwargs:
        return
    ray = sorted(k for k in kwargs if k in RAY_KEYWORDS)
    if ray:
        raise TypeError(f"{where}: {ray} belong to upstream Twinkle's Ray mode, which this package does not "
                        "have: start one process per rank with torchrun (or twinkle_megatron.parallel.launch) "
                        "and build the model on every rank")
    raise TypeError(f"{where}: unexpected keyword argument(s) {sorted(kwargs)}")


def ddp_options(ddp_config: Optional[dict], flat: dict, defaults: dict) -> dict:
    """The overlap keywords from upstream's ``ddp_config`` dict (None: ``flat`` as given). A key of
    megatron's DistributedDataParallelConfig the facade does not set is refused naming it; a
    key also given as its flat keyword is a TypeError naming both."""
    if ddp_config is None:
        return flat
    if not isinstance(ddp_config, dict):
        raise TypeError(f"ddp_config must be a dict (upstream's spelling of the overlap keywords), got "
                        f"{type(ddp_config).__name__}")
    unknown = sorted(k for k in ddp_config if k not in DDP_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"ddp_config: {unknown} are not set by this package (it accepts "
                         f"{sorted(DDP_CONFIG_KEYS)}; megatron's other DDP settings are chosen by the facade)")
    out = dict(flat)
    for key, value in ddp_config.items():
        name = DDP_CONFIG_KEYS[key]
        if flat[name] != defaults[name]:
            raise TypeError(f"give ddp_config[{key!r}] or {name}=, not both")
        out[name] = value
    return out


def variable_seq_lengths(value: Optional[bool]) -> None:
    """Upstream's switch between padded and variable-length micro-batches: every call here runs at
    its own sequence length, which is upstream's default (True)."""
    if value is None or value is True:
        return
    raise ValueError("variable_seq_lengths=False: this package always runs each call at its own sequence "
                     "length (upstream's default, True); pad the batch to a fixed length yourself to get "
                     "fixed shapes")


def forward_only_adapter(adapter_name, disable_lora: Optional[bool], default):
    """``forward_only(disable_lora=True)`` is ``adapter_name=None`` (the base model without
    adapters); ``disable_lora=False`` changes nothing."""
    if disable_lora is None:
        return adapter_name
    if not isinstance(disable_lora, bool):
        raise TypeError(f"disable_lora must be a bool, got {disable_lora!r}")
    if disable_lora and adapter_name is not default:
        raise TypeError("give disable_lora=True or adapter_name=, not both (disable_lora=True is adapter_name=None)")
    return None if disable_lora else adapter_name


def loss_kwargs(kwargs: dict) -> dict:
    """Loss arguments with upstream's spellings mapped onto this package's:

    - ``ref_outputs``: a dict with ``'logps'`` (upstream's DPO reference outputs) -> ``ref_logps``;
    - ``teacher_topk_logprobs`` [B, S, k]: upstream's GKD top-k, aligned with the logits (position t
      is the teacher's distribution of token t + 1; its cookbook rolls vLLM's ``prompt_logprobs`` by
      -1) -> ``teacher_topk_logps`` aligned as here (position t: the distribution of token t, as
      ``prompt_logprobs``), i.e. rolled back by +1. ``teacher_topk_indices`` given with it is taken
      in the same (upstream's) alignment and rolled back too. Position 0, which no loss reads, gets
      what the caller's roll moved to the end.
    """
    out = dict(kwargs)
    if "ref_outputs" in out:
        if "ref_logps" in out:
            raise TypeError("give ref_outputs (upstream's spelling) or ref_logps, not both")
        ref = out.pop("ref_outputs")
        if not isinstance(ref, dict) or "logps" not in ref:
            raise TypeError(f"ref_outputs must be a dict with 'logps' (upstream's DPO reference outputs), got "
                            f"{type(ref).__name__}")
        out["ref_logps"] = ref["logps"]
    if "teacher_topk_logprobs" in out:
        if "teacher_topk_logps" in out:
            raise TypeError("give teacher_topk_logprobs (upstream's spelling, aligned with the logits) or "
                            "teacher_topk_logps (aligned with the tokens), not both")
        out["teacher_topk_logps"] = _unroll(out.pop("teacher_topk_logprobs"), "teacher_topk_logprobs")
        if out.get("teacher_topk_indices") is not None:
            out["teacher_topk_indices"] = _unroll(out["teacher_topk_indices"], "teacher_topk_indices")
    return out


def _unroll(value, name: str):
    t = value if torch.is_tensor(value) else torch.as_tensor(value)
    if t.dim() != 3:
        raise ValueError(f"{name} must be [B, S, k], got shape {tuple(t.shape)}")
    return torch.roll(t, shifts=1, dims=1)
