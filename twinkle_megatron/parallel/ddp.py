"""The facade's chunks wrapped for data parallelism with megatron's own DDP."""
from __future__ import annotations

from typing import List

import torch


def wrap_chunks(chunks: List[torch.nn.Module], config, ddp_config, dtype: torch.dtype) -> List[torch.nn.Module]:
    """``chunks`` (this rank's GPTModel chunks) in megatron's ``Float16Module`` (bf16 / fp16
    ``dtype``) and ``DistributedDataParallel`` with ``ddp_config``. Bucketing only for the first
    chunk, as megatron's training loop does with virtual stages. A fully frozen model (the base
    under adapters, run by ``adapter_name=None``) gets no DDP: it runs forward only, and grad
    buffers for it would be wasted memory."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module
    wrapped = []
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
