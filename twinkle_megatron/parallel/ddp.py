"""The facade's chunks wrapped for data parallelism with megatron's own DDP, and the
communication-overlap switches of its ``DistributedDataParallelConfig``."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ..options import OverlapOptions  # noqa: F401 (re-exported: its home before twinkle_megatron.options)


def overlap_options(overlap_grad_reduce: bool = False, overlap_param_gather: bool = False,
                    bucket_size: Optional[int] = None) -> OverlapOptions:
    """The overlap switches checked (TypeError / ValueError naming the argument). Every device
    gets them as asked: megatron issues the overlapped collectives as asynchronous work on the
    default stream (its separate communication stream is only for several distributed-optimizer
    instances, which the facade does not build), so no switch needs CUDA streams. On CPU (gloo)
    they train exactly as without overlap (tests/megatron/test_recompute.py: DP2, several bucket sizes,
    with and without the distributed optimizer). That needs the CPU mode's coalescing block to
    wait for the asynchronous bucket all-reduces (``parallel/cpu_compat.py``, item 5): before it
    did, ``finish_grad_sync`` returned while gloo was still reducing into the grad buffer, and
    the grads read next (the 1/tokens scaling, the norm) were partly unreduced; by timing, so
    that some bucket layouts came out exact and others not."""
    return OverlapOptions(overlap_grad_reduce, overlap_param_gather, bucket_size)


def check_overlap_call(options: OverlapOptions, pending_tokens) -> None:
    """Refuse a second ``forward_backward`` before the optimizer step under ``overlap_grad_reduce``
    (``pending_tokens``: not None when a call since the last step left grads). megatron launches
    each bucket's reduction during the backward once its params have received as many grads as
    in the first step, so a step with more calls than that would reduce part of its grads and
    silently lose the rest; with one call per step (its micro-batches accumulate) it cannot."""
    if options.overlap_grad_reduce and pending_tokens is not None:
        raise RuntimeError("overlap_grad_reduce=True: one forward_backward per optimizer step (accumulate "
                           "with micro_batch_size= inside the call); this is the second since the last step")


def finish_param_gather(*wrapped) -> None:
    """Complete the parameter all-gathers that ``overlap_param_gather`` leaves in flight after an
    optimizer step (the next forward's pre-hooks would wait for them) for each of ``wrapped``
    (lists of DDP-wrapped chunks, or None), so that code reading or writing the params outside a
    forward (save, weight sync, load, adapters) sees every rank's update. A no-op without
    ``overlap_param_gather``."""
    for chunks in wrapped:
        for module in chunks or ():
            if getattr(module, "use_forward_hook", False):
                module.start_param_sync(force_sync=True)


def ddp_config(options: OverlapOptions, use_distributed_optimizer: bool):
    """megatron's ``DistributedDataParallelConfig`` of the facade: fp32 grad reduction, the
    overlap switches of ``options`` (param gather only with the distributed optimizer)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=options.overlap_grad_reduce,
        overlap_param_gather=options.overlap_param_gather and use_distributed_optimizer,
        bucket_size=options.bucket_size, use_distributed_optimizer=use_distributed_optimizer)


def mark_expert_params(chunks: List[torch.nn.Module], config) -> int:
    """Give every routed-expert parameter of ``chunks`` megatron's ``allreduce=False`` mark when
    the experts' data-parallel group is not the dense one, so that megatron's DDP reduces their
    grads over the expert-data-parallel group and ``get_megatron_optimizer`` keeps them in its
    expert optimizer (whose grad norm counts each expert-TP shard once). Returns how many
    parameters were marked.

    megatron-core's expert linears set the mark only when ``expert_model_parallel_size > 1``. With
    EP 1 and an expert-TP size other than TP (the facade's default etp 1 under TP 2), each TP rank
    holds whole experts and runs them on its own tokens (its sequence-parallel share): the
    expert-data-parallel group is ``dp * cp * tp / etp`` ranks, not the ``dp * cp`` of dense
    params. Unmarked, DDP summed expert grads over ``dp * cp`` only, so each TP rank stepped its
    copy of the experts with the grads of its own tokens (the copies drifted apart) and the dense
    grad norm summed the squares of those partial grads over TP (Qwen3-Next, TP2 + SP: norm
    1.455712 against 1.454816 of the single process, expert weights' grads off by up to 12%).
    Megatron-LM changed the mark after 0.16 the same way (NVIDIA/Megatron-LM#6080). With EP 1 and
    expert-TP equal to TP the two groups are the same ranks, and the params stay with the dense ones."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    ep = config.expert_model_parallel_size or 1
    etp = config.expert_tensor_parallel_size or config.tensor_model_parallel_size
    if ep == 1 and etp == config.tensor_model_parallel_size:
        return 0
    marked = 0
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer):
                for p in module.experts.parameters():
                    if getattr(p, "allreduce", True):
                        p.allreduce = False
                        marked += 1
    return marked


def wrap_chunks(chunks: List[torch.nn.Module], config, ddp_config, dtype: torch.dtype) -> List[torch.nn.Module]:
    """``chunks`` (this rank's GPTModel chunks) in megatron's ``Float16Module`` (bf16 / fp16
    ``dtype``) and ``DistributedDataParallel`` with ``ddp_config``. Bucketing only for the first
    chunk, as megatron's training loop does with virtual stages. A fully frozen model (the base
    under adapters, run by ``adapter_name=None``) gets no DDP: it runs forward only, and grad
    buffers for it would be wasted memory. The routed experts get their expert-parallel mark first
    (:func:`mark_expert_params`)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module
    wrapped = []
    mark_expert_params(chunks, config)   # before DDP lays out its grad buffers
    frozen = not any(p.requires_grad for c in chunks for p in c.parameters())
    for i, chunk in enumerate(chunks):
        inner = Float16Module(config, chunk) if dtype != torch.float32 else chunk
        if frozen:
            wrapped.append(inner)
            continue
        with torch.enable_grad():   # DDP registers its grad hooks through autograd (forward_only
            # or logits() may be the first use, under no_grad)
            wrapped.append(DistributedDataParallel(config, ddp_config, inner, disable_bucketing=i > 0))
    return wrapped


def fuse_wgrad_accumulation(wrapped: List[torch.nn.Module]) -> int:
    """Turn on megatron's gradient accumulation fusion in the linear layers of ``wrapped`` (DDP-wrapped
    chunks) whose weight has an fp32 ``main_grad``: their backward then adds the weight gradient
    straight into it (``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32``) instead of writing a
    gradient of the weight's dtype for DDP's hook to add. Only where megatron's layers module has that
    function (on the CPU: ``cpu_compat`` item 14's ``twinkle_kernels.wgrad_accum``); per layer, not in
    the config, because a layer whose weight has no ``main_grad`` (not wrapped yet) would fail in the
    fused backward. The routed experts' own path reads the same flag (``layers/mlp.py``). Returns
    the number of layers turned on."""
    from megatron.core.tensor_parallel import layers as tp_layers
    if getattr(tp_layers, "fused_weight_gradient_mlp_cuda", None) is None:
        return 0
    count = 0
    for chunk in wrapped:
        for m in chunk.modules():
            if not isinstance(m, (tp_layers.ColumnParallelLinear, tp_layers.RowParallelLinear)):
                continue
            w = getattr(m, "weight", None)
            if (w is None or not w.requires_grad or w.device.type != "cpu"
                    or getattr(w, "main_grad", None) is None or w.main_grad.dtype != torch.float32):
                continue
            m.gradient_accumulation_fusion = True
            count += 1
    return count
