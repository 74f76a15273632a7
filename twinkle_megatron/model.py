"""MegatronModel: a training facade over a megatron-core GPTModel built from a Hugging Face config."""
from __future__ import annotations

import functools
import math
import os
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import convert, hf_config, packing, validate
from .mesh import DeviceMesh, current_mesh, device_type, facade_group, initialize

_SCHEDULERS = {"cosinewarmupscheduler": "cosine", "cosine": "cosine",
               "linearwarmupscheduler": "linear", "linear": "linear",
               "constantscheduler": "constant", "constant": "constant"}


class NonFiniteGradientError(RuntimeError):
    """The step was refused because the gradients (or their norm) are not finite. The grads were
    zeroed and nothing was stepped: training can go on with the next batch."""


class TwinkleModel:
    """The training-loop interface shared by Twinkle backends."""

    def forward_backward(self, *, inputs, micro_batch_size=None):
        raise NotImplementedError

    def clip_grad_and_step(self, max_grad_norm: float = 1.0):
        raise NotImplementedError


def _to_batch(inputs) -> Dict[str, torch.Tensor]:
    """Normalise ``inputs`` (dict of [B,S] tensors, or list of samples) to a dict of 2-D tensors.
    Samples are right-padded (input 0, labels -100)."""
    if isinstance(inputs, dict):
        batch = {k: torch.as_tensor(v) for k, v in inputs.items() if v is not None}
    elif isinstance(inputs, Sequence) and inputs and isinstance(inputs[0], dict):
        longest = max(len(s["input_ids"]) for s in inputs)
        batch = {}
        for key, pad in (("input_ids", 0), ("labels", -100), ("position_ids", 0), ("attention_mask", 0)):
            if key not in inputs[0]:
                continue
            rows = []
            for i, s in enumerate(inputs):
                if key not in s:
                    raise ValueError(f"inputs[{i}] has no {key!r} (inputs[0] has one)")
                t = torch.as_tensor(s[key]).reshape(-1)
                if len(t) != len(s["input_ids"]):
                    raise ValueError(f"inputs[{i}][{key!r}] has length {len(t)}, input_ids has "
                                     f"{len(s['input_ids'])}")
                rows.append(torch.cat([t, t.new_full((longest - len(t),), pad)]))
            batch[key] = torch.stack(rows)
    else:
        raise TypeError(f"inputs must be a dict of tensors or a non-empty list of samples, got {type(inputs).__name__}")
    if "input_ids" not in batch or "labels" not in batch:
        raise ValueError(f"inputs needs 'input_ids' and 'labels', got keys {sorted(batch)}")
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise ValueError(f"inputs['input_ids'] must be [B, S], got shape {tuple(ids.shape)}")
    for key in ("labels", "position_ids", "attention_mask"):
        if key in batch and batch[key].shape != ids.shape:
            raise ValueError(f"inputs[{key!r}] has shape {tuple(batch[key].shape)}, "
                             f"input_ids has {tuple(ids.shape)}: they must match")
    return batch


