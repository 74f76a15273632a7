"""The LM head fused with the loss on the last pipeline stage: per-token log-probs and entropy from
the final hidden states and the output-layer weight shard, without the [tokens, V / tp] logits.

- :func:`gpt_model_class`: megatron's ``GPTModel`` whose forward takes
  ``return_hidden_states=True``: the last stage then returns the decoder's output (after the final
  norm) instead of running ``output_layer``. Without it, the model is megatron's unchanged.
- :func:`output_head`: the weight ``output_layer`` would use: its own, or with tied embeddings
  what ``shared_embedding_or_output_weight()`` gives (the embedding on a one-stage pipeline, the
  last stage's copy otherwise, whose grad megatron all-reduces with the first stage's).
- :func:`fused_topk_logits`: the logits at k given vocabulary ids per token only (GKD's student
  side), k rows of the head per token, chunk by chunk, vocab-parallel under TP.
- :func:`fused_topk_logps`: the top k of the log-softmax over the whole vocabulary (GKD's
  teacher side, ``forward_only(return_topk=k)``), vocabulary chunk by chunk with a running top-k
  and an online log-sum-exp, merged over the TP group.
- :func:`contiguous_logit_grads`: the unfused path's ``output_layer`` gets its output gradient
  contiguous (a frozen head's backward otherwise sends a transposed one to a CPU matmul that
  cannot fold it: see there).
- :func:`fused_token_logps`: ``(logps, entropy)`` through
  ``twinkle_kernels.fused_linear_cross_entropy`` (one TP rank) or its vocab-parallel form (the
  statistics reduced over the TP group; under sequence parallelism it gathers the sequence as
  ``output_layer`` would, and reduce-scatters the hidden gradient).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Tuple

import torch

import twinkle_kernels as tk


@functools.lru_cache(maxsize=None)
def gpt_model_class() -> type:
    from megatron.core.models.gpt import GPTModel

    class TwinkleGPTModel(GPTModel):
        """GPTModel with ``forward(..., return_hidden_states=False)``: True makes the last stage
        return the final hidden states ``[s, b, h]`` (sequence-first; this rank's ``s / tp`` under
        sequence parallelism, its CP share under context parallelism) instead of the logits."""

        _return_hidden_states = False

        def forward(self, *args, return_hidden_states: bool = False, **kwargs):
            # a per-call switch read by _postprocess below (megatron's forward passes no extra
            # argument through to it)
            self._return_hidden_states = bool(return_hidden_states)
            try:
                return super().forward(*args, **kwargs)
            finally:
                self._return_hidden_states = False

        def _postprocess(self, hidden_states, *args, **kwargs):
            if self._return_hidden_states and self.post_process:
                if self.mtp_process or self.config.mtp_num_layers is not None:
                    raise NotImplementedError("return_hidden_states with multi-token prediction")
                return hidden_states
            return super()._postprocess(hidden_states, *args, **kwargs)

    return TwinkleGPTModel


class OutputHead(NamedTuple):
    """What :func:`fused_token_logps` needs of a last-stage GPTModel's output layer."""
    weight: torch.Tensor            # [V / tp, H]
    bias: Optional[torch.Tensor]    # [V / tp] or None
    sequence_parallel: bool


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward gives the gradient row-major strides, size-1 dimensions included:
    torch counts a [s, 1, V] tensor with any stride on its 1 as contiguous (``.contiguous()``
    returns it as is), but its matmul folds [s, b, V] into one GEMM only when stride[0] equals
    stride[1] * b."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if grad.dim() < 2 or grad.numel() == 0:
            return grad
        return grad.view(-1, grad.shape[-1]).view(grad.shape)


def _contiguous_output_grad(module, args, output):
    logits, bias = output
    if not (torch.is_grad_enabled() and logits.requires_grad):
        return output
    return _ContiguousGrad.apply(logits), bias


def contiguous_logit_grads(chunks) -> None:
    """Give each last-stage chunk's ``output_layer`` its output gradient contiguous.

    megatron's GPTModel returns ``logits.transpose(0, 1).contiguous()``, so the gradient reaching
    ``output_layer`` is a transposed view [s, b, V / tp]. With a frozen weight (LoRA, a tied
    embedding left untrained) megatron's ``LinearWithFrozenWeight`` computes ``grad_output.matmul
    (weight)`` on it as is: torch's CPU matmul cannot fold the non-contiguous 3-D tensor into one
    GEMM, expands the weight into a batch of s copies for oneDNN (159 GB for Qwen3-0.6B at 512
    tokens), fails to allocate it and falls back to a single-threaded batched GEMM: minutes per
    step. A trained weight's backward makes the gradient contiguous itself, so this costs that one
    copy only where megatron would not have made it. Forward hooks, on CPU and GPU alike."""
    for chunk in chunks:
        layer = getattr(chunk, "output_layer", None) if getattr(chunk, "post_process", False) else None
        if layer is not None:
            layer.register_forward_hook(_contiguous_output_grad)


