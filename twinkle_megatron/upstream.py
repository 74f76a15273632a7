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
# upstream MegatronModel keywords this package takes otherwise: keyword -> what to do instead
MODEL_KEYWORDS = {
    "config": "upstream's config= replaces the folder's config.json; here the config comes from model_id's "
              "folder, or pass a config dict as model_dir_or_config (random weights)",
    "tokenizer_id": "upstream's tokenizer_id= names the tokenizer saved beside the weights; here save() writes "
                    "the tokenizer files of model_id's folder, and set_template(tokenizer_or_folder) chooses the "
                    "one that encodes messages",
}


def refuse_unknown(where: str, kwargs: dict) -> None:
    """A TypeError for keywords ``where`` does not take: Ray's with what to do instead."""
    if not kwargs:
        return
    ray = sorted(k for k in kwargs if k in RAY_KEYWORDS)
    if ray:
        raise TypeError(f"{where}: {ray} belong to upstream Twinkle's Ray mode, which this package does not "
                        "have: start one process per rank with torchrun (or twinkle_megatron.parallel.launch) "
                        "and build the model on every rank")
    known = sorted(k for k in kwargs if k in MODEL_KEYWORDS and where == "MegatronModel")
    if known:
        raise TypeError(f"{where}: {known} are upstream Twinkle's, not taken here: "
                        + "; ".join(f"{k}: {MODEL_KEYWORDS[k]}" for k in known))
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
    adapters); ``disable_lora=False`` changes nothing. Upstream's cookbook also names the adapter
    whose LoRA is disabled (``disable_lora=True, adapter_name='a'``, its DPO reference pass): that
    is the base model too (the caller checks that the adapter exists)."""
    if disable_lora is None:
        return adapter_name
    if not isinstance(disable_lora, bool):
        raise TypeError(f"disable_lora must be a bool, got {disable_lora!r}")
    if disable_lora and adapter_name is not default and not isinstance(adapter_name, str):
        raise TypeError(f"give disable_lora=True or adapter_name={adapter_name!r}, not both (disable_lora=True is "
                        "adapter_name=None)")
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



def is_input_features(inputs) -> bool:
    """Whether ``inputs`` are samples encoded by upstream Twinkle's ``Template`` (its
    ``Dataset.encode()`` / ``template.batch_encode``): a list of dicts each with ``input_ids`` and
    ``length``, the key upstream's Template adds to every sample (this package's own inputs never
    carry it)."""
    return (isinstance(inputs, (list, tuple)) and bool(inputs) and isinstance(inputs[0], dict)
            and "length" in inputs[0] and "input_ids" in inputs[0])


def input_features(samples) -> list:
    """Upstream Template's samples -> this package's: ``labels`` rolled back by +1.

    Upstream's Template rolls each sample's labels by -1 (``Template._roll_labels``), so position t
    holds token t + 1, the target of the logits at t; this package's labels are aligned with the
    tokens (``labels[t]`` is token t where it is trained) and shifted inside the loss. Renaming
    nothing and passing the rolled labels would train every position on the token after its target,
    without an error. ``attention_mask`` and ``position_ids`` are kept unless they are the all-ones
    mask and positions 0..n-1 (what upstream's Template writes for text); the dataset's own columns
    that upstream's processor does not read (``messages``, ``length``, the raw rows) are left out.
    Every sample must be such a sample (a ValueError names the first that is not)."""
    out = []
    for i, sample in enumerate(samples):
        if not isinstance(sample, dict) or "length" not in sample or "input_ids" not in sample:
            raise ValueError(f"inputs[{i}]: mixes upstream Template samples (with 'length') and others; "
                             "give one kind per call")
        ids = torch.as_tensor(sample["input_ids"])
        if ids.dim() != 1:
            raise ValueError(f"inputs[{i}]['input_ids'] of an upstream Template sample must be 1-D, got shape "
                             f"{tuple(ids.shape)}")
        if int(sample["length"]) != ids.numel():
            raise ValueError(f"inputs[{i}]: 'length'={int(sample['length'])} but input_ids has {ids.numel()} "
                             "tokens")
        new = {"input_ids": ids}
        if sample.get("labels") is not None:
            labels = torch.as_tensor(sample["labels"])
            if labels.shape != ids.shape:
                raise ValueError(f"inputs[{i}]: labels shape {tuple(labels.shape)} != input_ids shape "
                                 f"{tuple(ids.shape)}")
            new["labels"] = torch.roll(labels, shifts=1, dims=0)
        # upstream's Template writes an all-ones mask and positions 0..n-1 for every text sample: they
        # say no more than the facade's own padding, so such a sample runs as one given without them.
        # Its Qwen3.5 (VL) template writes [4, 1, n] positions (text, then mrope's t / h / w rows): for
        # text all four are 0..n-1, the decoder's own positions
        trivial = {"attention_mask": torch.ones_like(ids), "position_ids": torch.arange(ids.numel())}
        for key, plain in trivial.items():
            if sample.get(key) is None:
                continue
            value = torch.as_tensor(sample[key])
            rows = value.reshape(-1, ids.numel()) if value.numel() % max(ids.numel(), 1) == 0 else value
            if rows.dim() == 2 and rows.shape[1] == ids.numel() and all(
                    torch.equal(r.to(plain.dtype), plain) for r in rows):
                continue
            if value.dim() > 1:
                raise ValueError(f"inputs[{i}][{key!r}] has shape {tuple(value.shape)}: multimodal (mrope) positions "
                                 "other than the text positions 0..n-1 are not supported (this package trains the "
                                 "text decoder)")
            new[key] = value
        out.append(new)
    return out


class TransformersModel:
    """Upstream Twinkle's transformers (FSDP) backend, which this package does not have. Its
    cookbook's RL scripts import it for their ``--strategy native_fsdp`` branch; a port imports
    this name instead, and building one is a TypeError saying what to use."""

    def __init__(self, *args, **kwargs):
        raise TypeError("TransformersModel is upstream Twinkle's transformers (FSDP) backend, which "
                        "twinkle_megatron does not have: use MegatronModel (the scripts' default strategy)")
