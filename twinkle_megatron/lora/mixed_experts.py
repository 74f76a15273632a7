"""Mixed batches through megatron's MoE token dispatcher: the adapter index follows every token
into the routed experts, whose LoRA deltas run as grouped work over (expert, adapter) segments.

How the index travels: for one mixed call, the dispatcher of every MoE layer whose experts carry
one of the call's adapters gets its ``dispatch_preprocess`` / ``combine_postprocess`` wrapped (on
the instance, undone by :meth:`ExpertRun.remove`). The wrapper appends the tokens' adapter index
(+1, so that 0 is "no adapter": the zero rows that capacity padding adds read as no adapter) to
the hidden states as one extra column, so the index goes through exactly the ops the hidden
states go through (permute by routing map, EP all-to-all, expert-TP all-gather, sort by local
expert, in megatron's alltoall dispatcher); integer ids are exact in fp32 and, up to 256, in bf16. The
experts' forward pre-hook takes the column off again; their forward hook puts a zero column back
on the output, so that the combine (un-sort, reduce-scatter, all-to-all, un-permute) sees the
width it dispatched, and the wrapped ``combine_postprocess`` drops it.

The deltas (megatron's ``SequentialMLP`` loop, which runs whenever experts carry LoRA, calls
each local expert's ``linear_fc1`` then ``linear_fc2`` on its contiguous block of the sorted
tokens): ``linear_fc1``'s delta for all local experts' tokens is two grouped matmuls over the
tokens' (expert, adapter) segments before the loop, each expert's ``linear_fc1`` hook adds its
block; each ``linear_fc2`` hook only records its input, and the experts' forward hook adds the
grouped ``linear_fc2`` delta of all of them to the experts' output (which is the blocks of the
``linear_fc2`` outputs, in order). Under expert tensor parallelism the replicated factor's
gradient is summed over the expert-TP group, as the time-shared expert adapter does.
"""
from __future__ import annotations

import functools
from typing import List

import torch

from . import grouped, linear


def check_config(config, num_adapters: int, dtype) -> None:
    """Refuse what the index column cannot follow, naming the setting."""
    # the alltoall dispatcher is the one the facade builds (and the one tested); the allgather
    # one also moves the hidden states only by row, but is not built here
    if getattr(config, "moe_token_dispatcher_type", "alltoall") != "alltoall":
        raise NotImplementedError(f"adapter_names= with adapters on routed experts needs the alltoall token "
                                  f"dispatcher, not {config.moe_token_dispatcher_type!r}")
    for flag in ("moe_apply_probs_on_input", "moe_shared_expert_overlap", "moe_router_padding_for_quantization",
                 "fp8", "fp4"):
        if getattr(config, flag, None):
            raise NotImplementedError(f"adapter_names= with adapters on routed experts and {flag} on")
    if dtype == torch.bfloat16 and num_adapters > 255:
        raise NotImplementedError(f"adapter_names= with {num_adapters} adapters on routed experts in bf16: "
                                  "the adapter index travels as a bf16 column, exact only up to 256")


class ExpertLinears:
    """The call's adapters on one linear (``fc1`` or ``fc2``) of every local expert: the stacked
    factors of the (expert, adapter) pairs, expert-major, and their scaling."""

    def __init__(self, bases: List[torch.nn.Module], names: List[str]):
        self.present = tuple(n for n in names if n in (bases[0]._modules.get("lora") or {}))
        self.modules = [[b.lora[n] for n in self.present] for b in bases]
        # the call's group index -> this linear's adapter index (-1: not here); one more for -1
        self.remap = torch.full((len(names) + 1,), -1, dtype=torch.long)
        for i, n in enumerate(names):
            if n in self.present:
                self.remap[i] = self.present.index(n)
        first = self.modules[0][0] if self.present else None
        self.kind = first.kind if first is not None else None
        self.group = first.group if first is not None and first.tp_size > 1 else None
        flat = [m for ms in self.modules for m in ms]
        # over expert-TP > 1, the replicated factor (column A, row B; as _expert_delta) sees only
        # this rank's share of the output gradient: its gradient is summed over expert-TP
        self.factors = grouped.Factors(lambda: [m.factors() for m in flat], [p for m in flat for p in m.parameters()],
                                       [m.scaling for m in flat], stacked=linear.stacked_factors(flat) if flat else None,
                                       grad_sum=(("a" if self.kind == "column" else "b"), self.group)
                                       if self.group is not None else None)

    def delta(self, x: torch.Tensor, expert: torch.Tensor, call_groups: torch.Tensor) -> torch.Tensor:
        """The deltas (scaled) of ``x`` ``[M, in]``, whose rows belong to local expert ``expert``
        ``[M]`` and to the call's adapter ``call_groups`` ``[M]`` (-1: none)."""
        g = self.remap.to(x.device)[call_groups]
        per = len(self.present)
        pair = torch.where(g >= 0, expert * per + g, torch.full_like(g, -1))
        segments = grouped.sort_by_group(pair, len(self.present) * len(self.modules))
        return grouped.grouped_lora(x.to(self.factors.params[0].dtype), segments, self.factors)


