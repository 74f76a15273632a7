"""Copy a ``(name, tensor)`` weight stream into an existing transformers (or peft) model, in place."""
from __future__ import annotations

import re
from typing import Dict, Iterable, List, Optional, Tuple

import torch

# transformers' fused routed experts: checkpoint weights ``<...>.experts.<e>.<proj>.weight`` live in
# rows of the fused parameter ``[E, ...]`` (``gate_up_proj[e]`` is ``[gate; up]``); Mixtral's
# checkpoints name them w1 (gate), w3 (up), w2 (down)
_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_FUSED = {"gate_proj": ("gate_up_proj", 0, 2), "up_proj": ("gate_up_proj", 1, 2), "down_proj": ("down_proj", 0, 1)}
_FUSED.update(w1=_FUSED["gate_proj"], w3=_FUSED["up_proj"], w2=_FUSED["down_proj"])
_LORA = re.compile(r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B)\.([^.]+)(?=\.|$)")


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "base_model")


def _targets(model, adapter_name: Optional[str]) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """``(base, adapter)``: ``{stream name: parameter}`` for the base weights (checkpoint names) and,
    on a peft model, for adapter ``adapter_name``'s weights (PEFT's saved names, as
    ``save(adapter_name=...)`` writes them)."""
    base, adapter = {}, {}
    peft = _is_peft(model)
    for name, param in model.named_parameters():
        if peft:
            m = _LORA.search(name)
            if m:
                if m.group(2) == adapter_name:
                    adapter[name[:m.start()] + "." + m.group(1) + name[m.end():]] = param
                continue
            if not name.startswith("base_model.model."):
                continue   # e.g. modules_to_save copies: no checkpoint name of their own
            name = name[len("base_model.model."):].replace(".base_layer", "")
        base[name] = param
    # persistent buffers are checkpoint weights too (GLM / DeepSeek-V3's e_score_correction_bias)
    saved = set(model.state_dict())
    for name, buf in model.named_buffers():
        if name in saved and not (peft and not name.startswith("base_model.model.")):
            base[name[len("base_model.model."):] if peft else name] = buf
    return base, adapter


def _expert_slot(name: str, params: Dict[str, torch.Tensor]):
    """``(fused parameter name, view of its rows for ``name``)`` of a per-expert checkpoint name whose
    model keeps transformers' fused experts, else None."""
    m = _EXPERT.match(name)
    if not m:
        return None
    fused, part, parts = _FUSED[m.group("proj")]
    key = f"{m.group('experts')}.{fused}"
    if key not in params:
        return None
    param, e = params[key], int(m.group("e"))
    if e >= param.shape[0]:
        raise ValueError(f"stream tensor {name!r}: expert {e}, but {key} holds {param.shape[0]} experts")
    return key, param[e].chunk(parts, 0)[part]


@torch.no_grad()
def load_hf_weights(hf_model: torch.nn.Module, stream: Iterable[Tuple[str, torch.Tensor]],
                    adapter_name: Optional[str] = None) -> int:
    """Copy every ``(name, tensor)`` of ``stream`` into ``hf_model``'s parameters in place; returns
    the number of tensors copied.

    ``hf_model``: a transformers model (checkpoint names: ``model.layers.0.self_attn.q_proj.weight``;
    per-expert names ``...mlp.experts.<e>.gate_proj.weight`` go into the rows of transformers'
    fused ``mlp.experts.gate_up_proj`` / ``down_proj``), or a peft model. On a peft model the
    stream is either the base weights (the same checkpoint names) or adapter ``adapter_name``'s
    weights (None: the active adapter) in PEFT's saved names
    (``base_model.model.<module>.lora_A.weight``), as
    ``MegatronModel.get_hf_state_dict(adapter_name=...)`` yields them.

    Every name must be a parameter of ``hf_model`` with the same shape and dtype (cast the stream
    with ``get_hf_state_dict(dtype=...)``), and every parameter of the kind streamed (base or
    adapter) must be written: otherwise a ValueError naming the tensor. The copies go into the
    existing storage; nothing model-sized is allocated. A stream that fails halfway leaves the
    tensors before the failure written.

    The stream is plain ``(name, tensor)`` pairs in Hugging Face checkpoint names, which is what
    vLLM's ``model.load_weights(weights)`` takes as well: inside a vLLM worker,
    ``llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(stream)`` (or
    the ``collective_rpc`` equivalent of the vLLM version) loads the same stream; vLLM fuses and
    shards the names itself.
    """
    loader = _Loader(hf_model, adapter_name)
    for name, tensor in stream:
        loader.target(name, tensor).copy_(tensor)
    return loader.finish()