class MegatronModel(TwinkleModel):
    """A megatron-core GPTModel (TP/SP/PP/VPP/EP/DP from ``device_mesh``) behind a plain loop API.

    ``model_dir_or_config``: a directory with ``config.json`` (and optionally safetensors weights,
    which are loaded), a path to a config.json, or a config dict. ``mixed_precision``: "bf16"
    (bf16 params, fp32 main params and grads) or "fp32". Each rank passes its own data-parallel
    share of the batch to :meth:`forward_backward`. ``use_twinkle_kernels``: build the layers from
    :mod:`twinkle_megatron.specs` (norms, rotary, SwiGLU, experts on twinkle_kernels).
    """

    def __init__(self, model_dir_or_config, device_mesh: Optional[DeviceMesh] = None,
                 mixed_precision: str = "bf16", *, seed: int = 42, load_weights: bool = True,
                 use_twinkle_kernels: bool = False):
        if mixed_precision not in ("bf16", "fp32"):
            raise ValueError(f"mixed_precision must be 'bf16' or 'fp32', got {mixed_precision!r}")
        mesh = device_mesh or current_mesh()
        if mesh is None:
            raise ValueError("device_mesh is required (or call twinkle_megatron.initialize(mesh) first)")
        self.hf_config = hf_config.load_hf_config(model_dir_or_config)
        self.shape = hf_config.model_shape(self.hf_config)
        validate.check_model_shape(self.shape)
        s = self.shape
        mesh.check_model(num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
                         num_layers=s.num_layers, num_experts=s.num_experts or None)
        if s.vocab_size % mesh.tp_size:
            raise ValueError(f"vocab_size={s.vocab_size} is not divisible by tp_size={mesh.tp_size}")
        if current_mesh() != mesh:
            initialize(mesh, seed=seed)
        self.mesh = mesh
        self.mixed_precision = mixed_precision
        self.dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float32
        self.device = torch.device(device_type(), torch.cuda.current_device()) if device_type() == "cuda" \
            else torch.device(device_type())
        self.config = hf_config.transformer_config(s, mesh, params_dtype=self.dtype,
                                                   on_cpu=self.device.type == "cpu")
        torch.manual_seed(seed)
        self.seed = seed
        self.use_twinkle_kernels = bool(use_twinkle_kernels)  # twinkle_megatron.specs
        self._chunks = self._build_chunks()
        self.model_dir = None
        if isinstance(model_dir_or_config, (str, os.PathLike)) and os.path.isdir(model_dir_or_config):
            self.model_dir = os.fspath(model_dir_or_config)
            if load_weights and _has_weights(self.model_dir):
                convert.load_hf_weights(self._chunks, s, self.model_dir)
        self._model = None
        self.optimizer = None
        self.lr_scheduler = None
        self.cur_step = 0
        self.consumed_train_samples = 0
        self._metric = _Meter()
        self._eval_metric = _Meter()
        self._grads_ready = False
        self.adapter = None           # twinkle_megatron.lora.Adapter
        self._accumulated_calls = 0   # clip_grad_and_step calls since the last optimizer step

    # ---- construction ----------------------------------------------------------------------

    def _build_chunks(self) -> List[torch.nn.Module]:
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt import GPTModel
        s, vpp = self.shape, self.mesh.vpp_size
        chunks = []
        for i in range(vpp):
            vp = i if vpp > 1 else None
            chunk = GPTModel(
                config=self.config,
                transformer_layer_spec=hf_config.block_spec(s, self.config, vp, self.use_twinkle_kernels),
                vocab_size=s.vocab_size,
                max_sequence_length=s.max_position_embeddings,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                share_embeddings_and_output_weights=s.tie_word_embeddings,
                position_embedding_type="rope",
                rotary_percent=s.partial_rotary_factor,
                rotary_base=s.rope_theta,
                vp_stage=vp,
            )
            chunks.append(chunk.to(self.device))
        return chunks

    @property
    def model(self) -> List[torch.nn.Module]:
        """The DDP-wrapped chunks (wrapped on first use: the distributed optimizer needs DDP's
        buffers laid out for it, so set_optimizer decides)."""
        if self._model is None:
            self._model = self._wrap(self._chunks, use_distributed_optimizer=False)
        return self._model

    def _wrap(self, chunks, use_distributed_optimizer: bool):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.transformer.module import Float16Module
        self.ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=use_distributed_optimizer)
        wrapped = []
        for i, chunk in enumerate(chunks):
            inner = Float16Module(self.config, chunk) if self.dtype == torch.bfloat16 else chunk
            wrapped.append(DistributedDataParallel(self.config, self.ddp_config, inner,
                                                   disable_bucketing=i > 0))
        # megatron finalises (DP all-reduce, 1/num_tokens scaling of the whole grad buffer) at the
        # end of every schedule call; with several forward_backward calls per step that would
        # rescale earlier calls' grads again. So record the tokens here and finalise once, in
        # _finalize_grads, before the step.
        self._finalize = finalize_model_grads
        self._pending_tokens = None
        self.config.finalize_model_grads_func = self._defer_finalize
        self.config.no_sync_func = [m.no_sync for m in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
        return wrapped

    # ---- LoRA (see lora.py) ------------------------------------------------------------------

    def add_adapter_to_model(self, adapter_name: str, config, gradient_accumulation_steps: int = 1):
        """Freeze the base weights and add a LoRA adapter (``config``: a ``peft.LoraConfig`` or a
        dict of its fields; see :mod:`twinkle_megatron.lora` for what it honours and targets).
        One adapter per model; call before :meth:`set_optimizer`, which then holds only the
        adapter's parameters. With ``gradient_accumulation_steps=N`` the optimizer steps on every
        N-th :meth:`clip_grad_and_step` call (the others return None), the loss being the token
        mean over all N calls."""
        from . import lora
        if self.adapter is not None:
            raise ValueError(f"adapter_name={adapter_name!r}: this model already has adapter "
                             f"{self.adapter.name!r} (one adapter per model)")
        if self.optimizer is not None:
            raise RuntimeError("add_adapter_to_model must be called before set_optimizer (the "
                               "optimizer would hold the frozen base weights)")
        self.adapter = lora.add_adapter(self, adapter_name, config, gradient_accumulation_steps)
        self._model = None  # re-wrapped so DDP's buffers hold only the adapter's parameters
        return self.adapter

    # ---- optimizer / schedule ---------------------------------------------------------------

    def set_optimizer(self, name: str = "AdamW", *, lr: float = 1e-4, weight_decay: float = 0.01,
                      betas=(0.9, 0.999), eps: float = 1e-8, use_distributed_optimizer: bool = False):
        """AdamW through megatron's optimizer (no weight decay on biases and norms)."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        if name.lower() not in ("adamw", "adam"):
            raise ValueError(f"optimizer {name!r} is not supported (AdamW)")
        if self._model is None:
            self._model = self._wrap(self._chunks, use_distributed_optimizer)
        elif self.ddp_config.use_distributed_optimizer != use_distributed_optimizer:
            raise RuntimeError("use_distributed_optimizer cannot change after the model was first "
                               "used: call set_optimizer before forward_backward")
        self.opt_config = OptimizerConfig(
            optimizer="adam", lr=lr, min_lr=0.0, weight_decay=weight_decay, adam_beta1=betas[0],
            adam_beta2=betas[1], adam_eps=eps, clip_grad=0.0, bf16=self.dtype == torch.bfloat16,
            params_dtype=self.dtype, use_distributed_optimizer=use_distributed_optimizer)
        self.optimizer = get_megatron_optimizer(self.opt_config, self.model)
        self._set_lr(lr)
        return self.optimizer

    def set_lr_scheduler(self, name: str = "CosineWarmupScheduler", num_warmup_steps: int = 0,
                         num_training_steps: int = 1, min_lr: float = 0.0):
        """Cosine (``CosineWarmupScheduler``), linear or constant, with linear warmup; stepped
        once per optimizer step."""
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        if self.optimizer is None:
            raise RuntimeError("call set_optimizer before set_lr_scheduler")
        style = _SCHEDULERS.get(name.lower())
        if style is None:
            raise ValueError(f"lr scheduler {name!r} is not supported: {sorted(_SCHEDULERS)}")
        if num_training_steps < max(1, num_warmup_steps):
            raise ValueError(f"num_training_steps={num_training_steps} must be >= num_warmup_steps="
                             f"{num_warmup_steps} and >= 1")
        wd = self.opt_config.weight_decay
        # megatron's scheduler prefers a param group's own 'min_lr' (set from OptimizerConfig,
        # 0.0) over its min_lr argument: without this the schedule would still decay to 0.
        for group in self.optimizer.param_groups:
            if "min_lr" in group:
                group["min_lr"] = min_lr
        self.lr_scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=self.opt_config.lr, min_lr=min_lr,
            lr_warmup_steps=num_warmup_steps, lr_decay_steps=num_training_steps,
            lr_decay_style=style, start_wd=wd, end_wd=wd, wd_incr_steps=num_training_steps,
            wd_incr_style="constant")
        return self.lr_scheduler

    def _set_lr(self, lr):
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def set_loss(self, name: str = "cross_entropy"):
        """Token-mean vocab-parallel cross entropy is the only loss (HF label convention)."""
        if name not in ("cross_entropy", "CrossEntropyLoss"):
            raise ValueError(f"loss {name!r} is not supported (cross_entropy)")

    # ---- training step ----------------------------------------------------------------------

    def _micro_batches(self, batch, micro_batch_size):
        ids, labels = batch["input_ids"].long(), batch["labels"].long()
        b, s = ids.shape
        pos = batch.get("position_ids")
        mask = batch.get("attention_mask")
        if mask is not None:
            mask = mask.bool()
            if (mask[:, 1:] & ~mask[:, :-1]).any():
                # Causal attention already keeps real tokens from seeing right padding; anything
                # else (left padding, arbitrary masks) would need a mask megatron's attention
                # does not take. Packed samples are given by position_ids instead.
                raise NotImplementedError("attention_mask must be right padding (1s then 0s per row); "
                                          "pack samples with position_ids restarting at 0")
            labels = labels.masked_fill(~mask, -100)
        mbs = micro_batch_size or b
        if b % mbs:
            raise ValueError(f"batch size {b} is not divisible by micro_batch_size={mbs}")
        # HF convention: the token at t predicts labels[t + 1] (within its row).
        shifted = torch.cat([labels[:, 1:], labels.new_full((b, 1), -100)], 1)
        if packing.is_packed(pos):
            return _packed_micro_batches(self.mesh, self.device, ids, shifted, pos, mask, mbs)
        cp = self.mesh.cp_size
        # Sequence splits: SP needs the per-CP-rank length divisible by tp, CP needs 2*cp chunks.
        multiple = (2 * cp if cp > 1 else 1) * (self.mesh.tp_size if self.mesh.sequence_parallel else 1)
        pad = (-s) % multiple
        shifted = torch.cat([shifted, labels.new_full((b, pad), -100)], 1)
        ids = torch.cat([ids, ids.new_zeros((b, pad))], 1)
        pos = torch.arange(s + pad).expand(b, -1)
        if cp > 1:
            from megatron.core import parallel_state as ps
            from .cp_attention import cp_positions
            keep = cp_positions((s + pad) // cp, ps.get_context_parallel_rank(), cp)
            ids, shifted, pos = ids[:, keep], shifted[:, keep], pos[:, keep]
        out = []
        for i in range(0, b, mbs):
            out.append({"input_ids": ids[i:i + mbs].to(self.device),
                        "position_ids": pos[i:i + mbs].to(self.device),
                        "labels": shifted[i:i + mbs].to(self.device)})
        return out, mbs, s + pad  # the full length: megatron divides by cp (and tp with SP)

    def forward_backward(self, *, inputs, micro_batch_size: Optional[int] = None):
        """Forward and backward over ``inputs`` (this rank's share), accumulating grads.

        Runs megatron's pipeline schedule over micro-batches of ``micro_batch_size`` rows (default:
        the whole batch). ``position_ids`` that restart at 0 inside a row pack several samples into
        it (:mod:`twinkle_megatron.packing`): each micro-batch then runs as one THD row with
        megatron's ``PackedSeqParams`` and no sample sees another (not with context parallelism).
        ``attention_mask`` may only mark right padding. Returns ``{'loss': token-mean loss over all
        DP ranks (float), 'num_tokens': int}`` on every rank.
        """
        batch = self._checked_batch(inputs, micro_batch_size)
        out = self._run_schedule(batch, micro_batch_size, forward_only=False, meter=self._metric)
        self.consumed_train_samples += len(batch["input_ids"]) * self.mesh.dp_size
        return out

    @torch.no_grad()
    def forward_only(self, *, inputs, micro_batch_size: Optional[int] = None):
        """Evaluation: the loss of ``inputs`` without gradients (same return value as
        :meth:`forward_backward`); counted by ``calculate_metric(is_training=False)``."""
        return self._run_schedule(self._checked_batch(inputs, micro_batch_size), micro_batch_size,
                                  forward_only=True, meter=self._eval_metric)

    def _checked_batch(self, inputs, micro_batch_size) -> Dict[str, torch.Tensor]:
        """``inputs`` normalised and validated on every rank at once, before any collective of the
        step (:func:`validate.agree_on_inputs`): a bad batch on one rank raises on all of them."""
        from megatron.core import parallel_state as ps
        try:
            batch, error = _to_batch(inputs), None
        except (TypeError, ValueError, KeyError) as e:
            batch, error = None, e
        validate.agree_on_inputs(batch, micro_batch_size, self.shape.vocab_size, error=error,
                                 dp_rank=ps.get_data_parallel_rank(),
                                 same_micro_batches=self.mesh.ep_size > 1, group=facade_group())
        return batch

    def _run_schedule(self, batch, micro_batch_size, *, forward_only: bool, meter) -> Dict[str, float]:
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core import parallel_state as ps
        mbs_list, mbs, seq = self._micro_batches(batch, micro_batch_size)
        start = time.perf_counter()

        def loss_func(mask, output):
            losses = output.float().reshape(-1)
            loss_sum = (losses * mask).sum()
            n = mask.sum().to(torch.int)
            return loss_sum, n, {"loss_sum_and_tokens": torch.stack([loss_sum.detach(), n.float()])}

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            labels = mb["labels"]
            mask = (labels != -100).reshape(-1).float()
            output = model(mb["input_ids"], mb["position_ids"], None, labels=labels.clamp(min=0),
                           packed_seq_params=mb.get("packed_seq_params"))
            return output, functools.partial(loss_func, mask)

        chunks = len(self.model)
        iterators = [iter(mbs_list) for _ in range(chunks)] if chunks > 1 else iter(mbs_list)
        results = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators,
            model=self.model if chunks > 1 else self.model[0], num_microbatches=len(mbs_list),
            seq_length=seq, micro_batch_size=mbs, forward_only=forward_only)
        stats = torch.zeros(2, dtype=torch.float64, device=self.device)
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            for r in results:
                stats += r["loss_sum_and_tokens"].to(torch.float64)
            dist.all_reduce(stats, group=ps.get_data_parallel_group(with_context_parallel=True))
        if self.mesh.pp_size > 1:
            last = ps.get_pipeline_model_parallel_last_rank()
            dist.broadcast(stats, src=last, group=ps.get_pipeline_model_parallel_group())
        loss_sum, tokens = float(stats[0]), int(stats[1])
        meter.add_fb(loss_sum, tokens, time.perf_counter() - start)
        return {"loss": loss_sum / max(tokens, 1), "num_tokens": tokens}

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Full-vocabulary fp32 logits [B, S, V] for ``input_ids`` [B, S] (pipeline size 1 only;
        collective over the TP group). ``position_ids`` restarting at 0 inside a row pack several
        samples into it (each attends to itself only)."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
        if self.mesh.pp_size > 1 or self.mesh.cp_size > 1:
            raise NotImplementedError("logits() needs pp_size == 1 and cp_size == 1")
        ids = torch.as_tensor(input_ids)
        if ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, S], got shape {tuple(ids.shape)}")
        from megatron.core import parallel_state as ps
        pos = None if position_ids is None else torch.as_tensor(position_ids)
        validate.agree_on_inputs({"input_ids": ids, "position_ids": pos}, None,
                                 self.shape.vocab_size, dp_rank=ps.get_data_parallel_rank(),
                                 same_micro_batches=False, group=facade_group())
        ids = ids.long()
        b, s = ids.shape
        cu = packing.cu_seqlens(position_ids) if packing.is_packed(position_ids) else None
        if cu is not None:  # one THD row of all tokens
            ids = ids.reshape(1, -1)
        rows, n = ids.shape
        pad = (-n) % (self.mesh.tp_size if self.mesh.sequence_parallel else 1)
        ids = torch.cat([ids, ids.new_zeros((rows, pad))], 1).to(self.device)
        # megatron's RoPE takes positions from the token index (or, packed, from cu_seqlens)
        pos = torch.arange(n + pad, device=self.device).expand(rows, -1)
        packed = None if cu is None else packing.packed_seq_params(packing.extend(cu, n + pad), self.device)
        with torch.enable_grad():  # DDP's first wrap registers grad hooks through autograd
            module = self.model[0]
        was_training = module.training
        module.eval()
        try:
            out = module(ids, pos, None, packed_seq_params=packed)
        finally:
            module.train(was_training)
        out = gather_from_tensor_model_parallel_region(out.float())
        return out[:, :n].reshape(b, s, -1).cpu()

    def _defer_finalize(self, model, num_tokens=None, **kwargs):
        tokens = torch.zeros([], dtype=torch.int, device=self.device) if num_tokens is None else num_tokens
        self._pending_tokens = tokens.clone() if self._pending_tokens is None else self._pending_tokens + tokens

    def _finalize_grads(self):
        """DP/SP/embedding grad reductions and the token-mean scaling over every forward_backward
        since the last step."""
        if self._pending_tokens is not None:
            self._finalize(self.model, num_tokens=self._pending_tokens)
            self._pending_tokens = None

    def clip_grad_norm(self, max_grad_norm: float = 1.0) -> float:
        """Total grad norm before clipping (over all model-parallel ranks); clips in place to
        ``max_grad_norm`` (0 or None: no clipping)."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
        opt = self._require_optimizer()
        self._finalize_grads()
        if not self._grads_ready:
            if opt.prepare_grads():
                raise NonFiniteGradientError("non-finite gradients: the step cannot be taken")
            self._grads_ready = True
        norm = float(opt.get_grad_norm())
        if not math.isfinite(norm):
            raise NonFiniteGradientError(f"grad norm is {norm}: the step cannot be taken")
        if max_grad_norm and max_grad_norm > 0:
            for o in getattr(opt, "chained_optimizers", [opt]):
                params = o.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(
                        params, max_grad_norm, norm,
                        o.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        return norm

    def step(self):
        """Optimizer step with the current (possibly clipped) grads."""
        opt = self._require_optimizer()
        self._finalize_grads()
        if not self._grads_ready:
            if opt.prepare_grads():
                raise NonFiniteGradientError("non-finite gradients: the step cannot be taken")
        self._grads_ready = False
        if not opt.step_with_ready_grads():
            raise RuntimeError("optimizer step failed")
        self.cur_step += 1

    def zero_grad(self):
        for m in self.model:
            m.zero_grad_buffer()
        self._require_optimizer().zero_grad()
        self._grads_ready = False
        self._pending_tokens = None

    def lr_step(self):
        if self.lr_scheduler is not None:
            self.lr_scheduler.step(increment=1)

    def clip_grad_and_step(self, max_grad_norm: float = 1.0) -> float:
        """Clip to ``max_grad_norm``, step the optimizer and LR scheduler, zero the grads.
        Returns the pre-clip total grad norm (None on the calls an adapter's
        ``gradient_accumulation_steps`` only accumulates).

        Non-finite gradients (every rank sees the same total norm, so all refuse together) raise
        :class:`NonFiniteGradientError` after zeroing the grads, with nothing stepped (weights,
        optimizer state, LR schedule and ``cur_step`` unchanged): catch it to skip the batch."""
        steps = self.adapter.gradient_accumulation_steps if self.adapter is not None else 1
        self._accumulated_calls += 1
        if self._accumulated_calls < steps:
            return None
        self._accumulated_calls = 0
        try:
            norm = self.clip_grad_norm(max_grad_norm)
            self.step()
        except NonFiniteGradientError:
            self.zero_grad()
            raise
        self.lr_step()
        self.zero_grad()
        self._metric.grad_norm = norm
        return norm

    def _require_optimizer(self):
        if self.optimizer is None:
            raise RuntimeError("call set_optimizer first")
        return self.optimizer

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer else 0.0

    def calculate_metric(self, is_training: bool = True) -> Dict[str, float]:
        """Metrics since the previous call: token-mean loss, last grad norm, lr, tokens/s, step.
        ``is_training=False`` reports :meth:`forward_only` calls instead (no grad norm)."""
        meter = self._metric if is_training else self._eval_metric
        return meter.read(lr=self.current_lr(), step=self.cur_step, is_training=is_training)

    def get_train_configs(self) -> str:
        m, s = self.mesh, self.shape
        lines = [
            f"model: {s.model_type} layers={s.num_layers} hidden={s.hidden_size} heads={s.num_heads}"
            f"/{s.num_kv_heads} vocab={s.vocab_size}" + (f" experts={s.num_experts} top{s.moe_topk}" if s.num_experts else ""),
            f"mesh: world={m.world_size} dp={m.dp_size} tp={m.tp_size} pp={m.pp_size} vpp={m.vpp_size} "
            f"cp={m.cp_size} ep={m.ep_size} etp={m.etp_size} sp={m.sequence_parallel}",
            f"precision: {self.mixed_precision} device: {self.device}",
        ]
        if self.optimizer is not None:
            c = self.opt_config
            lines.append(f"optimizer: AdamW lr={c.lr} wd={c.weight_decay} betas=({c.adam_beta1}, "
                         f"{c.adam_beta2}) distributed={c.use_distributed_optimizer}")
        if self.adapter is not None:
            trainable, total = self.adapter.trainable_params, self.adapter.total_params
            c = self.adapter.config
            lines.append(f"adapter {self.adapter.name!r}: LoRA r={c.r} alpha={c.lora_alpha} "
                         f"modules={len(self.adapter.targets)} accumulation={self.adapter.gradient_accumulation_steps}; "
                         f"trainable params {trainable} / {total} ({100 * trainable / max(total, 1):.3f}%)")
        if self.lr_scheduler is not None:
            sch = self.lr_scheduler
            lines.append(f"lr scheduler: {sch.lr_decay_style} warmup={sch.lr_warmup_steps} "
                         f"steps={sch.lr_decay_steps}")
        return "\n".join(lines)

    # ---- checkpoints (see checkpoint.py) -----------------------------------------------------

    def save(self, name: str, output_dir: str = ".", adapter_name: Optional[str] = None,
             save_optimizer: bool = False, consumed_train_samples: Optional[int] = None,
             merge_lora: bool = False) -> str:
        """Write ``<output_dir>/<name>``: HF weights, or with an adapter its PEFT directory
        (``adapter_config.json`` + ``adapter_model.safetensors``; ``merge_lora=True``: the merged
        full HF weights instead). Collective: every rank calls it."""
        from . import checkpoint, lora_checkpoint
        merge = lora_checkpoint.check_save_args(self, adapter_name, merge_lora)
        if self.adapter is not None and not merge_lora:
            return lora_checkpoint.save(self, name, output_dir, save_optimizer, consumed_train_samples)
        return checkpoint.save(self, name, output_dir, save_optimizer, consumed_train_samples, merge=merge)

    def load(self, path: str, load_optimizer: bool = True, adapter_name: Optional[str] = None) -> Dict[str, int]:
        from . import checkpoint, lora_checkpoint
        checkpoint.recover(path)   # an interrupted save's swap, before looking at what path holds
        if lora_checkpoint.is_adapter_dir(path) or adapter_name is not None:
            return lora_checkpoint.load(self, path, load_optimizer, adapter_name)
        return checkpoint.load(self, path, load_optimizer)

    def resume_from_checkpoint(self, path: str, resume_only_model: bool = False,
                               adapter_name: Optional[str] = None) -> Dict[str, int]:
        return self.load(path, load_optimizer=not resume_only_model, adapter_name=adapter_name)

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index among the data-parallel replicas: which share of each global batch
        it should pass to :meth:`forward_backward` (``mesh.dp_size`` shares)."""
        from megatron.core import parallel_state as ps
        return ps.get_data_parallel_rank()

    def unwrapped_chunks(self) -> List[torch.nn.Module]:
        """The GPTModel chunks (this rank's pipeline stages)."""
        return self._chunks


def _packed_micro_batches(mesh, device, ids, shifted, pos, mask, mbs):
    """Packed rows (position_ids restarting at 0 per sample): each micro-batch of ``mbs`` rows
    becomes one THD row of ``mbs * S`` tokens with ``packed_seq_params``."""
    if mesh.cp_size > 1:
        raise NotImplementedError("packed sequences (position_ids restarting at 0) with context "
                                  "parallelism are not supported")
    b, s = ids.shape
    total = mbs * s
    pad = (-total) % (mesh.tp_size if mesh.sequence_parallel else 1)
    out = []
    for i in range(0, b, mbs):
        rows = slice(i, i + mbs)
        cu = packing.cu_seqlens(pos[rows], None if mask is None else mask[rows])
        out.append({
            "input_ids": torch.cat([ids[rows].reshape(-1), ids.new_zeros(pad)])[None].to(device),
            "position_ids": torch.arange(total + pad)[None].to(device),
            "labels": torch.cat([shifted[rows].reshape(-1), shifted.new_full((pad,), -100)])[None].to(device),
            "packed_seq_params": packing.packed_seq_params(packing.extend(cu, total + pad), device)})
    return out, 1, total + pad


def _has_weights(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f))
               for f in ("model.safetensors", "model.safetensors.index.json"))


class _Meter:
    def __init__(self):
        self.loss_sum = 0.0
        self.tokens = 0
        self.seconds = 0.0
        self.grad_norm = float("nan")
        self.last_loss = float("nan")

    def add_fb(self, loss_sum, tokens, seconds):
        self.loss_sum += loss_sum
        self.tokens += tokens
        self.seconds += seconds

    def read(self, *, lr, step, is_training):
        if self.tokens:
            self.last_loss = self.loss_sum / self.tokens
        out = {"loss": self.last_loss, "grad_norm": self.grad_norm, "lr": lr,
               "tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
               "num_tokens": self.tokens, "step": step}
        if not is_training:
            out.pop("grad_norm")
        self.loss_sum, self.tokens, self.seconds = 0.0, 0, 0.0
        return out
