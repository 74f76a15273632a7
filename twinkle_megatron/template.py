"""Conversations as inputs: ``MegatronModel.set_template`` (upstream Twinkle's spelling) and inputs
given as ``messages``.

:class:`ChatTemplate` encodes a conversation (a list of ``{"role", "content"}`` messages) with a
Hugging Face tokenizer's own chat template (``tokenizer.apply_chat_template``) into ``input_ids``
and ``labels`` aligned with them (the facade's convention: ``labels[t] = input_ids[t]`` where token
t is trained, -100 elsewhere). Only the assistant turns are trained: each assistant message's tokens
are those its template adds after the generation prompt of the conversation before it, found by
encoding the growing prefixes of the conversation. That needs a template whose encoding of a
conversation starts with the encoding of every shorter prefix of it; one that rewrites earlier turns
(some templates drop the reasoning of past turns) is refused, naming the turn, rather than mislabelled.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

ROLES = ("system", "user", "assistant", "tool")


class ChatTemplate:
    """Messages -> ``{"input_ids": [T], "labels": [T]}`` (lists of ints) with ``tokenizer``'s chat
    template (a ``transformers`` tokenizer with ``chat_template`` set)."""

    def __init__(self, tokenizer):
        if not callable(getattr(tokenizer, "apply_chat_template", None)):
            raise TypeError(f"set_template needs a Hugging Face tokenizer (or a folder holding one), got "
                            f"{type(tokenizer).__name__}")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("set_template: this tokenizer has no chat_template")
        self.tokenizer = tokenizer

    def _ids(self, messages, generation_prompt: bool) -> List[int]:
        out = self.tokenizer.apply_chat_template(list(messages), tokenize=True,
                                                 add_generation_prompt=generation_prompt)
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(i) for i in ids]

    def encode(self, messages: Sequence[Dict[str, str]]) -> Dict[str, List[int]]:
        check_messages(messages)
        full = self._ids(messages, False)
        labels = [-100] * len(full)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._ids(messages[:i], True) if i else []
            upto = self._ids(messages[:i + 1], False)
            if full[:len(upto)] != upto or upto[:len(before)] != before:
                raise ValueError(f"messages[{i}]: this chat template does not encode the conversation as its "
                                 "prefixes (it rewrites earlier turns), so the assistant tokens cannot be found; "
                                 "encode input_ids / labels yourself")
            labels[len(before):len(upto)] = full[len(before):len(upto)]
        if all(label == -100 for label in labels):
            raise ValueError("messages have no assistant turn to train on")
        return {"input_ids": full, "labels": labels}


def check_messages(messages) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.80}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r:.80}")
        if m["role"] not in ROLES:
            raise ValueError(f"messages[{i}]['role'] must be one of {list(ROLES)}, got {m['role']!r}")


def load_tokenizer(template):
    """``set_template``'s argument: a tokenizer, or a local folder holding one (nothing is
    downloaded)."""
    import os
    if isinstance(template, (str, os.PathLike)):
        if not os.path.isdir(template):
            raise ValueError(f"set_template: {os.fspath(template)!r} is not a local folder with a tokenizer "
                             "(no hub is reached; pass the tokenizer object or its folder)")
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(os.fspath(template))
    return template


def encode_inputs(template: "ChatTemplate", inputs):
    """``inputs`` with conversations encoded: a list of samples, each ``{"messages": [...]}``, or
    a dict ``{"messages": [conversation, ...]}``, becomes a list of ``{"input_ids", "labels"}``
    samples (right-padded by the facade); anything else is returned as is."""
    if isinstance(inputs, dict) and "messages" in inputs:
        extra = sorted(set(inputs) - {"messages"})
        if extra:
            raise ValueError(f"inputs with 'messages' take no other keys, got {extra}")
        conversations = inputs["messages"]
        if not isinstance(conversations, Sequence) or not conversations or isinstance(conversations[0], dict):
            raise ValueError("inputs['messages'] must be a list of conversations (each a list of messages)")
        return [template.encode(c) for c in conversations]
    if isinstance(inputs, Sequence) and inputs and isinstance(inputs[0], dict) and "messages" in inputs[0]:
        out = []
        for i, sample in enumerate(inputs):
            if not isinstance(sample, dict) or set(sample) != {"messages"}:
                raise ValueError(f"inputs[{i}]: a sample given as messages has the one key 'messages'")
            out.append(template.encode(sample["messages"]))
        return out
    return inputs


def has_messages(inputs) -> bool:
    if isinstance(inputs, dict):
        return "messages" in inputs
    return isinstance(inputs, Sequence) and bool(inputs) and isinstance(inputs[0], dict) and "messages" in inputs[0]


def pack(inputs, loss_kwargs: dict):
    """``set_processor(padding_free=True)``: the samples of ``inputs`` laid end to end in one row
    ``[1, T]`` (T the sum of their lengths) with ``position_ids`` restarting at 0 for each, the
    packing the facade runs as one THD row where no sample sees another
    (:mod:`twinkle_megatron.packing`). ``inputs``: a list of samples (each its own length), or a dict
    of ``[B, S]`` tensors (a row's length: its ``attention_mask`` ones, else S). Per-sample loss
    arguments follow their samples: ``[B]`` (one value per sample) fills its tokens, ``[B, S]`` /
    ``[B, S, k]`` give each sample's first ``length`` positions. Returns ``(inputs, loss_kwargs)``."""
    import torch
    if isinstance(inputs, dict):
        ids = torch.as_tensor(inputs["input_ids"])
        if ids.dim() != 2:
            raise ValueError(f"padding_free: inputs['input_ids'] must be [B, S], got {tuple(ids.shape)}")
        if "position_ids" in inputs:
            raise ValueError("padding_free packs the rows itself: give inputs without position_ids")
        mask = inputs.get("attention_mask")
        lengths = ([int(m.sum()) for m in torch.as_tensor(mask)] if mask is not None
                   else [ids.shape[1]] * ids.shape[0])
        samples = [{k: torch.as_tensor(v)[i, :n] for k, v in inputs.items() if k != "attention_mask"}
                   for i, n in enumerate(lengths)]
    elif isinstance(inputs, Sequence) and inputs and isinstance(inputs[0], dict):
        samples = []
        for i, s in enumerate(inputs):
            if "position_ids" in s or "attention_mask" in s:
                raise ValueError(f"padding_free: inputs[{i}] has position_ids / attention_mask; give each sample's "
                                 "own input_ids and labels, unpadded")
            samples.append({k: torch.as_tensor(v).reshape(-1) for k, v in s.items()})
        lengths = [len(s["input_ids"]) for s in samples]
    else:
        raise TypeError(f"padding_free: inputs must be a list of samples or a dict of [B, S] tensors, got "
                        f"{type(inputs).__name__}")
    if any(n == 0 for n in lengths):
        raise ValueError("padding_free: a sample has no tokens")
    out = {k: torch.cat([s[k] for s in samples])[None] for k in samples[0]}
    out["position_ids"] = torch.cat([torch.arange(n) for n in lengths])[None]
    b = len(lengths)
    kwargs = {}
    for k, v in loss_kwargs.items():
        if v is None:
            kwargs[k] = v
            continue
        try:
            t = torch.as_tensor(v)
        except (ValueError, TypeError, RuntimeError):
            raise ValueError(f"padding_free: {k} must be [B] or [B, S] (one list per sample as long as its loss "
                             "tokens is not taken here)") from None
        if t.dim() == 0 or t.shape[0] != b:
            raise ValueError(f"padding_free: {k} must have one entry per sample ({b}), got shape {tuple(t.shape)}")
        if t.dim() == 1:
            kwargs[k] = torch.cat([t[i].expand(n) for i, n in enumerate(lengths)])[None]
        else:
            if t.shape[1] < max(lengths):
                raise ValueError(f"padding_free: {k} has {t.shape[1]} positions, the longest sample {max(lengths)}")
            kwargs[k] = torch.cat([t[i, :n] for i, n in enumerate(lengths)])[None]
    return out, kwargs