@torch.no_grad()
def prepare_copies(hf_model: torch.nn.Module, stream: Iterable[Tuple[str, torch.Tensor]],
                   adapter_name: Optional[str] = None) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """``[(target view in hf_model, tensor)]`` for a whole stream, every check of
    :func:`load_hf_weights` done and nothing copied yet: the caller copies (``target.copy_(t)``)
    once the whole stream is known to fit, so a bad stream leaves the model as it was."""
    loader = _Loader(hf_model, adapter_name)
    plan = [(loader.target(name, tensor), tensor) for name, tensor in stream]
    loader.finish()
    return plan


class _Loader:
    """The checks of :func:`load_hf_weights`, one stream tensor at a time."""

    def __init__(self, hf_model, adapter_name):
        if not isinstance(hf_model, torch.nn.Module):
            raise TypeError(f"hf_model must be a torch.nn.Module (a transformers or peft model), "
                            f"got {type(hf_model).__name__}")
        peft = _is_peft(hf_model)
        if adapter_name is not None and not peft:
            raise ValueError(f"adapter_name={adapter_name!r}: hf_model ({type(hf_model).__name__}) is not a peft model")
        if adapter_name is not None and adapter_name not in hf_model.peft_config:
            raise ValueError(f"adapter_name={adapter_name!r}: the peft model's adapters are "
                             f"{', '.join(repr(n) for n in hf_model.peft_config)}")
        if adapter_name is None and peft:
            adapter_name = hf_model.active_adapter
        self.peft, self.adapter_name = peft, adapter_name
        self.base, self.adapter = _targets(hf_model, adapter_name)
        self.arch = type(hf_model).__name__
        self.written, self.kind, self.count = set(), None, 0

    def target(self, name, tensor) -> torch.Tensor:
        """The parameter (or fused-expert rows) ``name`` goes into, after checking it."""
        arch = self.arch
        if not torch.is_tensor(tensor):
            raise TypeError(f"stream tensor {name!r} is a {type(tensor).__name__}, not a tensor")
        this = "adapter" if name in self.adapter else "base"
        params = self.adapter if this == "adapter" else self.base
        if self.kind is None:
            self.kind = this
        elif this != self.kind:
            raise ValueError(f"stream tensor {name!r} is {this} weight after {self.kind} weights: a stream "
                             "is either the base model's weights or one adapter's")
        if name in params:
            target = params[name]
        else:
            slot = _expert_slot(name, params)
            if slot is None:
                extra = f" (peft adapter {self.adapter_name!r} has no such weight)" if self.peft else ""
                raise ValueError(f"unexpected stream tensor {name!r}: {arch} has no parameter of that name"
                                 f"{extra}; is it the same architecture as the trained model?")
            target = slot[1]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"stream tensor {name!r} has shape {tuple(tensor.shape)}, {arch} expects "
                             f"{tuple(target.shape)}")
        if tensor.dtype != target.dtype:
            raise ValueError(f"stream tensor {name!r} is {tensor.dtype}, {arch} holds {target.dtype} "
                             "(stream it with get_hf_state_dict(dtype=...))")
        if name in self.written:
            raise ValueError(f"stream tensor {name!r} came twice")
        self.written.add(name)
        self.count += 1
        return target

    def finish(self) -> int:
        if self.kind is None:
            raise ValueError("the stream is empty")
        _check_complete(self.kind, self.base if self.kind == "base" else self.adapter, self.written, self.arch)
        return self.count


def _check_complete(kind: str, params: Dict[str, torch.Tensor], written: set, arch: str) -> None:
    """Every parameter of ``params`` written, fused experts expert by expert."""
    covered = set(written)
    for name in written:
        slot = _EXPERT.match(name)
        if slot and name not in params:
            fused, _, _ = _FUSED[slot.group("proj")]
            covered.add(f"{slot.group('experts')}.{fused}")
    missing = [n for n in params if n not in covered]
    for name, param in params.items():   # a fused experts parameter needs every expert's rows
        if name.endswith((".gate_up_proj", ".down_proj")) and name in covered and name not in written:
            prefix, fused = name.rsplit(".", 1)
            projs = ("gate_proj", "up_proj") if fused == "gate_up_proj" else ("down_proj",)
            for e in range(param.shape[0]):
                for p in projs:
                    names = [f"{prefix}.{e}.{a}.weight" for a in _FUSED if _FUSED[a] == _FUSED[p]]
                    if not any(n in written for n in names):
                        missing.append(f"{prefix}.{e}.{p}.weight")
    if missing:
        raise ValueError(f"the stream has no tensor for {kind} parameter {missing[0]!r} of {arch} "
                         f"({len(missing)} missing in all)")
