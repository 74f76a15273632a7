"""MegatronModel: a training facade over a megatron-core GPTModel built from a Hugging Face config."""
from __future__ import annotations

import contextlib
import gc
import os
from typing import Dict, List, Optional

import torch

from . import config, convert, models, spec, upstream, validate
from . import template as chat_template
from .parallel.mesh import DeviceMesh, current_mesh, device_type, facade_group, initialize
from .parallel import ddp
from .layers import lm_head
from .options import OverlapOptions, PrecisionConfig, RecomputeConfig
from .training import aux_loss, call, embedding, metrics, optim, schedule
from .training import recompute as recompute_mod
from .training import step as stepping
from .training import transaction
from .training.engine import Engine, TrainState
from .training.step import NonFiniteGradientError  # noqa: F401 (public: raised by clip_grad_and_step)

_DEFAULT = object()   # forward_only / logits: adapter_name not given (None there means "no adapter")


def _state_attribute(field: str, doc: str):
    """A MegatronModel attribute kept per adapter (:class:`~twinkle_megatron.training.engine.TrainState`):
    the running call's adapter's, else the model's only adapter's (or the base's)."""
    return property(lambda self: getattr(self._state(), field),
                    lambda self, value: setattr(self._state(), field, value), doc=doc)


def _one_of(name: str, given, flat: dict, defaults: dict):
    """``given`` (a config object) or the flat keywords ``flat`` that fill it; both is a TypeError."""
    if given is not None:
        changed = sorted(k for k, v in flat.items() if v != defaults[k])
        if changed:
            raise TypeError(f"MegatronModel: give {name}= or {changed}, not both")
    return given


class TwinkleModel:
    """The training-loop interface shared by Twinkle backends."""

    def forward_backward(self, *, inputs, micro_batch_size=None, **loss_kwargs):
        raise NotImplementedError

    def clip_grad_and_step(self, max_grad_norm: float = 1.0, gradient_accumulation_steps=None):
        raise NotImplementedError


