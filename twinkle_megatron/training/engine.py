"""The training engine: what a step of the facade needs, held explicitly.

:class:`Engine` holds the model (this rank's GPTModel chunks and their DDP wraps), megatron's
``TransformerConfig``, the mesh, the device and dtype, the MoE auxiliary-loss collector and its
pipeline exchange, and the LM-head loss path of each chunk (fixed when the model is built:
:meth:`twinkle_megatron.spec.LocalSpecProvider.output_head`). What training changes is kept per
adapter in a :class:`TrainState` (the base model's under the key None), owned by the engine.

The training functions take them as arguments: :func:`.schedule.run` ``(engine, call)`` (a
:class:`.call.Call` names the states it trains), :mod:`.step` ``(engine, state, ...)``. Nothing
here knows the facade; ``MegatronModel`` resolves an adapter name to its state once per call and
delegates.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Dict, List, Optional, Sequence

import torch

from . import losses, metrics


@contextlib.contextmanager
def eval_mode(modules: Sequence[torch.nn.Module], enabled: bool = True):
    """``modules`` in eval mode (dropout off, LoRA's included, as megatron's own evaluation runs)
    while inside, each restored to its own mode after, also when the body raises; ``enabled``
    False leaves them as they are."""
    modes = [(m, m.training) for m in modules] if enabled else []
    for m, _ in modes:
        m.eval()
    try:
        yield
    finally:
        for m, was_training in modes:
            m.train(was_training)


@dataclasses.dataclass
class TrainState:
    """What training changes, for one adapter (``name``) or for the base model (``name=None``:
    full training without adapters, or the frozen base that ``adapter_name=None`` runs)."""
    name: Optional[str] = None
    model: Optional[list] = None          # the DDP-wrapped chunks (made on first use: Engine.wrapped)
    ddp_config: object = None
    optimizer: object = None
    opt_config: object = None
    lr_scheduler: object = None
    loss: object = dataclasses.field(default_factory=losses.CrossEntropyLoss)
    user_metrics: Dict[str, tuple] = dataclasses.field(default_factory=dict)   # metrics.register
    metric: metrics.Meter = dataclasses.field(default_factory=metrics.Meter)       # training meter
    eval_metric: metrics.Meter = dataclasses.field(default_factory=metrics.Meter)  # forward_only meter
    cur_step: int = 0
    consumed_train_samples: int = 0
    accumulated_calls: int = 0            # clip_grad_and_step calls since the last optimizer step
    grads_ready: bool = False             # grads prepared (unscaled, checked) for this step
    pending_tokens: object = None         # loss count of the forward_backward calls not finalised yet
    skip_step: bool = False               # fp16: the step's scaled grads overflowed
    has_grads: bool = False               # a forward_backward since the last clip_grad_and_step
    # clip_grad_and_step through twinkle_kernels.adamw_step where fused_adam.eligible (set_optimizer:
    # with use_twinkle_kernels); False: megatron's own finalise, clip and optimizer step
    fused_step: bool = False


class Engine:
    """The model and everything a step needs (see the module docstring).

    ``chunks``: this rank's GPTModel chunks (one per virtual pipeline stage); ``config``: their
    ``TransformerConfig``; ``mesh``: the :class:`~twinkle_megatron.parallel.mesh.DeviceMesh`;
    ``dtype``: the parameters' dtype (bf16 / fp16 / fp32); ``aux`` / ``aux_exchange``: the MoE
    load-balancing loss's collector and pipeline exchange (:func:`.aux_loss.build`; None when
    off); ``heads``: per chunk, the output layer the fused LM-head loss reads
    (:class:`twinkle_megatron.layers.lm_head.OutputHead`), or None where the chunk returns logits;
    ``overlap``: the DDP overlap switches (:class:`twinkle_megatron.options.OverlapOptions`);
    ``shape``: the model's :class:`~twinkle_megatron.models.shape.ModelShape` (vocabulary size,
    experts), which the call checks read.
    """

    def __init__(self, *, chunks: List[torch.nn.Module], config, mesh, device: torch.device,
                 dtype: torch.dtype, aux=None, aux_exchange=None, heads=None, overlap=None, shape=None):
        from megatron.core.distributed import finalize_model_grads
        from ..parallel import ddp
        self.chunks = chunks
        self.shape = shape
        self.config = config
        self.mesh = mesh
        self.device = device
        self.dtype = dtype
        self.aux, self.aux_exchange = aux, aux_exchange
        self.heads = list(heads) if heads is not None else [None] * len(chunks)
        if len(self.heads) != len(chunks):
            raise ValueError(f"heads: one per chunk ({len(chunks)}), got {len(self.heads)}")
        self.overlap = overlap if overlap is not None else ddp.OverlapOptions()
        # megatron's DP reduction and 1 / tokens scaling of a whole grad buffer; run once per
        # step (step.finalize_grads), not at the end of every schedule call (see bind)
        self.finalize_model_grads = finalize_model_grads
        self.states: Dict[Optional[str], TrainState] = {None: TrainState(None)}
        # weight gradients added straight into DDP's main_grad where megatron can (MegatronModel sets
        # it on the CPU with twinkle kernels; ddp.fuse_wgrad_accumulation)
        self.fuse_wgrad = False

    def settle_grads(self, states: Sequence[TrainState]) -> None:
        """After the backward passes of a call: zero each ``main_grad`` of ``states``' wraps that
        the last optimizer step left stale and no write of them reached (``parallel/main_grads.py``),
        before anything reads the grads."""
        from ..parallel import main_grads
        done = []
        for st in states:
            if st.model is None or any(st is d for d in done):
                continue
            done.append(st)
            for m in st.model:
                main_grads.settle(m.parameters())

    def wrapped(self, state: TrainState, use_distributed_optimizer: bool = False) -> List[torch.nn.Module]:
        """``state``'s DDP-wrapped chunks (made on first use, with ``use_distributed_optimizer``:
        the distributed optimizer needs DDP's buffers laid out for it, so set_optimizer decides),
        with megatron's config hooks pointed at them (:meth:`bind`)."""
        from ..parallel import ddp
        if state.model is None:
            state.ddp_config = ddp.ddp_config(self.overlap, use_distributed_optimizer)
            state.model = ddp.wrap_chunks(self.chunks, self.config, state.ddp_config, self.dtype)
            state.pending_tokens = None
            if self.fuse_wgrad:
                ddp.fuse_wgrad_accumulation(state.model)
        self.bind(state)
        return state.model

    def bind(self, state: TrainState) -> None:
        """Point megatron's config hooks at ``state``: its wrap's ``no_sync``, its optimizer's fp16
        loss scale. The schedule's own ``finalize_model_grads`` call is a no-op: with several
        forward_backward calls per step it would rescale earlier calls' grads again, so each
        state's loss count is kept (``pending_tokens``) and finalised once, before its step."""
        syncs = [m.no_sync for m in state.model or () if hasattr(m, "no_sync")]
        self.config.no_sync_func = (syncs if len(syncs) > 1 else syncs[0]) if syncs else None
        self.config.finalize_model_grads_func = _no_finalize
        fp16 = self.dtype == torch.float16 and state.optimizer is not None
        self.config.grad_scale_func = state.optimizer.scale_loss if fp16 else None

    def release(self) -> None:
        """Drop megatron's config hooks (which may hold a removed adapter's wrap and optimizer)."""
        self.config.no_sync_func = None
        self.config.grad_scale_func = None

    def all_wrapped(self) -> List[Optional[list]]:
        """Every state's wrapped chunks (None where not wrapped yet)."""
        return [s.model for s in self.states.values()]


def _no_finalize(*args, **kwargs):
    return None
