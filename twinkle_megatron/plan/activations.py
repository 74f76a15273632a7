"""Activation bytes of one training micro-batch on a rank, by layer kind, with and without recompute.

What a layer keeps for its backward, counted tensor by tensor for megatron's local layer spec
(``MegatronModel(use_twinkle_kernels=False)``: unfused softmax attention, ``[gate; up]`` SwiGLU MLP,
megatron's Gated DeltaNet, alltoall-dispatched experts; the default twinkle spec's fused attention
and kernels keep less, so for it the estimate is an upper bound), per token of the micro-batch (``s`` tokens of the rank's
sequence shard, ``b`` rows), ``t`` the TP size; under sequence parallelism the tensors between the
attention and MLP blocks are ``1 / t`` of a token's hidden vector too:

- norms and the linear layers after them keep their inputs (2 x hidden per norm);
- softmax attention keeps q, k, v (k and v repeated to the query heads for megatron's batched
  matmuls), the ``[heads, s, s]`` probabilities (fp32) and the context;
- SwiGLU keeps fc1's output, silu(gate) and the product (4 x ffn);
- Gated DeltaNet keeps in_proj's output, the conv input and output, the normalised q / k, the
  delta-rule output and its gated norm's inputs;
- routed experts keep every routed copy of a token (top-k of them) through their own SwiGLU.

The last stage adds the logits and their fp32 softmax and gradient (``[s, b, V / t]``, three
copies) unless the fused LM-head loss is used. Recompute (megatron's ``recompute_granularity``):
"full" keeps only each recomputed layer's input and rebuilds one layer at a time in the backward;
"selective" recomputes softmax attention's core (the probabilities and the repeated k / v).

:func:`peak_bytes` adds, once per rank, the backward's workspace of one attention layer: the
gradients of the probabilities and of the scores (two more fp32 ``[heads, s, s]``) exist next
to everything still kept when the last layer's backward starts.
"""
from __future__ import annotations

from typing import Optional

from ..models.shape import ModelShape


def _attention(shape: ModelShape, s: int, t: int, selective: bool) -> dict:
    """Elements per token kept by a softmax-attention block (without the norms), and the
    fp32 ``[heads, s, s]`` part separately."""
    d, a, g = shape.head_dim, shape.num_heads // t, shape.num_kv_heads // t
    q, kv = a * d, g * d
    gate = q if shape.attention_output_gate else 0
    kept = q + 2 * kv + gate                  # qkv output (q, k, v and the output gate)
    if shape.qk_norm:
        kept += q + kv                        # the q / k norms' inputs
    if selective:
        core, probs = 0, 0
    else:
        core, probs = q + 2 * a * d, a * s    # q, repeated k / v, probabilities
    kept += core + q + gate                   # context (and its gated copy) into linear_proj
    return {"dtype": kept, "fp32": probs}


def _gated_delta_net(shape: ModelShape, t: int) -> int:
    qk = shape.linear_num_key_heads * shape.linear_key_head_dim // t
    v = shape.linear_num_value_heads * shape.linear_value_head_dim // t
    hv = shape.linear_num_value_heads // t
    proj = 2 * qk + 2 * v + 2 * hv            # in_proj output
    conv = 2 * (2 * qk + v)                   # conv input and output (silu)
    rule = 2 * qk + v + 2 * hv + v            # l2-normed q / k, v, g / beta, delta-rule output
    norm = 2 * v + v                          # gated norm: input, gate, output into out_proj
    return proj + conv + rule + norm


def _mlp(ffn: int, t: int) -> int:
    return 4 * ffn // t                       # fc1 output [gate; up], silu(gate), product


def layer_elements(shape: ModelShape, layer: int, *, s: int, t: int, sp: bool,
                   selective: bool = False) -> dict:
    """``{"dtype": n, "fp32": m}`` elements per token kept by global layer ``layer``."""
    h = shape.hidden_size // (t if sp else 1)
    out = {"dtype": 4 * h, "fp32": 0}         # two norms' inputs and outputs
    if shape.is_linear(layer):
        out["dtype"] += _gated_delta_net(shape, t)
    else:
        att = _attention(shape, s, t, selective)
        out["dtype"] += att["dtype"]
        out["fp32"] += att["fp32"]
    if shape.num_experts:
        k = shape.moe_topk
        out["fp32"] += 2 * shape.num_experts   # router logits and probabilities
        out["dtype"] += k * (2 * shape.hidden_size + 4 * shape.moe_intermediate_size // 1) + shape.hidden_size
        if shape.shared_expert_intermediate_size:
            out["dtype"] += _mlp(shape.shared_expert_intermediate_size, t) + shape.hidden_size // t
    else:
        out["dtype"] += _mlp(shape.intermediate_size, t)
    return out


def micro_batch_bytes(shape: ModelShape, layers, *, seq: int, mbs: int, tp: int = 1, cp: int = 1,
                      sp: bool = False, dtype_bytes: int = 2, last_stage: bool = True,
                      fused_lm_head: bool = False, recompute: Optional[str] = None,
                      recompute_num_layers: int = 1) -> int:
    """Bytes one micro-batch keeps on a rank holding ``layers`` (global indices) until its backward.

    ``recompute``: None, "selective" or "full" (megatron's "uniform" method with
    ``recompute_num_layers`` layers per recomputed chunk)."""
    s = seq // cp
    tokens = s * mbs

    def one(layer, selective=False):
        e = layer_elements(shape, layer, s=s, t=tp, sp=sp, selective=selective)
        return tokens * (e["dtype"] * dtype_bytes + e["fp32"] * 4)

    layers = list(layers)
    if recompute == "full":
        h = shape.hidden_size // (tp if sp else 1)
        chunks = [layers[i:i + recompute_num_layers] for i in range(0, len(layers), recompute_num_layers)]
        kept = len(chunks) * tokens * h * dtype_bytes
        rebuilt = max((sum(one(x) for x in c) for c in chunks), default=0)
        total = kept + rebuilt
    elif recompute == "selective":
        # the recomputed core of one attention layer exists again during its backward
        total = sum(one(x, selective=True) for x in layers) + \
            max((one(x) - one(x, selective=True) for x in layers), default=0)
    else:
        total = sum(one(x) for x in layers)
    if last_stage:
        h = shape.hidden_size // (tp if sp else 1)
        total += tokens * h * dtype_bytes     # the final norm's input
        if not fused_lm_head:
            total += tokens * (shape.vocab_size // tp) * (dtype_bytes + 2 * 4)
    return total


def workspace_bytes(shape: ModelShape, layers, *, seq: int, mbs: int, tp: int = 1, cp: int = 1) -> int:
    """The attention backward's two fp32 ``[heads / tp, s, s]`` gradients, for one layer of ``layers``."""
    s = seq // cp
    attention = [x for x in layers if not shape.is_linear(x)]
    return 2 * mbs * s * (shape.num_heads // tp) * s * 4 if attention else 0


def peak_bytes(shape: ModelShape, layers, *, seq: int, mbs: int, in_flight: int = 1, tp: int = 1, cp: int = 1,
               **kwargs) -> int:
    """A rank's activation peak: ``in_flight`` micro-batches' :func:`micro_batch_bytes` (the same
    keyword arguments) and one :func:`workspace_bytes`."""
    layers = list(layers)
    return in_flight * micro_batch_bytes(shape, layers, seq=seq, mbs=mbs, tp=tp, cp=cp, **kwargs) + \
        workspace_bytes(shape, layers, seq=seq, mbs=mbs, tp=tp, cp=cp)