def output_head(model) -> OutputHead:
    """The weight and bias a last-stage GPTModel's ``_postprocess`` gives ``output_layer``."""
    if model.share_embeddings_and_output_weights:
        weight = model.shared_embedding_or_output_weight()
    else:
        weight = model.output_layer.weight
    return OutputHead(weight, model.output_layer.bias, bool(model.output_layer.sequence_parallel))


def fused_token_logps(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                      bias: Optional[torch.Tensor] = None, temperature: float = 1.0,
                      with_entropy: bool = False, tp_group=None, sequence_parallel: bool = False,
                      expected_grad: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token ``log softmax(hidden @ weight.T / temperature)[target]`` and its entropy.

    hidden: ``[s_local, rows, H]`` megatron's sequence-first final hidden states (any float dtype;
    cast to the weight's, which is exact for the fp32 copy megatron's Float16Module makes of bf16
    / fp16 outputs); ``s_local = s / tp`` with ``sequence_parallel``. weight: ``[V / tp, H]`` this
    rank's vocabulary shard (``tp_group`` None or of size 1: the whole head). target: ``[rows, s]``
    int global token ids, all valid (clamp ignored positions: their values are returned but
    meaningless). Returns fp32 ``[rows, s]`` tensors (entropy None unless ``with_entropy``),
    differentiable in hidden, weight and bias. ``expected_grad`` (fp32 ``[rows, s]``, like target):
    the logps' gradient up to one scalar, when the loss is known to give such a gradient: the
    head's gradients are then computed in the forward, three GEMMs instead of four
    (``expected_logps_grad`` of ``twinkle_kernels.fused_linear_cross_entropy``; one TP rank only,
    the vocab-parallel form recomputes).
    """
    import torch.distributed as dist
    h = hidden.to(weight.dtype)
    labels = target.t()                      # [s, rows], hidden's (gathered) leading dims
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    kw = dict(bias=bias, reduction="sum", temperature=temperature, return_logps=True,
              return_entropy=bool(with_entropy))
    if tp == 1:
        if expected_grad is not None and not with_entropy:
            kw["expected_logps_grad"] = expected_grad.t().reshape(-1)
        out = tk.fused_linear_cross_entropy(h.reshape(-1, h.shape[-1]), weight, labels.reshape(-1), **kw)
    else:
        from twinkle_kernels.linear_ce import vocab_parallel_fused_linear_cross_entropy
        out = vocab_parallel_fused_linear_cross_entropy(h, weight, labels, tp_group,
                                                        sequence_parallel=sequence_parallel, **kw)
    shape = labels.shape
    logps = out[1].reshape(shape).t().contiguous()
    entropy = out[2].reshape(shape).t().contiguous() if with_entropy else None
    return logps, entropy


class TopkRows(torch.autograd.Function):
    """``z[n, j] = hidden[n] . weight[ids[n, j] - v0] (+ bias)`` for the ids in this rank's shard
    ``[v0, v0 + V / tp)`` (0 for the others), ``chunk`` tokens at a time: at most ``[chunk, k, H]``
    rows of the head exist at once, in the forward and again in the backward (nothing of that size
    is saved). The forward sums z over ``group``; the backward's hidden gradient is all-reduced
    over it when ``reduce_dh`` (the hidden states are replicated over the group, not gathered)."""

    @staticmethod
    def forward(ctx, h, w, b, ids, v0: int, chunk: int, group, reduce_dh: bool):
        import torch.distributed as dist
        n, k = ids.shape
        vs = w.shape[0]
        local = ids - v0
        here = (local >= 0) & (local < vs)
        loc = local.clamp(0, vs - 1)
        dtype = torch.float64 if torch.float64 in (h.dtype, w.dtype) else torch.float32
        z = torch.zeros(n, k, dtype=dtype, device=h.device)
        for r0 in range(0, n, chunk):
            r1 = min(n, r0 + chunk)
            rows = w[loc[r0:r1]].to(dtype)                                   # [c, k, H]
            z[r0:r1] = torch.bmm(rows, h[r0:r1].to(dtype)[:, :, None])[..., 0]
        if b is not None:
            z = z + b[loc].to(dtype)
        z = torch.where(here, z, torch.zeros((), dtype=dtype, device=z.device))
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(z, group=group)
        ctx.save_for_backward(h, w, b, loc, here)
        ctx.chunk, ctx.group, ctx.reduce_dh, ctx.dtype = chunk, group, reduce_dh, dtype
        ctx.has_bias = b is not None
        return z

    @staticmethod
    def backward(ctx, g):
        import torch.distributed as dist
        h, w, b, loc, here = ctx.saved_tensors
        dtype, chunk = ctx.dtype, ctx.chunk
        g = torch.where(here, g.to(dtype), torch.zeros((), dtype=dtype, device=g.device))
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dh = torch.zeros(h.shape, dtype=dtype, device=h.device) if need_h else None
        dw = torch.zeros(w.shape, dtype=dtype, device=w.device) if need_w else None
        hd = h.shape[-1]
        for r0 in range(0, g.shape[0], chunk):
            r1 = min(g.shape[0], r0 + chunk)
            gc = g[r0:r1]                                                    # [c, k]
            if need_h:
                rows = w[loc[r0:r1]].to(dtype)                               # [c, k, H]
                dh[r0:r1] = torch.bmm(gc[:, None, :], rows)[:, 0]
            if need_w:
                hc = h[r0:r1].to(dtype)
                dw.index_add_(0, loc[r0:r1].reshape(-1), (gc[:, :, None] * hc[:, None, :]).reshape(-1, hd))
        if need_h and ctx.reduce_dh and ctx.group is not None and dist.get_world_size(ctx.group) > 1:
            dist.all_reduce(dh, group=ctx.group)
        db = None
        if need_b and ctx.has_bias:
            db = torch.zeros(b.shape, dtype=dtype, device=b.device).index_add_(0, loc.reshape(-1), g.reshape(-1))
            db = db.to(b.dtype)
        return (dh.to(h.dtype) if need_h else None, dw.to(w.dtype) if need_w else None, db,
                None, None, None, None, None)


def topk_chunk(k: int, hidden: int, budget: int = 1 << 24) -> int:
    """Tokens per chunk of :class:`TopkRows`: ``[chunk, k, H]`` within ``budget`` elements."""
    return max(1, budget // max(1, k * hidden))


def fused_topk_logits(hidden: torch.Tensor, weight: torch.Tensor, indices: torch.Tensor, *,
                      bias: Optional[torch.Tensor] = None, tp_group=None, sequence_parallel: bool = False,
                      chunk_tokens: Optional[int] = None) -> torch.Tensor:
    """The LM head's logits at ``indices`` only: ``hidden @ weight[indices].T (+ bias)``.

    hidden: ``[s_local, rows, H]`` (megatron's sequence-first final hidden states; ``s / tp``
    with ``sequence_parallel``, gathered here as ``output_layer`` would, its gradient
    reduce-scattered back); weight: ``[V / tp, H]`` this rank's vocabulary shard; indices:
    ``[rows, s, k]`` global vocabulary ids. Each rank evaluates the ids in its shard, the sum over
    ``tp_group`` gives every id's logit; no ``[tokens, V / tp]`` tensor, and at most
    ``[chunk_tokens, k, H]`` gathered head rows (default :func:`topk_chunk`). Returns
    ``[rows, s, k]`` fp32 (float64 for float64 inputs), differentiable in hidden, weight and bias.
    """
    import torch.distributed as dist
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    if sequence_parallel and tp > 1:
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=tp_group)
    s, rows, hd = hidden.shape
    if tuple(indices.shape[:2]) != (rows, s):
        raise ValueError(f"indices {tuple(indices.shape)} must be [rows, s, k] = ({rows}, {s}, k) "
                         f"for hidden states {tuple(hidden.shape)}")
    k = indices.shape[-1]
    ids = indices.transpose(0, 1).reshape(-1, k).long()          # [s * rows, k], hidden's token order
    v0 = weight.shape[0] * (dist.get_rank(tp_group) if tp > 1 else 0)
    chunk = int(chunk_tokens or topk_chunk(k, hd))
    z = TopkRows.apply(hidden.reshape(-1, hd), weight, bias, ids, v0, chunk,
                       tp_group if tp > 1 else None, not sequence_parallel)
    return z.reshape(s, rows, k).transpose(0, 1).contiguous()


def topk_vocab_chunk(tokens: int, budget: int = 1 << 24) -> int:
    """Vocabulary rows per chunk of :func:`fused_topk_logps`: ``[tokens, chunk]`` logits within
    ``budget`` elements."""
    return max(1, budget // max(1, tokens))


@torch.no_grad()
def fused_topk_logps(hidden: torch.Tensor, weight: torch.Tensor, k: int, *, bias: Optional[torch.Tensor] = None,
                     temperature: float = 1.0, tp_group=None, sequence_parallel: bool = False,
                     chunk_vocab: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` of ``log_softmax((hidden @ weight.T + bias) / temperature)`` over the whole
    vocabulary, without the ``[tokens, V / tp]`` logits (the teacher's side of GKD).

    hidden: ``[s_local, rows, H]`` (``s / tp`` with ``sequence_parallel``: gathered here);
    weight: ``[V / tp, H]`` this rank's shard. The shard is read ``chunk_vocab`` rows at a time
    (default :func:`topk_vocab_chunk`: at most ``[tokens, chunk]`` logits at once) keeping a
    running top-k (global ids) and an online log-sum-exp; the ranks' candidates are merged over
    ``tp_group`` (:func:`.vocab_parallel.merge_topk`). Returns (log-probs fp32 (float64 for
    float64 weights) ``[rows, s, k]`` sorted descending, ids int64 ``[rows, s, k]``), no gradient."""
    import torch.distributed as dist
    from .vocab_parallel import local_topk, merge_topk
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    if sequence_parallel and tp > 1:
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=tp_group)
    s, rows, hd = hidden.shape
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    h = hidden.reshape(-1, hd).to(dtype)
    n, vs = h.shape[0], weight.shape[0]
    v0 = vs * (dist.get_rank(tp_group) if tp > 1 else 0)
    chunk = int(chunk_vocab or topk_vocab_chunk(n))
    top_v = h.new_full((n, k), float("-inf"))
    top_i = torch.zeros(n, k, dtype=torch.long, device=h.device)
    zmax = h.new_full((n,), float("-inf"))
    sum_exp = h.new_zeros(n)
    for c0 in range(0, vs, chunk):
        c1 = min(vs, c0 + chunk)
        z = h @ weight[c0:c1].to(dtype).T
        if bias is not None:
            z = z + bias[c0:c1].to(dtype)
        z = z / temperature
        m = torch.maximum(zmax, z.max(-1).values)
        sum_exp = sum_exp * (zmax - m).exp() + (z - m[:, None]).exp().sum(-1)
        zmax = m
        v, i = local_topk(z, k, v0 + c0)
        v, at = torch.cat([top_v, v], -1).topk(k, dim=-1)
        top_i = torch.cat([top_i, i], -1).gather(-1, at)
        top_v = v
    lp, ids = merge_topk(top_v, top_i, zmax, sum_exp, k, tp_group if tp > 1 else None)
    return lp.reshape(s, rows, k).transpose(0, 1).contiguous(), ids.reshape(s, rows, k).transpose(0, 1).contiguous()