class ExpertRun:
    """One mixed call's part on one MoE layer ``layer`` (a megatron ``MoELayer`` whose experts
    are a ``SequentialMLP``): ``run`` gives the tokens' adapter index (:meth:`MixedRun.token_groups`),
    ``names`` the call's adapters in group order."""

    def __init__(self, run, layer, names: List[str]):
        self.run, self.layer = run, layer
        experts = layer.experts
        self.fc1 = ExpertLinears([e.linear_fc1 for e in experts.local_experts], names)
        self.fc2 = ExpertLinears([e.linear_fc2 for e in experts.local_experts], names)
        self._state = None
        dispatcher = layer.token_dispatcher
        # the dispatcher's own (bound) methods, called by the wrappers
        dispatcher.dispatch_preprocess = functools.partial(self._dispatch_preprocess, dispatcher.dispatch_preprocess)
        dispatcher.combine_postprocess = functools.partial(self._combine_postprocess, dispatcher.combine_postprocess)
        self.handles = [experts.register_forward_pre_hook(self._experts_pre),
                        experts.register_forward_hook(self._experts_post)]
        for i, e in enumerate(experts.local_experts):
            if self.fc1.present:
                self.handles.append(e.linear_fc1.register_forward_hook(functools.partial(self._fc1, i)))
            if self.fc2.present:
                self.handles.append(e.linear_fc2.register_forward_hook(self._fc2, with_kwargs=True))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        for attr in ("dispatch_preprocess", "combine_postprocess"):
            self.layer.token_dispatcher.__dict__.pop(attr, None)
        self._state = None

    def _dispatch_preprocess(self, original, hidden_states, routing_map, probs):
        rows, width = hidden_states.shape[0], hidden_states.shape[1]
        tag = (self.run.token_groups(rows, width) + 1).to(hidden_states.dtype)
        tagged = torch.cat([hidden_states, tag.view(rows, width, 1)], dim=-1)
        return original(tagged, routing_map, probs)

    def _combine_postprocess(self, original, hidden_states):
        return original(hidden_states)[..., :-1].contiguous()

    def _experts_pre(self, module, args):
        x, tokens_per_expert, probs = args
        call_groups = x[:, -1].detach().round().long() - 1
        x = x[:, :-1].contiguous()
        counts = torch.as_tensor(tokens_per_expert, dtype=torch.long).to(x.device).reshape(-1)
        if counts.numel() != len(self.fc1.modules) or int(counts.sum()) != x.shape[0]:
            raise RuntimeError(f"tokens_per_expert {counts.tolist()} does not cover the {x.shape[0]} "
                               f"dispatched tokens of {len(self.fc1.modules)} local experts")
        expert = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts)
        ends = torch.cumsum(counts, 0).tolist()
        state = {"expert": expert, "groups": call_groups, "bounds": list(zip([0] + ends[:-1], ends)),
                 "fc2_inputs": []}
        if self.fc1.present:
            state["fc1"] = self.fc1.delta(x, expert, call_groups)
        self._state = state
        return x, tokens_per_expert, probs

    def _fc1(self, index, module, args, output):
        out, bias = output
        start, end = self._state["bounds"][index]
        if out.shape[0] != end - start:
            raise RuntimeError(f"local expert {index}'s linear_fc1 saw {out.shape[0]} tokens, "
                               f"the dispatcher gave it {end - start}")
        return out + self._state["fc1"][start:end].to(out.dtype), bias

    def _fc2(self, module, args, kwargs, output):
        self._state["fc2_inputs"].append(args[0] if args else kwargs["input_"])

    def _experts_post(self, module, args, output):
        y, bias = output
        state, self._state = self._state, None
        if self.fc2.present:
            x2 = torch.cat(state["fc2_inputs"], 0) if len(state["fc2_inputs"]) > 1 else state["fc2_inputs"][0]
            if x2.shape[0] != y.shape[0]:
                raise RuntimeError(f"the local experts' linear_fc2 saw {x2.shape[0]} tokens, "
                                   f"their output has {y.shape[0]}")
            y = y + self.fc2.delta(x2, state["expert"], state["groups"]).to(y.dtype)
        return torch.cat([y, y.new_zeros(y.shape[0], 1)], dim=-1), bias
