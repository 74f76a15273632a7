"""Record and replay MoE routing on transformers models (router replay, R2 / R3 on the Hugging Face side).

A routing ``R`` is ``routed_experts``, int ``[B, S, L_moe, k]``: for each row and token position, the
global expert ids chosen for that token's hidden state at each MoE layer, in layer order (the layout
``MegatronModel.forward_only(return_routed_experts=True)`` returns and ``routed_experts=`` replays)::

    import twinkle_patches as tp
    with tp.record_routing(model) as rec:          # hooks on; off again when the block ends
        model(input_ids)
    R = rec.routed_experts                         # int64 [B, S, L_moe, k] (CPU)
    with tp.replay_routing(model, R) as rep:       # every MoE layer uses R's ids
        out = model(input_ids)
    print(rec.report)                              # which routers were hooked, per family

Replay keeps the model's own gate weights, as megatron's ``RouterReplay`` does: the current router's
scores (softmax or sigmoid over all experts, as the family computes them) gathered at R's ids and
renormalised where the family renormalises (:data:`twinkle_patches._specs.ROUTING`). Replaying what
was recorded gives the very same ids and bit-equal weights.

Several calls inside one session are successive positions of the same rows, as in KV-cache decoding
(a prefill of ``P`` tokens, then one ``[B, 1]`` step per token): recording appends each call's
positions, replay takes the next ones. Families: Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, Mixtral
(softmax routers) and GLM-4-MoE, DeepSeek-V3 (sigmoid routers with group-limited top-k; replay gives
any ids, the group limit is the recorder's business).

Nothing is patched at import or unless a session is opened. A session adds one forward pre-hook on
each MoE block (to learn ``B`` and ``S``: the router sees ``[B * S, H]``) and one forward hook on its
router; :meth:`RoutingSession.revert` (also the ``with`` block's end) removes exactly those handles,
so the modules' classes, ``forward`` and hook tables are the objects they were before.
"""
from __future__ import annotations

import importlib
from typing import Dict, List, Optional, Tuple

import torch

from ._report import PatchReport, Skipped, Swapped
from ._specs import FAMILIES, ROUTING, MoeRouting, PatchSpec

__all__ = ["record_routing", "replay_routing", "RoutingSession", "moe_routers", "check_routed_experts"]


def _spec(r: MoeRouting) -> PatchSpec:
    return PatchSpec(r.family, FAMILIES[r.family].module, r.router, "router", "router_replay", "router_replay")


