"""A transformers replica of a live MegatronModel that samples with a KV cache, kept in sync from
the weight stream (:func:`.load_hf_weights` of ``MegatronModel.get_hf_state_dict``).

The trainer's own forward (``MegatronModel.logits``) has no cache: decoding with it recomputes
the whole sequence for every new token (quadratic in length). The replica decodes incrementally
with ``past_key_values``, one ``[N, 1]`` step per token, and is refreshed after every optimizer
step. With a LoRA adapter the replica is a peft model: the first sync copies the base weights and
the adapter, later ones the adapter alone.

Example (one process; every rank of a multi-rank trainer calls :func:`sync`, those that hold no
replica pass ``None``)::

    sampler = HFSampler.from_model(model)                 # [adapter_name=...] for a peft replica
    sync(model, sampler)                                  # after every optimizer step
    tokens, logps = sampler.generate(prompts, max_new_tokens=32, temperature=1.0, generator=g)
"""
from __future__ import annotations

import time
from typing import List, Optional, Sequence, Tuple, Union

import torch

from .load import load_hf_weights
from .trainer import TrainerSync


def next_tokens(logits: torch.Tensor, temperature: float, generator: Optional[torch.Generator] = None,
                vocab_size: Optional[int] = None) -> torch.Tensor:
    """One token per row of ``logits`` [N, V] (fp32): the argmax for ``temperature == 0``, else a
    draw from ``softmax(logits / temperature)`` with ``generator`` (one ``torch.multinomial`` call,
    so two samplers given equal logits and equally seeded generators draw equal tokens). Ids at or
    above ``vocab_size`` (padded vocabulary rows) are never chosen. Returns int64 [N]."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    logits = logits.float().clone()
    if vocab_size is not None:
        logits[:, vocab_size:] = float("-inf")
    if temperature == 0:
        return logits.argmax(-1)
    return torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)[:, 0]


class HFSampler:
    """A transformers (or peft) causal LM that samples completions with a KV cache.

    ``hf_model``: a transformers ``*ForCausalLM`` (or a peft model around one) in the trainer's
    architecture, in eval mode; its weights are overwritten by :meth:`refresh`.
    ``adapter_name``: the peft adapter that adapter-only streams go into (None for a plain model).
    """

    def __init__(self, hf_model: torch.nn.Module, adapter_name: Optional[str] = None):
        if not isinstance(hf_model, torch.nn.Module):
            raise TypeError(f"hf_model must be a transformers (or peft) model, got {type(hf_model).__name__}")
        self.model = hf_model.eval()
        self.adapter_name = adapter_name
        self.version = 0                  # refreshes applied so far; 0: weights not yet synced
        self.base_synced = False          # a base (non-adapter) stream has been applied

    @classmethod
    def from_model(cls, model, adapter_name: Optional[str] = None, dtype: Optional[torch.dtype] = None,
                   attn_implementation: str = "sdpa") -> "HFSampler":
        """A replica of MegatronModel ``model`` built from its HF config (``model.hf_config``) in
        ``dtype`` (default: the model's). With ``adapter_name`` it is a peft model carrying that
        adapter on exactly the modules the trainer adapts (the config ``save(adapter_name=...)``
        writes). Its weights are random until the first :meth:`refresh`."""
        lora_config = None
        if adapter_name is not None:
            from .. import lora
            if adapter_name not in model.adapters:
                have = ", ".join(repr(n) for n in model.adapters) or "none"
                raise ValueError(f"adapter_name={adapter_name!r}: the model has no such adapter (its adapters: {have})")
            lora_config = lora.adapter_config_dict(model.adapters[adapter_name], None)
        return cls.from_config(model.hf_config, dtype=dtype or model.dtype, lora_config=lora_config,
                               adapter_name=adapter_name, attn_implementation=attn_implementation)

    @classmethod
    def from_config(cls, hf_config: dict, dtype: torch.dtype = torch.float32, lora_config: Optional[dict] = None,
                    adapter_name: str = "default", attn_implementation: str = "sdpa") -> "HFSampler":
        """A replica built from an HF ``config.json`` dict (``model_type`` included) in ``dtype``;
        with ``lora_config`` (peft ``LoraConfig`` fields, e.g. ``adapter_config.json``'s) a peft
        model with adapter ``adapter_name``. For a sampler process that holds no MegatronModel."""
        import transformers
        cfg = dict(hf_config)
        for k in ("torch_dtype", "dtype", "transformers_version"):
            cfg.pop(k, None)
        if "model_type" not in cfg:
            raise ValueError("hf_config has no 'model_type'")
        config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                           attn_implementation=attn_implementation)
        if lora_config is None:
            return cls(hf)
        import peft
        fields = {k: v for k, v in dict(lora_config).items() if k not in ("peft_type", "auto_mapping", "revision")}
        hf = peft.get_peft_model(hf, peft.LoraConfig(**fields), adapter_name=adapter_name)
        return cls(hf, adapter_name=adapter_name)

    @torch.no_grad()
    def refresh(self, stream) -> int:
        """Copy weights into the replica in place; returns the number of tensors copied.

        ``stream``: a ``(name, tensor)`` stream (:func:`.load_hf_weights`): the base weights
        (checkpoint names) or, on a peft replica, its adapter (PEFT's names); or a version
        received from another process (an object with ``parts``, one stream each, and
        ``apply(model, adapter_name)``, as the receiver of :mod:`.transport` gives), applied
        whole."""
        if stream is None:
            raise ValueError("refresh: no weights (a receiver returns None once the sender has closed)")
        parts = getattr(stream, "parts", None)
        if parts is not None and hasattr(stream, "apply"):
            kinds = [".lora_" in part[0][0] for part in parts if part]
            if not kinds:
                raise ValueError("refresh: the received version is empty")
            count = stream.apply(self.model, self.adapter_name if any(kinds) else None)
            adapter_only = all(kinds)
        else:
            stream = iter(stream)
            first = next(stream, None)
            if first is None:
                raise ValueError("refresh: the stream is empty (does this rank receive the weights?)")
            adapter_only = ".lora_" in first[0]
            count = load_hf_weights(self.model, _chain(first, stream),
                                    adapter_name=self.adapter_name if adapter_only else None)
        if not adapter_only:
            self.base_synced = True
        self.version += 1
        return count

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 1.0,
                 generator: Optional[torch.Generator] = None, eos_token_id: Optional[int] = None,
                 pad_token_id: int = 0, vocab_size: Optional[int] = None, return_routed_experts: bool = False
                 ) -> Union[Tuple[List[List[int]], List[List[float]]],
                            Tuple[List[List[int]], List[List[float]], List[torch.Tensor]]]:
        """Sample a completion for each prompt (a list of token ids; lengths may differ).

        The prompts are left-padded into one ``[N, P]`` batch (``attention_mask`` and
        ``position_ids`` count real tokens only), prefilled once, then decoded one ``[N, 1]``
        step per token from the cache. Each step picks with :func:`next_tokens` (one draw per row,
        finished rows included, so the generator advances as in an uncached loop over the same
        rows). A row ends after ``eos_token_id`` (kept in its completion); all stop after
        ``max_new_tokens``.

        Returns ``(completions, logps)``: token ids per row, and per token its log-probability
        under the replica at temperature 1 over the whole vocabulary (fp32; what the trainer's
        ``forward_only`` reports for the same tokens, to check that the replica is in sync).

        ``return_routed_experts=True`` (a MoE replica, see :mod:`twinkle_patches.router_replay`) adds
        a third list: per row, int64 ``[len(prompt) + len(completion), L_moe, k]`` (CPU), the global
        expert ids the replica chose for each token of prompt + completion at each MoE layer (the
        row's slice of ``routed_experts`` ``[B, S, L_moe, k]``, which ``MegatronModel.forward_backward
        (routed_experts=...)`` replays: R3). Each token's routing is that of its own position. The
        last sampled token is never fed by sampling; it is fed through one more decode step (its logits
        are discarded), so its ids are the replica's own choice too. No log-prob the trainer computes
        depends on them: the logp of token t comes from the positions before t (causal attention, a
        per-token router), and the last position only predicts a token that is not in the sequence."""
        if self.version == 0 or not self.base_synced:
            raise RuntimeError("generate: the replica has not been synced yet (call refresh with the "
                               "model's base weights first)")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token lists")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        from transformers import DynamicCache
        device = next(self.model.parameters()).device
        n, longest = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((n, longest), pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, longest), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, longest - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
            mask[i, longest - len(p):] = 1
        ids, mask = ids.to(device), mask.to(device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=_text_config(self.model))
        done = [False] * n
        out: List[List[int]] = [[] for _ in range(n)]
        logps: List[List[float]] = [[] for _ in range(n)]
        step_ids = ids
        routing = None
        if return_routed_experts:
            from twinkle_patches import record_routing  # ValueError naming model for a dense replica
            routing = record_routing(self.model)
        try:
            for _ in range(max_new_tokens):
                logits = self.model(input_ids=step_ids, attention_mask=mask, position_ids=pos,
                                    past_key_values=cache, use_cache=True).logits[:, -1].float().cpu()
                tokens = next_tokens(logits, temperature, generator, vocab_size)
                lp = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
                for i, (t, l) in enumerate(zip(tokens.tolist(), lp.tolist())):
                    if not done[i]:
                        out[i].append(t)
                        logps[i].append(l)
                        done[i] = eos_token_id is not None and t == eos_token_id
                step_ids = tokens[:, None].to(device)
                mask = torch.cat([mask, mask.new_ones((n, 1))], 1)
                pos = pos[:, -1:] + 1
                if all(done):
                    break
            if routing is None:
                return out, logps
            # the last sampled tokens, fed once more for their routing only (see the docstring)
            self.model(input_ids=step_ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                       use_cache=True)
        finally:
            if routing is not None:
                routing.revert()
        full = routing.routed_experts  # [n, longest + steps, L_moe, k]: left-padded prompts, then steps
        routed = [full[i, longest - len(p):longest + len(out[i])].clone() for i, p in enumerate(prompts)]
        return out, logps, routed


def _chain(first, rest):
    yield first
    yield from rest


def _text_config(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def sync(model, sampler: Optional[HFSampler], adapter_name: Optional[str] = None, full: Optional[bool] = None,
         receivers: str = "replicas", dtype: Optional[torch.dtype] = None) -> dict:
    """Stream ``model``'s current weights into ``sampler``. Collective: every rank of the trainer
    calls it; ranks that receive nothing (``receivers``, as in ``get_hf_state_dict``) pass
    ``sampler=None`` and only take part in the gathers.

    Full sync (the base weights, then ``adapter_name``'s adapter when given) when ``full`` is
    True, or when None and the sampler has no base weights yet; otherwise the adapter alone.
    Returns ``{"tensors", "bytes", "seconds", "full"}`` (this rank's view; wall seconds)."""
    if full is None:
        if sampler is None and adapter_name is not None:
            # a rank without a sampler cannot know whether this is the first sync: the caller says
            raise ValueError("sync: pass full=True/False on ranks without a sampler")
        full = adapter_name is None or not sampler.base_synced
    if not full and adapter_name is None:
        raise ValueError("sync: full=False needs adapter_name (an adapter-only sync)")
    start = time.perf_counter()
    # the parts a sync to another process sends too: [full] / [base, adapter] / [adapter]
    streams = TrainerSync(model, adapter_name=adapter_name, dtype=dtype, receivers=receivers).streams(base=full)
    tensors = nbytes = 0
    for stream in streams:
        counted = CountedStream(stream)
        if sampler is not None:
            tensors += sampler.refresh(counted)
        else:
            for _ in counted:   # the stream's collectives still have to run here
                pass
        nbytes += counted.nbytes
    return {"tensors": tensors, "bytes": nbytes, "seconds": time.perf_counter() - start, "full": full}


class CountedStream:
    """An iterator over a ``(name, tensor)`` stream that adds up the bytes it passes (``nbytes``)."""

    def __init__(self, stream):
        self.stream, self.nbytes = iter(stream), 0

    def __iter__(self):
        return self

    def __next__(self):
        name, t = next(self.stream)
        self.nbytes += t.numel() * t.element_size()
        return name, t