def fused_jsd(hidden: torch.Tensor, weight: torch.Tensor, teacher_logits: torch.Tensor, valid: torch.Tensor, *,
              beta: float, temperature: float, bias: Optional[torch.Tensor] = None, tp_group=None,
              sequence_parallel: bool = False) -> torch.Tensor:
    """GKD's generalized JSD against full-vocabulary teacher logits, per token, from the final
    hidden states and the output weight shard, without the student's ``[tokens, V / tp]`` logits
    (:func:`twinkle_kernels.linear_ce.jsd.fused_linear_jsd`: two passes over token x vocabulary
    chunks with online log-sum-exps, reduced over ``tp_group``).

    hidden: ``[s_local, rows, H]`` (``s / tp`` with ``sequence_parallel``: gathered here, its
    gradient reduce-scattered back); weight: ``[V / tp, H]`` this rank's shard; teacher_logits:
    ``[rows, s, V / tp]`` float, the teacher's logits over the same vocabulary columns, aligned
    with the hidden states (position t predicts token t + 1); valid: ``[rows, s]`` bool, the
    positions computed. Returns ``[rows, s]`` fp32 (0 where not ``valid``; float64 for float64
    weights), differentiable in hidden, weight and bias."""
    import torch.distributed as dist
    from twinkle_kernels.linear_ce.jsd import fused_linear_jsd
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    if sequence_parallel and tp > 1:
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=tp_group)
    s, rows, hd = hidden.shape
    if tuple(teacher_logits.shape[:2]) != (rows, s) or tuple(valid.shape) != (rows, s):
        raise ValueError(f"teacher_logits {tuple(teacher_logits.shape)} and valid {tuple(valid.shape)} must be "
                         f"[rows, s, V / tp] and [rows, s] = ({rows}, {s}) for hidden states {tuple(hidden.shape)}")
    # row-major tokens: a copy of the [N, H] hidden states, none of the [N, V / tp] teacher logits
    h = hidden.to(weight.dtype).transpose(0, 1).reshape(rows * s, hd)
    t = teacher_logits.reshape(rows * s, teacher_logits.shape[-1])
    d = fused_linear_jsd(h, weight, t, valid=valid.reshape(-1), beta=beta, temperature=temperature,
                         bias=bias, tp_group=tp_group if tp > 1 else None, reduce_dh=not sequence_parallel)
    return d.reshape(rows, s)