def moe_routers(model: torch.nn.Module) -> Tuple[List[Tuple[MoeRouting, torch.nn.Module, torch.nn.Module]],
                                                 List[Skipped]]:
    """The MoE layers of ``model`` in layer order: ``[(routing entry, block, router)]``, and why
    blocks of a known family were left out (a ``gate`` of another class: replaced by someone else)."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    classes = []
    for r in ROUTING.values():
        try:
            mod = importlib.import_module(FAMILIES[r.family].module)
        except ImportError:  # a transformers without this family
            continue
        block, router = vars(mod).get(r.block), vars(mod).get(r.router)
        if isinstance(block, type) and isinstance(router, type):
            classes.append((r, block, router))
    found, skipped = [], []
    for m in model.modules():
        for r, block, router in classes:
            if isinstance(m, block):
                gate = getattr(m, "gate", None)
                if isinstance(gate, router):
                    found.append((r, m, gate))
                else:
                    skipped.append(Skipped(_spec(r), f"{type(m).__name__}.gate is {type(gate).__name__}, not "
                                                     f"{r.router}: routing not reachable"))
                break
    return found, skipped


def check_routed_experts(routed_experts, num_layers: int, top_k: int, num_experts: int,
                         name: str = "routed_experts") -> torch.Tensor:
    """``routed_experts`` as an int64 tensor ``[B, S, num_layers, top_k]`` (same device), after checking
    it: an integer tensor of that shape, every id in ``[0, num_experts)``, no id twice in one token's
    k. Anything else raises ValueError naming ``name``."""
    if not isinstance(routed_experts, torch.Tensor):
        raise ValueError(f"{name} must be an integer tensor [B, S, L_moe, k], got {type(routed_experts).__name__}")
    r = routed_experts
    if r.dtype == torch.bool or r.is_floating_point() or r.is_complex():
        raise ValueError(f"{name} must hold integer expert ids, got dtype {r.dtype}")
    if r.dim() != 4 or r.shape[2] != num_layers or r.shape[3] != top_k or r.shape[0] < 1 or r.shape[1] < 1:
        raise ValueError(f"{name} must be [B, S, L_moe={num_layers}, k={top_k}] (B, S >= 1), got "
                         f"{list(r.shape)}")
    r = r.long()
    if int(r.min()) < 0 or int(r.max()) >= num_experts:
        raise ValueError(f"{name} holds ids outside [0, {num_experts}): min {int(r.min())}, max {int(r.max())}")
    if top_k > 1:
        s = r.sort(-1).values
        dup = (s[..., 1:] == s[..., :-1]).any(-1)
        if bool(dup.any()):
            b, t, layer = (int(i) for i in dup.nonzero()[0])
            raise ValueError(f"{name} repeats an expert in one token's k: row {b}, position {t}, MoE layer {layer}: "
                             f"{r[b, t, layer].tolist()}")
    return r


def replay_weights(routing: MoeRouting, router: torch.nn.Module, logits: torch.Tensor,
                   ids: torch.Tensor) -> torch.Tensor:
    """The gate weights ``[T, k]`` of ``router`` at ``ids`` ``[T, k]`` (int64) from its logits
    ``[T, E]``, as the family computes them for its own top-k (see :class:`MoeRouting`)."""
    if routing.scoring == "softmax":
        w = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, ids)
        if getattr(router, "norm_topk_prob", True):
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(logits.dtype) if routing.cast else w
    w = logits.sigmoid().gather(1, ids)
    if router.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * router.routed_scaling_factor


class RoutingSession:
    """Hooks on every MoE layer of one model that record (``routed_experts=None``) or replay routing.

    Made by :func:`record_routing` / :func:`replay_routing`; a context manager (reverts on exit).
    Attributes: ``num_layers`` (L_moe), ``top_k``, ``num_experts``, ``report`` (a
    :class:`~twinkle_patches.PatchReport`: one ``Swapped`` per family hooked, ``where="instances"``,
    and a ``Skipped`` per unreachable block), ``mode`` ("record" or "replay")."""

    def __init__(self, model: torch.nn.Module, routed_experts: Optional[torch.Tensor] = None):
        layers, skipped = moe_routers(model)
        if not layers:
            fams = ", ".join(sorted(ROUTING))
            raise ValueError(f"model has no MoE block whose routing can be recorded or replayed (families: {fams})"
                             + (f"; {skipped[0].reason}" if skipped else ""))
        if model.training and getattr(model, "is_gradient_checkpointing", False):
            # the recomputed forward would record (or take) every position a second time
            raise NotImplementedError("router replay on a training model with gradient checkpointing: "
                                      "call model.gradient_checkpointing_disable() or model.eval() first")
        ks = {int(g.top_k) for _, _, g in layers}
        es = {int(g.num_experts) for _, _, g in layers}
        if len(ks) != 1 or len(es) != 1:
            raise ValueError(f"model: MoE layers differ in top_k {sorted(ks)} or num_experts {sorted(es)}")
        self.num_layers, self.top_k, self.num_experts = len(layers), ks.pop(), es.pop()
        self.mode = "record" if routed_experts is None else "replay"
        self._replay = None
        if routed_experts is not None:
            self._replay = check_routed_experts(routed_experts, self.num_layers, self.top_k, self.num_experts)
        self._layers = layers
        self._pending: List[Optional[Tuple[int, int]]] = [None] * len(layers)
        self._recorded: List[List[torch.Tensor]] = [[] for _ in layers]
        self._cursor = [0] * len(layers)
        self._handles = []
        self.report = PatchReport(device=_device(model), backend="torch")
        self.report.skipped.extend(skipped)
        counts: Dict[str, int] = {}
        for i, (routing, block, router) in enumerate(layers):
            self._handles.append(block.register_forward_pre_hook(self._block_hook(i), with_kwargs=True))
            self._handles.append(router.register_forward_hook(self._router_hook(i)))
            counts[routing.family] = counts.get(routing.family, 0) + 1
        for fam, n in counts.items():
            self.report.swapped.append(Swapped(_spec(ROUTING[fam]), f"router {self.mode} (forward hooks)", "torch",
                                               "instances", instances=n))
        self.report._undo.append(self._remove)

    # -- hooks ------------------------------------------------------------------------------------

    def _block_hook(self, i: int):
        def hook(module, args, kwargs):
            h = args[0] if args else kwargs.get("hidden_states")
            if h is None or h.dim() != 3:
                raise ValueError(f"router replay: MoE layer {i} got hidden states of shape "
                                 f"{None if h is None else list(h.shape)}, expected [B, S, H]")
            self._pending[i] = (int(h.shape[0]), int(h.shape[1]))
        return hook

    def _router_hook(self, i: int):
        routing = self._layers[i][0]

        def hook(module, args, output):
            if self._pending[i] is None:  # B and S come from the block's input
                raise RuntimeError(f"router replay: the router of MoE layer {i} was called outside its block")
            b, s = self._pending[i]
            self._pending[i] = None
            logits, _, ids = output
            if self._replay is None:
                self._recorded[i].append(ids.detach().reshape(b, s, self.top_k))
                return None
            r, start = self._replay, self._cursor[i]
            if b != r.shape[0] or start + s > r.shape[1]:
                raise ValueError(f"routed_experts is [B={r.shape[0]}, S={r.shape[1]}, ...] but MoE layer {i} is "
                                 f"called with B={b} at positions {start}..{start + s - 1}")
            self._cursor[i] = start + s
            forced = r[:, start:start + s, i].reshape(b * s, self.top_k).to(logits.device)
            return logits, replay_weights(routing, module, logits, forced), forced
        return hook

    # -- results and revert ---------------------------------------------------------------------------

    @property
    def routed_experts(self) -> torch.Tensor:
        """The recorded routing, int64 ``[B, S, L_moe, k]`` on the CPU (every call's positions, in
        call order). Raises RuntimeError before any forward, or in a replay session."""
        if self._replay is not None:
            raise RuntimeError("routed_experts: this session replays routing; it records nothing")
        if not all(self._recorded):
            raise RuntimeError("routed_experts: no forward has run through every MoE layer in this session")
        per_layer = [torch.cat(calls, dim=1) for calls in self._recorded]
        if len({tuple(t.shape) for t in per_layer}) != 1:
            raise RuntimeError(f"routed_experts: the MoE layers saw different positions "
                               f"{[list(t.shape) for t in per_layer]}")
        return torch.stack(per_layer, dim=2).to("cpu", torch.int64)

    @property
    def positions_replayed(self) -> int:
        """Positions of ``routed_experts`` consumed so far (by the first MoE layer)."""
        return self._cursor[0]

    def _remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def revert(self) -> None:
        """Remove the hooks (once); the recorded routing stays readable."""
        self.report._revert()

    def __enter__(self) -> "RoutingSession":
        return self

    def __exit__(self, *exc) -> None:
        self.revert()


def _device(model) -> str:
    for p in model.parameters():
        return p.device.type
    return "cpu"


def record_routing(model: torch.nn.Module) -> RoutingSession:
    """Start recording the routing of every MoE layer of ``model`` (a transformers model of a family in
    :data:`~twinkle_patches._specs.ROUTING`, or a peft model around one). Read
    ``session.routed_experts`` (int64 ``[B, S, L_moe, k]``) after the forwards; ``revert()`` or the end
    of a ``with`` block removes the hooks. ValueError when the model has no such MoE layer."""
    return RoutingSession(model)


def replay_routing(model: torch.nn.Module, routed_experts: torch.Tensor) -> RoutingSession:
    """Make every MoE layer of ``model`` route by ``routed_experts`` (int ``[B, S, L_moe, k]``) until
    ``revert()`` or the end of the ``with`` block. Gate weights: the current router's scores at those
    ids, renormalised as the family does. Bad ``routed_experts`` (shape, an id outside
    ``[0, num_experts)``, an id twice in one token's k) raises ValueError naming it, as does a forward
    whose rows or positions it does not cover."""
    return RoutingSession(model, routed_experts)