class MegatronModel(TwinkleModel):
    """A megatron-core GPTModel (TP/SP/PP/VPP/EP/DP from ``device_mesh``) behind a plain loop API.

    ``model_id`` (or ``model_dir_or_config``): a directory with ``config.json`` (and optionally
    safetensors weights, which are loaded; a folder with only a config builds a random init, one
    whose weights are not safetensors is an error naming them; ``load_bin_weights=True`` reads a
    ``pytorch_model.bin`` (or its index) instead, unpickled with ``weights_only=True``),
    ``hf://org/name`` / ``ms://org/name`` resolved offline
    from the local Hugging Face / ModelScope cache (:mod:`twinkle_megatron.hub`), a path to a
    config.json, or a config dict. ``mixed_precision``: "bf16" (bf16 params, fp32 main params and
    grads), "fp16" (the same with megatron's dynamic loss scaling; an overflowing step is skipped),
    "fp32" or "no" (= fp32). Each rank passes its own data-parallel
    share of the batch to :meth:`forward_backward`. ``use_twinkle_kernels``: build the layers from
    :mod:`twinkle_megatron.spec` (norms, rotary, SwiGLU, experts on twinkle_kernels); the default
    (None) turns it on where twinkle_kernels has a fast backend for the model's device (the C++
    extension on the CPU, Triton on CUDA, torch_npu on Ascend: ``twinkle_kernels.default_backend``
    not ``"reference"``), and False builds megatron's local spec (the comparison path).
    ``fused_linear_ce`` (default: ``use_twinkle_kernels``): the last pipeline stage computes the
    per-token log-probs / entropy (hence every loss) from the final hidden states and the output
    weight shard with ``twinkle_kernels``' fused linear cross-entropy, never holding the
    [tokens, V / tp] logits (:mod:`twinkle_megatron.layers.lm_head`); :meth:`logits` is unchanged.
    ``router_aux_loss_coef``: the MoE load-balancing loss's coefficient (default: the HF config's
    ``router_aux_loss_coef`` when its ``output_router_logits`` is on, else 0 = off, as in
    transformers); the loss is transformers' (:mod:`twinkle_megatron.training.aux_loss`).
    ``recompute_*``: megatron's activation recompute (:class:`~twinkle_megatron.options.RecomputeConfig`);
    ``overlap_grad_reduce``, ``overlap_param_gather``, ``bucket_size``: megatron's DDP overlap
    (:class:`~twinkle_megatron.options.OverlapOptions`). The same settings may come as config
    objects instead, from :mod:`twinkle_megatron.options`: ``precision=PrecisionConfig(...)``,
    ``recompute=RecomputeConfig(...)``, ``overlap=OverlapOptions(...)`` (not together with their flat
    keywords). Either way the object checks itself when made, with the same error. Upstream
    Twinkle's ``ddp_config`` (its overlap keys), ``use_distributed_optimizer`` (the default of
    :meth:`set_optimizer`) and ``variable_seq_lengths`` are accepted (:mod:`twinkle_megatron.upstream`).

    The model, megatron's config, the mesh and every adapter's train state are held by
    :attr:`engine` (:class:`~twinkle_megatron.training.engine.Engine`); each method resolves the
    adapter it runs once and calls the training functions with the engine and that state.
    """

    def __init__(self, model_id=None, device_mesh: Optional[DeviceMesh] = None,
                 mixed_precision: str = "bf16", *, seed: int = 42, load_weights: bool = True,
                 use_twinkle_kernels: Optional[bool] = None, fused_linear_ce: Optional[bool] = None,
                 model_dir_or_config=None, router_aux_loss_coef: Optional[float] = None,
                 recompute_granularity: Optional[str] = None, recompute_method: Optional[str] = None,
                 recompute_num_layers: Optional[int] = None, recompute_modules=None,
                 overlap_grad_reduce: Optional[bool] = None, overlap_param_gather: Optional[bool] = None,
                 bucket_size: Optional[int] = None,
                 precision: Optional[PrecisionConfig] = None, recompute: Optional[RecomputeConfig] = None,
                 overlap: Optional[OverlapOptions] = None, load_bin_weights: bool = False,
                 ddp_config: Optional[dict] = None, use_distributed_optimizer: Optional[bool] = None,
                 variable_seq_lengths: Optional[bool] = None, **kwargs):
        upstream.refuse_unknown("MegatronModel", kwargs)
        upstream.variable_seq_lengths(variable_seq_lengths)
        if use_distributed_optimizer is not None and not isinstance(use_distributed_optimizer, bool):
            raise TypeError(f"use_distributed_optimizer must be a bool, got {use_distributed_optimizer!r}")
        if (model_id is None) == (model_dir_or_config is None):
            raise TypeError("MegatronModel needs exactly one of model_id or model_dir_or_config")
        model_dir_or_config = model_id if model_dir_or_config is None else model_dir_or_config
        if isinstance(model_dir_or_config, (str, os.PathLike)):
            from .hub import resolve_model_id
            model_dir_or_config = resolve_model_id(model_dir_or_config)
        # the config objects, or the flat keywords that fill them
        precision = _one_of("precision", precision, {"mixed_precision": mixed_precision},
                            {"mixed_precision": "bf16"}) or PrecisionConfig(mixed_precision)
        recompute = _one_of("recompute", recompute,
                            {"recompute_granularity": recompute_granularity, "recompute_method": recompute_method,
                             "recompute_num_layers": recompute_num_layers, "recompute_modules": recompute_modules},
                            dict.fromkeys(("recompute_granularity", "recompute_method", "recompute_num_layers",
                                           "recompute_modules"))) or RecomputeConfig(
            recompute_granularity, recompute_method, recompute_num_layers, recompute_modules)
        no_overlap = {"overlap_grad_reduce": False, "overlap_param_gather": False, "bucket_size": None}
        given = {"overlap_grad_reduce": overlap_grad_reduce, "overlap_param_gather": overlap_param_gather,
                 "bucket_size": bucket_size}
        # None = not given (off): an explicit False next to ddp_config's True is a clash too
        flat = upstream.ddp_options(ddp_config, given, dict.fromkeys(given))
        flat = {k: no_overlap[k] if v is None else v for k, v in flat.items()}
        overlap = _one_of("overlap", overlap, flat, no_overlap) or OverlapOptions(**flat)
        for name, value, cls in (("precision", precision, PrecisionConfig),
                                 ("recompute", recompute, RecomputeConfig),
                                 ("overlap", overlap, OverlapOptions)):
            if not isinstance(value, cls):
                raise TypeError(f"{name} must be a {cls.__name__}, got {type(value).__name__}")
        mesh = device_mesh or current_mesh()
        if mesh is None:
            raise ValueError("device_mesh is required (or call twinkle_megatron.initialize(mesh) first)")
        self.hf_config = config.load_hf_config(model_dir_or_config)
        self.shape = config.model_shape(self.hf_config)
        validate.check_model_shape(self.shape)
        s = self.shape
        mesh.check_model(num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
                         num_layers=s.num_layers, num_experts=s.num_experts or None)
        mesh = mesh.for_model(num_experts=s.num_experts or None)   # decides an undecided sequence_parallel
        if s.vocab_size % mesh.tp_size:
            raise ValueError(f"vocab_size={s.vocab_size} is not divisible by tp_size={mesh.tp_size}")
        recompute_cfg = recompute.fields(s, mesh)
        self.overlap = overlap
        if not mesh.same_groups(current_mesh()):
            initialize(mesh, seed=seed)
        self.mesh = mesh
        self.precision = precision
        self.mixed_precision = precision.mixed_precision
        self.dtype = precision.dtype
        self.device = torch.device(device_type(), torch.cuda.current_device()) if device_type() == "cuda" \
            else torch.device(device_type())
        self.config = config.transformer_config(s, mesh, params_dtype=self.dtype,
                                                on_cpu=self.device.type == "cpu", recompute=recompute_cfg)
        torch.manual_seed(seed)
        self.seed = seed
        if use_twinkle_kernels is None:
            import twinkle_kernels
            use_twinkle_kernels = twinkle_kernels.default_backend(self.device) != "reference"
        self.use_twinkle_kernels = bool(use_twinkle_kernels)
        self.fused_linear_ce = self.use_twinkle_kernels if fused_linear_ce is None else bool(fused_linear_ce)
        # The one place where local or twinkle_kernels layer modules, and the LM-head loss path, are chosen.
        self.spec_provider = spec.spec_provider(self.use_twinkle_kernels, context_parallel=mesh.cp_size > 1,
                                                fused_linear_ce=self.fused_linear_ce)
        self.model_dir = None
        if isinstance(model_dir_or_config, (str, os.PathLike)) and os.path.isdir(model_dir_or_config):
            self.model_dir = os.fspath(model_dir_or_config)
        loading = self.model_dir is not None and load_weights and _has_weights(self.model_dir, load_bin_weights)
        # loaded weights overwrite every parameter (load_hf_weights refuses to leave one unset),
        # so megatron's CPU init of the big ones is not drawn first
        chunks = spec.build_chunks(s, self.config, models.family(s.model_type).layer_specs(s, self.spec_provider),
                                   self.spec_provider, mesh.vpp_size, self.device, initialize_weights=not loading)
        recompute_mod.keep_grad_path(chunks, self.config)
        lm_head.contiguous_logit_grads(chunks)
        aux, aux_exchange = aux_loss.build(self.hf_config, s, mesh, chunks, router_aux_loss_coef)
        if loading:
            convert.load_hf_weights(chunks, s, self.model_dir, allow_bin=load_bin_weights)
        #: the training engine: the chunks and their wraps, megatron's config, the mesh, the aux
        #: loss, the LM-head path, and every adapter's train state (see training/engine.py)
        self.engine = Engine(chunks=chunks, config=self.config, mesh=mesh, device=self.device, dtype=self.dtype,
                             aux=aux, aux_exchange=aux_exchange,
                             heads=[self.spec_provider.output_head(c) for c in chunks], overlap=self.overlap,
                             shape=s)
        self.engine.fuse_wgrad = self.use_twinkle_kernels and self.device.type == "cpu"
        self.template = None          # set_template: conversations given as messages are encoded with it
        self.padding_free = False     # set_processor(padding_free=True): each call's samples packed in one row
        #: set_optimizer's use_distributed_optimizer when it is not given (upstream's constructor keyword)
        self.use_distributed_optimizer = bool(use_distributed_optimizer)
        self.adapters = {}            # adapter name -> twinkle_megatron.lora.Adapter
        self._active = None           # the TrainState of the call running now (None: between calls)

    optimizer = _state_attribute("optimizer", "megatron's optimizer (per adapter)")
    opt_config = _state_attribute("opt_config", "the optimizer's OptimizerConfig (per adapter)")
    lr_scheduler = _state_attribute("lr_scheduler", "megatron's OptimizerParamScheduler (per adapter)")
    cur_step = _state_attribute("cur_step", "optimizer steps taken (per adapter)")
    consumed_train_samples = _state_attribute("consumed_train_samples", "samples trained on (per adapter)")
    accumulated_calls = _state_attribute("accumulated_calls", "clip_grad_and_step calls since the last "
                                         "optimizer step (per adapter)")
    loss = _state_attribute("loss", "the set_loss loss (per adapter)")
    ddp_config = _state_attribute("ddp_config", "the DDP config of the wrapped chunks (per adapter)")

    # ---- which adapter a call runs (see lora.tenants) ------------------------------------------

    def _have(self) -> str:
        return ", ".join(f"adapter {n!r}" for n in self.adapters) or "no adapter"

    def _resolve(self, adapter_name, *, base: bool = False) -> TrainState:
        """The TrainState a call with ``adapter_name`` runs: None (or, with ``base``, _DEFAULT) is
        the model's only adapter (or the base model without adapters); with ``base``, None is the
        base model with no adapter."""
        states = self.engine.states
        if adapter_name is _DEFAULT or (adapter_name is None and not base):
            if len(self.adapters) > 1:
                raise ValueError(f"adapter_name is required: this model has {self._have()}")
            return states[next(iter(self.adapters), None)]
        if adapter_name is None:
            return states[None]
        if not isinstance(adapter_name, str):
            raise TypeError(f"adapter_name must be a string or None, got {type(adapter_name).__name__}")
        if adapter_name not in self.adapters:
            raise ValueError(f"adapter_name={adapter_name!r}: this model has {self._have()}")
        return states[adapter_name]

    def _state(self) -> TrainState:
        return self._active if self._active is not None else self._resolve(None)

    def train_state(self, adapter_name: Optional[str] = None) -> TrainState:
        """What training changes for adapter ``adapter_name`` (None: the only adapter, or the base
        model without adapters): its optimizer, scheduler, loss, metrics and counters
        (:class:`~twinkle_megatron.training.engine.TrainState`)."""
        return self._resolve(adapter_name)

    @contextlib.contextmanager
    def _using(self, adapter_name=None, *, base: bool = False, forward: bool = False):
        """Run the body as adapter ``adapter_name``'s call (:meth:`_resolve`); yields its state.
        Unless the call is a ``forward`` (whose DDP hooks wait), in-flight param gathers finish."""
        from .lora import tenants
        state = self._resolve(adapter_name, base=base)
        if not forward:
            ddp.finish_param_gather(*self.engine.all_wrapped())
        if self._active is not None:   # a call inside a call (clip_grad_and_step -> step)
            if self._active is not state:
                raise RuntimeError(f"adapter {state.name!r} used inside a call of adapter {self._active.name!r}")
            yield state
            return
        self._active = state
        tenants.activate(self.adapters, state.name)
        try:
            yield state
        finally:
            self._active = None
            tenants.rest(self.adapters)

    # ---- construction ----------------------------------------------------------------------

    @property
    def model(self) -> List[torch.nn.Module]:
        """The DDP-wrapped chunks of the running adapter (wrapped on first use: the distributed
        optimizer needs DDP's buffers laid out for it, so set_optimizer decides)."""
        return self.engine.wrapped(self._state())

    # ---- LoRA (see lora/) ---------------------------------------------------------------------

    def add_adapter_to_model(self, adapter_name: str, config, gradient_accumulation_steps: int = 1):
        """Freeze the base weights and add the LoRA adapter ``adapter_name`` (``config``: a
        ``peft.LoraConfig`` or a dict of its fields; see :mod:`twinkle_megatron.lora` for what it
        honours and targets). Adapters are kept by name in :attr:`adapters`, any number of them,
        each with its own rank, alpha, targets and dropout, and its own optimizer, LR scheduler,
        loss, metrics, step count and accumulation (the ``adapter_name=`` of the other calls);
        one may be added at any time, also after others have trained. Not after
        :meth:`set_optimizer` for the base model (that optimizer holds the base weights). With
        ``gradient_accumulation_steps=N`` the adapter's optimizer steps on every N-th
        :meth:`clip_grad_and_step` call (the others return None), the loss being the token mean
        over all N calls. Collective: every rank calls it."""
        from . import lora
        from .lora import tenants
        states = self.engine.states
        if adapter_name in self.adapters:
            raise ValueError(f"adapter_name={adapter_name!r}: this model already has adapter {adapter_name!r} "
                             "(remove_adapter it first to start it afresh)")
        if states[None].optimizer is not None:
            raise RuntimeError("add_adapter_to_model must be called before set_optimizer (the "
                               "optimizer would hold the frozen base weights)")
        if self._active is not None:
            raise RuntimeError("add_adapter_to_model cannot run inside another call")
        try:
            adapter = lora.add_adapter(self, adapter_name, config, gradient_accumulation_steps)
        finally:
            tenants.rest(self.adapters)   # add_adapter froze every parameter before adding its own
        self.adapters[adapter_name] = adapter
        states[adapter_name] = TrainState(adapter_name)
        # the base's own wrap (if it was used) held grad buffers for the now frozen base weights;
        # each adapter gets its own wrap on first use (lora.tenants)
        states[None] = TrainState(None)
        tenants.rest(self.adapters)
        return adapter

    def remove_adapter(self, adapter_name: str) -> None:
        """Remove adapter ``adapter_name``: its modules, parameters, grad buffers, optimizer and
        scheduler state go (freed once nothing else holds them); the name can be added again."""
        from .lora import tenants
        if self._active is not None:
            raise RuntimeError("remove_adapter cannot run inside another call")
        if not isinstance(adapter_name, str) or adapter_name not in self.adapters:
            raise ValueError(f"adapter_name={adapter_name!r}: this model has {self._have()}")
        adapter = self.adapters.pop(adapter_name)
        for handle in adapter.handles:
            handle.remove()
        for chunk in self.engine.chunks:
            for module in chunk.modules():
                slots = module._modules.get("lora")
                if isinstance(slots, torch.nn.ModuleDict) and adapter_name in slots:
                    del slots[adapter_name]
                    if not len(slots):
                        del module.lora
        del self.engine.states[adapter_name]
        # megatron's config may still point at the removed adapter's DDP and optimizer
        self.engine.release()
        tenants.rest(self.adapters)
        del adapter
        gc.collect()

    # ---- optimizer / schedule ---------------------------------------------------------------

    def set_optimizer(self, optimizer_cls: str = "AdamW", *, lr: float = 1e-4, weight_decay: float = 0.01,
                      betas=(0.9, 0.999), eps: float = 1e-8, use_distributed_optimizer: Optional[bool] = None,
                      adapter_name: Optional[str] = None, **kwargs):
        """Adam(W) through megatron's optimizer (no weight decay on biases and norms).

        ``optimizer_cls``: "AdamW", "Adam" or "default": megatron's Adam, with decoupled weight
        decay as megatron-core (``OptimizerConfig(optimizer="adam")``) and upstream Twinkle apply it;
        ``decoupled_weight_decay=False`` adds it to the gradient instead (L2, torch's ``Adam``);
        megatron's "MegatronDistributedOptimizer" is the same with ``use_distributed_optimizer=True``;
        the first positional argument. Also accepted: ``adam_beta1`` / ``adam_beta2`` / ``adam_eps``
        (megatron's spellings); anything else is a TypeError naming it. ``adapter_name``: the adapter this optimizer trains (None: the only
        adapter, or the base model without adapters); each adapter has its own."""
        with self._using(adapter_name) as state:
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
            name = str(optimizer_cls).lower()
            if name not in ("adamw", "adam", "default", "megatrondistributedoptimizer"):
                raise ValueError(f"optimizer_cls={optimizer_cls!r} is not supported: AdamW, Adam, default, "
                                 "MegatronDistributedOptimizer")
            if name == "megatrondistributedoptimizer":
                if use_distributed_optimizer is False:
                    raise ValueError("set_optimizer('MegatronDistributedOptimizer', use_distributed_optimizer=False) "
                                     "contradicts itself: that name is the distributed optimizer; use 'AdamW' for "
                                     "the plain one")
                use_distributed_optimizer = True
            if use_distributed_optimizer is None:   # the constructor's choice (default off, as megatron-core)
                use_distributed_optimizer = self.use_distributed_optimizer
            betas = (kwargs.pop("adam_beta1", betas[0]), kwargs.pop("adam_beta2", betas[1]))
            eps = kwargs.pop("adam_eps", eps)
            decoupled = kwargs.pop("decoupled_weight_decay", True)
            if not isinstance(decoupled, bool):
                raise TypeError(f"decoupled_weight_decay must be a bool, got {decoupled!r}")
            if kwargs:
                raise TypeError(f"set_optimizer: unknown argument(s) {sorted(kwargs)}")
            if state.name is None and not any(p.requires_grad for c in self.engine.chunks for p in c.parameters()):
                # LoRA froze the base weights and remove_adapter does not thaw them: megatron would
                # fail on a DDP wrap that has nothing to train ('no attribute ddp_config')
                raise ValueError("set_optimizer: this model has no trainable parameters (its base weights were "
                                 "frozen when a LoRA adapter was added and stay frozen after remove_adapter); "
                                 "add an adapter with add_adapter_to_model(name, config) first")
            if state.model is None:
                self.engine.wrapped(state, use_distributed_optimizer)
            elif state.ddp_config.use_distributed_optimizer != use_distributed_optimizer:
                raise RuntimeError("use_distributed_optimizer cannot change after the model was first "
                                   "used: call set_optimizer before forward_backward")
            fp16 = self.dtype == torch.float16
            state.opt_config = OptimizerConfig(
                optimizer="adam", lr=lr, min_lr=0.0, weight_decay=weight_decay, adam_beta1=betas[0],
                adam_beta2=betas[1], adam_eps=eps, clip_grad=0.0, bf16=self.dtype == torch.bfloat16,
                fp16=fp16, loss_scale=None, initial_loss_scale=2.0 ** 16 if fp16 else 2.0 ** 32,
                params_dtype=self.dtype, use_distributed_optimizer=use_distributed_optimizer,
                decoupled_weight_decay=decoupled)
            state.optimizer = get_megatron_optimizer(state.opt_config, self.engine.wrapped(state))
            optim.use_fused_adam(state.optimizer)
            # clip_grad_and_step's one-pass AdamW (training/fused_adam.py) goes with the kernels
            state.fused_step = self.use_twinkle_kernels
            # fp16: megatron's schedules multiply each micro-batch loss by the dynamic loss scale
            self.engine.bind(state)
            for group in state.optimizer.param_groups:
                group["lr"] = lr
            return state.optimizer

    def set_lr_scheduler(self, scheduler_cls: str = "CosineWarmupScheduler", num_warmup_steps: Optional[int] = None,
                         num_training_steps: Optional[int] = None, min_lr: Optional[float] = None, *,
                         lr_warmup_steps: Optional[int] = None, lr_decay_steps: Optional[int] = None,
                         max_lr: Optional[float] = None, adapter_name: Optional[str] = None, **kwargs):
        """Cosine, linear or constant decay after a linear warmup, through megatron's
        ``OptimizerParamScheduler``; stepped once per optimizer step.

        ``scheduler_cls``: CosineWarmupScheduler / CosineAnnealingLR / default / OptimizerParamScheduler
        (cosine), LinearWarmupScheduler / LinearLR (linear), constant. Warmup steps:
        ``num_warmup_steps`` or ``lr_warmup_steps``; decay steps: ``num_training_steps``,
        ``lr_decay_steps`` or torch's ``T_max`` / ``total_iters``; ``max_lr`` (default: the
        optimizer's lr) and ``min_lr`` (also ``eta_min``, default 0). ``adapter_name``: whose
        optimizer it schedules (as :meth:`set_optimizer`)."""
        with self._using(adapter_name) as state:
            if state.optimizer is None:
                raise RuntimeError(stepping.missing_optimizer(state.name, "set_lr_scheduler"))
            state.lr_scheduler = optim.lr_scheduler(
                state.optimizer, state.opt_config, scheduler_cls, num_warmup_steps=num_warmup_steps,
                num_training_steps=num_training_steps, min_lr=min_lr, lr_warmup_steps=lr_warmup_steps,
                lr_decay_steps=lr_decay_steps, max_lr=max_lr, **kwargs)
            return state.lr_scheduler

    def set_loss(self, loss="cross_entropy", *, adapter_name: Optional[str] = None, **kwargs):
        """The training loss: a name (``cross_entropy`` (default), ``grpo``, ``dr_grpo``, ``bnpo``,
        ``gspo``, ``cispo``, ``sapo``, ``dpo``, ``simpo``, ``cpo``, ``orpo``, ``gkd``, or their class names
        such as ``"GRPOLoss"``; ``"InfonceLoss"`` is the loss of ``task='embedding'``), a loss class
        (built with ``kwargs``) or an instance on the :mod:`twinkle_megatron.training.losses` interface.
        Per-sample arguments (``advantages``, ``old_logps``, ``ref_logps``; GKD's
        ``teacher_topk_logps`` / ``teacher_topk_indices``) go to :meth:`forward_backward`.
        ``adapter_name``: the adapter it trains (None: the only one)."""
        with self._using(adapter_name) as state:
            state.loss = embedding.resolve_loss(loss, **kwargs)
            return state.loss

    def add_metric(self, name, fn=None, *, needs_entropy: bool = False, adapter_name: Optional[str] = None,
                   is_training: Optional[bool] = None, **kwargs):
        """Report ``name`` from :meth:`forward_backward`, :meth:`forward_only` and
        :meth:`calculate_metric`: ``fn(inputs)`` gets each micro-batch's
        :class:`~twinkle_megatron.training.losses.LossInputs` (per-token ``logps``, ``loss_mask``,
        ``entropy`` (with ``needs_entropy=True``), ``advantages`` / ``old_logps`` / ``ref_logps``
        and the other loss arguments, [N, S]) and returns ``(sum, count)``; the reported value is
        the total sum over the total count (micro-batches, calls and DP ranks), as for a loss's
        own metrics. Computed without gradients. ``adapter_name``: whose calls report it (None:
        the only adapter's).

        Upstream Twinkle's form: ``add_metric(metric, **kwargs)`` with ``metric`` a class of
        :mod:`twinkle_megatron.training.metrics` (``DPOMetric``, ``GRPOMetric``, ``GSPOMetric``,
        ``CISPOMetric``, ``Accuracy``) or its name, built with ``kwargs`` (``beta=``, ``epsilon=``, ...): it
        reports upstream's keys (``'rewards/margins'``, ``'train/approx_kl'``, ``'accuracy'``, ...).
        ``Accuracy``: the fraction of loss positions whose label is the argmax of the logits that
        predict it (``'accuracy'``), with ``'correct_tokens'`` / ``'total_tokens'`` as totals.
        Upstream's ``CompletionRewardMetric`` is kept by the script itself, not added here.
        ``is_training``: True reports in training calls only, False in :meth:`forward_only` only,
        None both. An unknown name is a ValueError, an unknown keyword a TypeError."""
        with self._using(adapter_name) as state:
            metrics.register(state.user_metrics, name, fn, needs_entropy=needs_entropy, is_training=is_training,
                             kwargs=kwargs)

    # ---- training step ----------------------------------------------------------------------

    def forward_backward(self, *, inputs, micro_batch_size: Optional[int] = None, return_logps: bool = False,
                         return_entropy: bool = False, temperature: float = 1.0,
                         adapter_name: Optional[str] = None, adapter_names=None, return_logits: bool = False,
                         task: str = "causal_lm", **loss_kwargs):
        """Forward and backward over ``inputs`` (this rank's share), accumulating grads.

        Runs megatron's pipeline schedule over micro-batches of ``micro_batch_size`` rows (default:
        the whole batch) with the loss of :meth:`set_loss` (cross entropy by default).
        ``loss_kwargs``: the loss's per-sample arguments — ``advantages`` ([B] or [B, S]),
        ``old_logps`` / ``ref_logps`` ([B, S] aligned with ``labels``, or one list per sample as
        long as its loss tokens); for ``gkd``, ``teacher_topk_logps`` / ``teacher_topk_indices``
        ([B, S, k], aligned like ``logps``: position t is the teacher's distribution of token t
        given the tokens before it, as vLLM's ``prompt_logprobs``), or full-vocabulary
        ``teacher_logits`` ([B, S, V], as a model returns them) — sliced per micro-batch with their
        rows. ``temperature`` divides the logits before the log-softmax. ``position_ids`` that
        restart at 0 inside a row pack several samples into it (:mod:`twinkle_megatron.packing`):
        each micro-batch then runs as one THD row with megatron's ``PackedSeqParams`` and no sample
        sees another. ``attention_mask`` may only mark right padding.

        Checked on every rank before the schedule runs (ValueError / TypeError on every rank):
        ``inputs`` keys (``input_ids``, ``labels``, ``position_ids``, ``attention_mask``; any other
        key is refused, a close misspelling named, ``cu_seqlens`` / ``packed_seq_params`` pointed at
        ``position_ids``), and every loss argument's shape, dtype and values at the loss positions
        (finite; GKD's top-k ids integer, in the vocabulary and distinct per position, its top-k
        log-probs float, <= 0, not all -inf, summing to <= 1 in probability). The ranks of one
        data-parallel replica must be given equal loss arguments and ``routed_experts``: a mismatch raises
        :class:`~twinkle_megatron.validate.InputMismatchError` on every rank. A call that raises
        leaves no trace: grads (as before *this* call, so earlier calls' accumulation stays),
        loss count, meters, sample count and RNG are put back
        (:mod:`twinkle_megatron.training.transaction`).

        Returns, on every rank, ``{'loss': loss over all DP ranks (float), 'count': what it is
        normalised by, 'num_tokens': loss tokens, <the loss's metrics>}`` plus ``'logps'`` /
        ``'entropy'`` ([B, S] fp32 CPU, as in :meth:`forward_only`) when asked, and ``'logits'``
        with ``return_logits=True`` (as in :meth:`forward_only`).

        ``task`` (upstream Twinkle's): ``'causal_lm'`` (the default) or ``'embedding'``
        (:mod:`twinkle_megatron.training.embedding`), any other a ValueError. With
        ``'embedding'`` each row of ``inputs`` is one sentence: a list of samples
        ``{'input_ids', 'attention_mask', 'labels': [1] or [0], 'position_ids'}`` as upstream's
        embedding scripts build them, or ``input_ids`` / ``attention_mask`` [B, S] (right padding)
        and ``labels`` [B]: 1 starts a group (its anchor), 0 continues it (its positive, then
        hard negatives). Its embedding is the final hidden state (after the final norm, not the
        logits) at its last real token, L2-normalised; the loss is :meth:`set_loss`'s
        ``'InfonceLoss'`` (``temperature``, ``use_batch``: the in-batch negatives of a
        micro-batch over every data-parallel rank, ``hard_negatives``, ``mask_fake_negative``,
        ``include_qq``, ``include_dd``), the mean over the call's groups; any other loss is a
        ValueError, as are labels that are not 0 / 1 or a group without a positive. Returns
        ``{'loss', 'count' (groups), 'num_tokens', <EmbeddingMetric's keys>, 'embeddings' [B, H]
        fp32 CPU}``. The per-token options (``adapter_names``, ``return_logps``,
        ``return_entropy``, ``temperature``, loss arguments) and conversations or
        ``set_processor(padding_free=True)`` are a TypeError there; the MoE aux loss on is a
        NotImplementedError (``router_aux_loss_coef=0``). Runs under TP, SP, PP, CP and DP.

        ``adapter_name``: the adapter trained (None: the model's only adapter; required with
        several). Only its grads accumulate, for its next :meth:`clip_grad_and_step`.
        ``adapter_names``: instead, one adapter name per row (per sample for a list of samples):
        every adapter trains on its rows in this one pass, with its own loss and the arguments
        of its rows, normalised as if its rows were sent alone; returns ``{name: its result}``
        (:mod:`twinkle_megatron.training.mixed`).

        ``routed_experts`` (MoE models): int [B, S, L_moe, k], the experts every token is routed to
        at each MoE layer (as :meth:`forward_only` returns them), replayed
        (:mod:`twinkle_megatron.training.router_replay`).
        """
        if call.check_task(task) == "embedding":
            embedding.refuse_options("forward_backward", {
                "adapter_names": adapter_names is not None, "return_logps": return_logps,
                "return_entropy": return_entropy, "temperature": temperature != 1.0,
                **dict.fromkeys(loss_kwargs, True)}, self._encoder(inputs))
            with self._using(adapter_name, forward=True) as state:
                ddp.check_overlap_call(self.overlap, state.pending_tokens)
                return embedding.run(self.engine, state, inputs, micro_batch_size, forward_only=False)
        loss_kwargs = upstream.loss_kwargs(loss_kwargs)
        routed = loss_kwargs.pop("routed_experts", None)
        if adapter_names is not None:   # mixed: one group per adapter (training.call)
            if adapter_name is not None:
                raise TypeError("forward_backward: give adapter_name or adapter_names, not both")
            return self._forward_backward_mixed(inputs, adapter_names, micro_batch_size, return_logps,
                                                return_entropy, temperature, loss_kwargs, routed,
                                                return_logits=bool(return_logits))
        with self._using(adapter_name, forward=True) as state:
            ddp.check_overlap_call(self.overlap, state.pending_tokens)
            request = call.Request(inputs, state, micro_batch_size, loss_kwargs, return_logps=return_logps,
                                   return_entropy=return_entropy, temperature=temperature, routed_experts=routed,
                                   return_logits=bool(return_logits), encode=self._encoder(inputs))
            return call.run(self.engine, call.prepare(self.engine, request))[0]

    def set_template(self, template=None, *, model_id: Optional[str] = None, adapter_name: Optional[str] = None):
        """Encode conversations given as ``inputs`` with a Hugging Face chat template (upstream
        Twinkle's ``set_template``): ``template`` is a tokenizer with ``chat_template``, a local
        folder holding one, or None for the folder the model was loaded from. Then
        :meth:`forward_backward` / :meth:`forward_only` also take ``inputs`` as a list of
        ``{"messages": [{"role", "content"}, ...]}`` samples (or ``{"messages": [conversation, ...]}``),
        tokenized by the template with labels on the assistant turns only
        (:class:`twinkle_megatron.template.ChatTemplate`).

        Upstream's form ``set_template('Template', model_id=folder, adapter_name=...)``: the chat
        template of ``model_id``'s tokenizer (a local folder) encodes; upstream's template class,
        named by ``template`` (a string or class), is not reproduced (samples its Template already
        encoded need no template here). ``adapter_name`` must name an adapter (the template is the
        model's, for all of them)."""
        if adapter_name is not None:
            self._resolve(adapter_name)
        if model_id is not None:
            if template is not None and not isinstance(template, (str, type)):
                raise TypeError("set_template: give a tokenizer or model_id= (upstream's template name with its "
                                "model folder), not both")
            template = model_id
        if template is None:
            if self.model_dir is None:
                raise ValueError("set_template(None) uses the model's folder, and this model was built from a config; "
                                 "pass a tokenizer or its folder")
            template = self.model_dir
        self.template = chat_template.ChatTemplate(chat_template.load_tokenizer(template))
        return self.template

    def set_processor(self, processor=None, *, padding_free: bool = False, adapter_name: Optional[str] = None):
        """Upstream Twinkle's ``set_processor``: ``padding_free=True`` packs each call's samples into
        one row with ``position_ids`` restarting per sample (no padding computed; no sample sees
        another), per-sample loss arguments following their samples
        (:func:`twinkle_megatron.template.pack`). ``processor``: None, "default" or
        "InputProcessor" (upstream's, also its class ``twinkle.processor.InputProcessor``; any other is a
        TypeError). ``adapter_name`` must name an adapter (the processor is the model's, for all of them)."""
        if adapter_name is not None:
            self._resolve(adapter_name)
        if isinstance(processor, type) and processor.__name__ == "InputProcessor":
            processor = "InputProcessor"   # upstream's default processor class: what this package does
        if processor not in (None, "default", "InputProcessor"):
            raise TypeError(f"set_processor: processor={processor!r} is not supported (None, 'default' or "
                            "'InputProcessor'); encode inputs yourself or use set_template for conversations")
        if not isinstance(padding_free, bool):
            raise TypeError(f"padding_free must be a bool, got {padding_free!r}")
        self.padding_free = padding_free

    def _encoder(self, inputs, mixed: bool = False):
        """The :class:`~twinkle_megatron.training.call.Request`'s ``encode``: conversations encoded
        by the template (a ValueError without one), then samples packed when ``padding_free``;
        None when there is nothing to do. Its errors are raised inside the checks every rank
        agrees on."""
        features = upstream.is_input_features(inputs)   # upstream Template's samples: labels rolled by -1
        messages = not features and chat_template.has_messages(inputs)
        if not features and not messages and not self.padding_free:
            return None
        chat, packed = self.template, self.padding_free

        def encode(x, kwargs):
            if features:
                x = upstream.input_features(x)
            elif messages:
                if chat is None:
                    raise ValueError("inputs are given as messages: call set_template(tokenizer) first")
                try:
                    x = chat_template.encode_inputs(chat, x)
                except (TypeError, ValueError, KeyError):
                    raise
                except Exception as e:   # the template's own (jinja) error: agreed by the ranks as a ValueError
                    raise ValueError(f"messages could not be encoded by the chat template: {e}") from e
            if packed:
                if mixed:
                    raise ValueError("set_processor(padding_free=True) with adapter_names: not supported (the "
                                     "names are per row); send each adapter's samples with adapter_name=")
                x, kwargs = chat_template.pack(x, kwargs)
            return x, kwargs
        return encode

    def _forward_backward_mixed(self, inputs, adapter_names, micro_batch_size, return_logps, return_entropy,
                                temperature, loss_kwargs, routed=None, return_logits=False) -> Dict[str, dict]:
        """``forward_backward(adapter_names=...)``: one group per adapter with rows on any DP rank
        (:func:`twinkle_megatron.training.call.prepare`); the LoRA side is
        :class:`twinkle_megatron.lora.mixed.MixedRun`, active while the call runs."""
        from .lora import mixed
        engine = self.engine
        if self._active is not None:
            raise RuntimeError("forward_backward cannot run inside another call")
        ddp.finish_param_gather(*engine.all_wrapped())
        trainable = [n for n in self.adapters if engine.states[n].optimizer is not None]
        request = call.Request(inputs, None, micro_batch_size, loss_kwargs, return_logps=return_logps,
                               return_entropy=return_entropy, temperature=temperature, routed_experts=routed,
                               return_logits=return_logits, adapter_names=adapter_names,
                               check_names=lambda names, rows: mixed.check_names(self.adapters, trainable, names, rows),
                               router=lambda names: mixed.MixedRun(self, names), encode=self._encoder(inputs, mixed=True))
        prepared = call.prepare(engine, request)
        run, names = prepared.call.router, prepared.names
        self._active = prepared.states[0]
        try:
            run.activate(self.adapters, names)
            results = call.run(engine, prepared)
        finally:
            run.remove(self.adapters)
            self._active = None
        return dict(zip(names, results))

    @torch.no_grad()
    def forward_only(self, *, inputs, micro_batch_size: Optional[int] = None, return_logps: bool = True,
                     return_entropy: bool = False, temperature: float = 1.0, adapter_name=_DEFAULT,
                     return_topk: Optional[int] = None, return_routed_experts: bool = False,
                     routed_experts=None, disable_lora: Optional[bool] = None, return_logits: bool = False,
                     task: str = "causal_lm", **loss_kwargs):
        """Evaluation without gradients; counted by ``calculate_metric(is_training=False)``.

        ``logps`` [B, S] fp32 (CPU) aligned with ``labels``: ``logps[b, t] = log p(labels[b, t] |
        tokens before t)`` at temperature ``temperature``, 0 where the label is -100 (and at t = 0);
        ``entropy`` likewise with ``return_entropy``. ``loss`` is the :meth:`set_loss` loss when
        its required arguments are given in ``loss_kwargs``, else the token-mean cross entropy;
        with the MoE aux loss on, ``coef * aux_loss`` is added and ``aux_loss`` reported, as
        transformers' forward does (:mod:`twinkle_megatron.training.aux_loss`).

        ``adapter_name``: the adapter evaluated (default: the model's only one; required with
        several); ``None`` runs the base model with no adapter (the reference policy of LoRA RL);
        ``disable_lora=True`` is upstream Twinkle's spelling of ``adapter_name=None``.

        ``return_topk`` = k (a positive int <= the vocabulary size, else ValueError): also
        ``topk_logps`` [B, S, k] fp32 and ``topk_indices`` [B, S, k] int64 (CPU), the top k of the
        log-softmax at ``temperature`` over the whole vocabulary, sorted descending, aligned as
        ``logps`` (position t: the distribution of token t given the tokens before it); 0 / 0 at
        t = 0 and where the label is -100. Computed without ``[tokens, V]`` logits on the fused
        LM-head path, vocab-parallel under TP: what a GKD student takes as
        ``teacher_topk_logps`` / ``teacher_topk_indices``.

        ``return_logits=True`` (upstream Twinkle's): also ``logits`` [B, S, V] fp32 (CPU), the
        model's full-vocabulary logits as a model returns them (position t: after the tokens up
        to t, predicting token t + 1; before ``temperature``), gathered over the TP and CP ranks
        and the same on every rank, as ``logps``. They take B * S * V * 4 bytes.
        ``task='embedding'`` (upstream Twinkle's): the sentence embeddings of the rows,
        ``embeddings`` [B, H] fp32 (CPU), as :meth:`forward_backward` computes them, and the
        ``'InfonceLoss'`` loss when it is the set loss and the rows have group labels (labels are
        optional here); ``return_logps`` and ``return_logits`` change nothing then (upstream's
        embedding scripts pass the latter), the other per-token options are a TypeError, the MoE aux loss a
        NotImplementedError; any other ``task`` is a ValueError.

        MoE models (:mod:`twinkle_megatron.training.router_replay`): ``return_routed_experts=True``
        also returns ``routed_experts`` [B, S, L_moe, k] int64 (CPU): the k global expert ids
        each token (position t: the token ``input_ids[b, t]``) was routed to at each MoE layer,
        layers in order, each token's ids by descending gate weight; ``routed_experts=R`` (int,
        that shape) routes every token to R's experts, the gate weights taken from the current
        router at those ids. Bad ``R`` (shape, an id >= num_experts, an id twice among one
        token's k, where ``attention_mask`` is 1): ValueError on every rank."""
        import numbers
        task = call.check_task(task)
        if disable_lora and isinstance(adapter_name, str):
            self._resolve(adapter_name)   # upstream names the adapter whose LoRA is disabled: it must exist
        adapter_name = upstream.forward_only_adapter(adapter_name, disable_lora, _DEFAULT)
        if task == "embedding":
            embedding.refuse_options("forward_only", {
                "return_entropy": return_entropy, "temperature": temperature != 1.0,
                "return_topk": return_topk is not None, "return_routed_experts": return_routed_experts,
                "routed_experts": routed_experts is not None, **dict.fromkeys(loss_kwargs, True)},
                self._encoder(inputs))
            with self._using(adapter_name, base=True, forward=True) as state:
                return embedding.run(self.engine, state, inputs, micro_batch_size, forward_only=True)
        loss_kwargs = upstream.loss_kwargs(loss_kwargs)
        if return_topk is not None and (isinstance(return_topk, bool) or not isinstance(return_topk, numbers.Integral)
                                        or not 0 < return_topk <= self.shape.vocab_size):
            raise ValueError(f"return_topk must be a positive int <= the vocabulary size "
                             f"{self.shape.vocab_size}, got {return_topk!r}")
        with self._using(adapter_name, base=True, forward=True) as state:
            request = call.Request(inputs, state, micro_batch_size, loss_kwargs, forward_only=True,
                                   return_logps=return_logps, return_entropy=return_entropy, temperature=temperature,
                                   return_topk=int(return_topk or 0), routed_experts=routed_experts,
                                   return_routed_experts=bool(return_routed_experts),
                                   return_logits=bool(return_logits), encode=self._encoder(inputs))
            return call.run(self.engine, call.prepare(self.engine, request))[0]

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
               adapter_name=_DEFAULT) -> torch.Tensor:
        """Full-vocabulary fp32 logits [B, S, V] for ``input_ids`` [B, S] (pipeline size 1 only;
        collective over the TP group). ``position_ids`` restarting at 0 inside a row pack several
        samples into it (each attends to itself only). ``adapter_name`` as in :meth:`forward_only`
        (``None``: the base model)."""
        with self._using(adapter_name, base=True) as state:
            from megatron.core import parallel_state as ps
            if self.mesh.pp_size > 1 or self.mesh.cp_size > 1:
                raise NotImplementedError("logits() needs pp_size == 1 and cp_size == 1")
            ids = torch.as_tensor(input_ids)
            pos = None if position_ids is None else torch.as_tensor(position_ids)
            error = None    # refused on every rank at once (agree_on_inputs)
            if ids.dim() != 2:
                error = ValueError(f"input_ids must be [B, S], got shape {tuple(ids.shape)}")
            elif pos is not None and pos.shape != ids.shape:
                error = ValueError(f"position_ids has shape {tuple(pos.shape)}, input_ids has "
                                   f"{tuple(ids.shape)}: they must match")
            validate.agree_on_inputs(None if error else {"input_ids": ids, "position_ids": pos}, None,
                                     self.shape.vocab_size, dp_rank=ps.get_data_parallel_rank(),
                                     same_micro_batches=False, group=facade_group(), error=error)
            return schedule.logits(self.engine, state, ids, pos)

    def clip_grad_norm(self, max_grad_norm: float = 1.0) -> float:
        """Total grad norm before clipping (over all model-parallel ranks); clips in place to
        ``max_grad_norm`` (0 or None: no clipping)."""
        with self._using() as state:
            return stepping.clip_grad_norm(self.engine, state, max_grad_norm)

    def step(self):
        """Optimizer step with the current (possibly clipped) grads."""
        with self._using() as state:
            stepping.step(self.engine, state)

    def zero_grad(self):
        with self._using() as state:
            stepping.zero_grad(self.engine, state)

    def lr_step(self):
        if self.lr_scheduler is not None:
            self.lr_scheduler.step(increment=1)

    def clip_grad_and_step(self, max_grad_norm: float = 1.0,
                           gradient_accumulation_steps: Optional[int] = None,
                           adapter_name: Optional[str] = None):
        """Clip to ``max_grad_norm``, step the optimizer and LR scheduler, zero the grads.
        Returns the pre-clip total grad norm.

        ``gradient_accumulation_steps=k`` (default: the adapter's ``gradient_accumulation_steps``
        from :meth:`add_adapter_to_model`, else 1): only every k-th call steps; the others return
        None and leave the grads accumulating (the loss normalisation then spans all k calls'
        batches exactly). With fp16, a step whose scaled grads overflowed is skipped (grads
        zeroed, lr not stepped) and returns inf.

        Non-finite gradients otherwise (every rank sees the same total norm, so all refuse together) raise
        :class:`NonFiniteGradientError` after zeroing the grads, with nothing stepped (weights,
        optimizer state, LR schedule and ``cur_step`` unchanged): catch it to skip the batch.
        Any other error leaves the counters, LR schedule and grads as they were before the call
        (a bad ``gradient_accumulation_steps`` or a missing optimizer is refused before anything
        is counted); only an error raised after the grads were reduced and scaled for the step
        drops them, as a non-finite step does (:mod:`twinkle_megatron.training.transaction`).

        ``adapter_name``: the adapter stepped (its own optimizer, clipping, accumulation counter);
        None with one adapter (or none): that one. None with several: every adapter that ran
        :meth:`forward_backward` since its last call is stepped in turn, and the result is
        ``{name: grad norm (or None while accumulating)}``; each adapter's step is its own
        transaction, so an adapter with non-finite grads is skipped (grads zeroed) while the others
        step, and then :class:`NonFiniteGradientError` names it (``.failed``) with the others'
        results (``.results``). ``max_grad_norm``: a finite number
        > 0, or None (no clipping); anything else is a ValueError before anything is counted."""
        optim.check_max_grad_norm(max_grad_norm)
        if adapter_name is None and len(self.adapters) > 1:
            due = [n for n in self.adapters if self.engine.states[n].has_grads]
            for n in due:
                if self.engine.states[n].optimizer is None:
                    raise RuntimeError(stepping.missing_optimizer(n, "clip_grad_and_step"))
            # each adapter's step is its own transaction: a tenant whose grads are not finite is
            # skipped (grads zeroed) and the others step; then the skip is raised, naming it
            results, failed = {}, {}
            for n in due:
                try:
                    results[n] = self.clip_grad_and_step(max_grad_norm, gradient_accumulation_steps, adapter_name=n)
                except stepping.NonFiniteGradientError as e:
                    failed[n] = e
            if failed:
                raise stepping.NonFiniteGradientError(
                    f"adapter(s) {sorted(failed)}: {'; '.join(str(e) for e in failed.values())}; their grads were "
                    f"zeroed and they did not step; adapter(s) {sorted(results)} stepped (their results are this "
                    "error's .results)", failed=sorted(failed), results=results)
            return results
        with self._using(adapter_name) as state:
            k = gradient_accumulation_steps
            if k is None:   # the adapter's setting
                k = self.adapters[state.name].gradient_accumulation_steps if state.name is not None else 1
            snapshot = transaction.Snapshot(self.engine, [state], grads=False, scheduler=True)
            try:
                state.has_grads = False
                return stepping.clip_grad_and_step(self.engine, state, max_grad_norm, k)
            except stepping.NonFiniteGradientError:
                raise       # the documented skip: grads zeroed, nothing stepped
            except BaseException:
                if snapshot.grads_finalised(state):
                    # the grads were already reduced and scaled: they cannot be given back as
                    # they were, so they are dropped, as a non-finite step drops them
                    stepping.zero_grad(self.engine, state)
                    snapshot.restore(keep_pending=True)
                else:
                    snapshot.restore()
                raise

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer else 0.0

    def calculate_metric(self, is_training: bool = True, adapter_name: Optional[str] = None) -> Dict[str, float]:
        """Metrics since the previous call: token-mean loss, last grad norm, lr, tokens/s, step
        (also under upstream Twinkle's names ``'learning rate'`` and ``'iters'``).
        ``is_training=False`` reports :meth:`forward_only` calls instead (no grad norm).
        ``adapter_name``: whose calls (None: the only adapter's)."""
        with self._using(adapter_name) as state:
            meter = state.metric if is_training else state.eval_metric
            out = meter.read(lr=self.current_lr(), step=self.cur_step, is_training=is_training)
            out.update(metrics.derived(state.user_metrics, out, bool(is_training)))
            return out

    def get_train_configs(self, adapter_name: Optional[str] = None) -> str:
        """The model, mesh and precision, then per adapter (``adapter_name``; None: every adapter,
        or the base model without adapters) its LoRA settings, optimizer and LR schedule."""
        if adapter_name is not None or len(self.adapters) <= 1:
            states = [self._resolve(adapter_name)]
        else:
            states = [self.engine.states[n] for n in self.adapters]
        return metrics.describe(self, states)

    # ---- checkpoints (see checkpoint/) -----------------------------------------------------

    def save(self, name: str, output_dir: str = "output", adapter_name: Optional[str] = None,
             save_optimizer: bool = False, consumed_train_samples: Optional[int] = None,
             merge_lora: bool = False, sharded: bool = False) -> str:
        """Write ``<output_dir>/<name>`` (``output_dir`` default ``"output"``, as upstream Twinkle):
        HF weights, or with an adapter its PEFT directory (``merge_lora=True``: the merged HF
        weights), with the tokenizer files of the folder the model was loaded from, when it has
        them. ``adapter_name``: which adapter (None: the only one); its optimizer and trainer state
        go with it. ``sharded=True`` (with ``save_optimizer``): that state in megatron's
        dist_checkpointing format, resumable on any mesh. Collective."""
        from . import checkpoint
        with self._using(adapter_name) as state:
            return checkpoint.save(self, name, output_dir, adapter_name=state.name, save_optimizer=save_optimizer,
                                   consumed_train_samples=consumed_train_samples, merge_lora=merge_lora,
                                   sharded=sharded)

    def get_hf_state_dict(self, adapter_name: Optional[str] = None, merge_lora: bool = False,
                          dtype: Optional[torch.dtype] = None, receivers: str = "all"):
        """The weights as ``(Hugging Face name, tensor)`` pairs, one tensor at a time: the names,
        shapes and values :meth:`save` writes (CPU tensors in the model's dtype, or ``dtype``).
        ``adapter_name`` (and ``merge_lora=False``): only that adapter, in PEFT's saved key
        names; ``merge_lora=True``: the full weights with the adapter (``adapter_name``, or the
        only one) merged into each tensor as it is yielded (the model is not changed).
        ``receivers``: ``"all"`` (every rank gets every tensor), ``"rank0"`` (global rank 0 only)
        or ``"replicas"`` (one rank per data-parallel replica: its TP / PP / CP rank 0); the
        others yield nothing. A generator, collective: every rank iterates it to the
        end (the TP / PP / EP gathers are inside). See :mod:`twinkle_megatron.weight_sync`."""
        from . import weight_sync
        ddp.finish_param_gather(*self.engine.all_wrapped())
        return weight_sync.hf_state_stream(self, adapter_name=adapter_name, merge_lora=merge_lora,
                                           dtype=dtype, receivers=receivers)

    def load(self, path: str, load_optimizer=None, adapter_name: Optional[str] = None, *,
             output_dir: Optional[str] = None) -> Dict[str, int]:
        """Restore ``path`` (see :meth:`save`; ``<output_dir>/<path>`` when ``output_dir`` is given,
        upstream Twinkle's spelling) into adapter ``adapter_name`` (None: the model's only one;
        required with several), or the base model without adapters. All or nothing: everything is
        read and checked (manifest and hashes, shapes against this model, the optimizer state,
        ``weights_only``) and every rank agrees before anything changes; a failed load leaves
        weights, optimizer, scheduler, RNG and counters as they were. ``load_optimizer``: True
        (the optimizer, scheduler, RNG state and step too; a checkpoint saved without them is a
        ValueError), False (weights only) or ``"if_present"`` (them when the checkpoint has them,
        else weights only); None (default): True for a checkpoint this package saved, weights only
        for a PEFT adapter folder that peft or upstream Twinkle wrote (it has no optimizer state).
        Collective."""
        from . import checkpoint
        if output_dir is not None:
            path = os.path.join(output_dir, path)
        with self._using(adapter_name) as state:
            return checkpoint.load(self, path, load_optimizer, state.name)

    def resume_from_checkpoint(self, path: str, resume_only_model: bool = False,
                               adapter_name: Optional[str] = None) -> Dict[str, int]:
        """:meth:`load` with the optimizer, scheduler, RNG state and step (``resume_only_model``:
        the weights only); all or nothing, like :meth:`load`."""
        return self.load(path, load_optimizer=not resume_only_model, adapter_name=adapter_name)

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index among the data-parallel replicas: which share of each global batch
        it should pass to :meth:`forward_backward` (``mesh.dp_size`` shares)."""
        from megatron.core import parallel_state as ps
        return ps.get_data_parallel_rank()

    def unwrapped_chunks(self) -> List[torch.nn.Module]:
        """The GPTModel chunks (this rank's pipeline stages)."""
        return self.engine.chunks


def _has_weights(path: str, allow_bin: bool = False) -> bool:
    """Whether the model folder ``path`` has weights to load: safetensors (or, with ``allow_bin``,
    ``pytorch_model.bin`` or its index). A folder with only a config is a random init (False); one
    whose weights are in another format (pytorch_model.bin without ``allow_bin``, a ``.pt``, ``.gguf``,
    safetensors shards without their index) is a FileNotFoundError naming what it holds: weights
    that are there but not read would otherwise train from random values without a word."""
    try:
        convert.weight_files(path, allow_bin=allow_bin)
        return True
    except FileNotFoundError:
        if convert.other_weight_files(path):
            raise
        return False




class MultiLoraMegatronModel(MegatronModel):
    """Upstream Twinkle's multi-tenant LoRA model. Every :class:`MegatronModel` here holds any
    number of adapters, each trained on its own or together in one mixed batch
    (``forward_backward(adapter_names=...)``); this name keeps upstream's capacity limits:
    ``max_loras`` adapters at once and ranks up to ``max_r``, each a ValueError naming the limit
    when :meth:`add_adapter_to_model` would pass it. ``max_length`` sizes upstream's preallocated
    buffers; nothing is preallocated here, so it is checked (a positive int) and kept as
    :attr:`max_length`, and a call may be longer."""

    def __init__(self, *args, max_loras: int = 5, max_r: int = 32, max_length: int = 8192, **kwargs):
        for name, value in (("max_loras", max_loras), ("max_r", max_r), ("max_length", max_length)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.max_loras, self.max_r, self.max_length = max_loras, max_r, max_length
        super().__init__(*args, **kwargs)

    def add_adapter_to_model(self, adapter_name: str, config, gradient_accumulation_steps: int = 1):
        if adapter_name not in self.adapters and len(self.adapters) >= self.max_loras:
            raise ValueError(f"max_loras={self.max_loras}: this model holds {len(self.adapters)} adapters "
                             f"({sorted(self.adapters)}); remove_adapter one first")
        r = config.get("r") if isinstance(config, dict) else getattr(config, "r", None)
        if isinstance(r, int) and r > self.max_r:
            raise ValueError(f"adapter {adapter_name!r} has r={r} > max_r={self.max_r}")
        return super().add_adapter_to_model(adapter_name, config, gradient_accumulation_steps)
