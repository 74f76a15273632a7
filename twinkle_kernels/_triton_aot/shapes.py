"""The model-shape table: every public op with ``backend="triton"`` at real model widths.

Each model's widths are written out below from its published configuration (no hub access);
each is called in bf16, fp16 and fp32, dense (``[B, T]``) and, for the ops that take
``cu_seqlens``, packed (the delta rule also with states carried in and out, and decoding). The
calls run under the Triton interpreter in record-only mode
(:func:`.record.recording` with ``execute=False``), with the launch configurations a GPU
would get (``_triton_utils.gpu_configs``): the interpreter costs ~0.1 ms per program
instance and computes bf16 wrongly, while recording needs neither the kernels' results nor
their speed (every launch decision in these ops is taken on the host from the inputs). Token
counts are small but past every tile (T = 256 per sequence, above the 128-token conv tile and
the 64-token delta-rule chunk), so the launches are the ones a training step makes.

Two sizes are deliberately not the model's, because no compiled launch depends on them: the
number of experts (8, each with the rows it would get from 4096 tokens routed over all of the
model's experts; see ``_moe``) and the LM head's hidden size in the fused cross-entropy (its
kernels see only the ``[chunk, vocab]`` logits; the vocabulary is the model's).

    python -m twinkle_kernels._triton_aot.shapes --out launches.jsonl [--models qwen3_5] [--dtypes bf16]

(run with ``TRITON_INTERPRET=1``; :mod:`twinkle_kernels._triton_aot` starts it that way).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List

import torch


@dataclass(frozen=True)
class Model:
    """The widths the Triton ops see. ``norm_offset`` 1.0: zero-centred RMSNorm (Qwen3.5);
    ``rotary``: rotated channels per head; ``linear_*``: the Gated DeltaNet layers (0: none)."""
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rotary: int
    vocab: int
    intermediate: int = 0          # dense SwiGLU MLP (0: none)
    norm_offset: float = 0.0
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    shared_expert: int = 0          # shared-expert SwiGLU width (0: none)
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    conv_kernel: int = 0


MODELS: Dict[str, Model] = {
    # Qwen/Qwen3-4B config.json (tied embeddings; q_norm / k_norm over head_dim)
    "qwen3_4b": Model(hidden=2560, heads=32, kv_heads=8, head_dim=128, rotary=128, vocab=151936,
                      intermediate=9728),
    # Qwen/Qwen3-30B-A3B config.json: every layer MoE, 128 experts, top-8
    "qwen3_30b_a3b": Model(hidden=2048, heads=32, kv_heads=4, head_dim=128, rotary=128, vocab=151936,
                           experts=128, top_k=8, moe_intermediate=768),
    # Qwen3.5 dense, the widths of transformers' Qwen3_5TextConfig (its "Qwen3.5-9B style"
    # defaults): hybrid Gated DeltaNet + gated attention, partial rotary 0.25, zero-centred norms
    "qwen3_5": Model(hidden=4096, heads=16, kv_heads=4, head_dim=256, rotary=64, vocab=248320,
                     intermediate=12288, norm_offset=1.0, linear_key_heads=16, linear_value_heads=32,
                     linear_key_dim=128, linear_value_dim=128, conv_kernel=4),
    # Qwen/Qwen3.5-35B-A3B (transformers' Qwen3_5MoeTextConfig defaults): 256 experts, top-8,
    # a shared expert, the same Gated DeltaNet widths
    "qwen3_5_moe": Model(hidden=2048, heads=16, kv_heads=2, head_dim=256, rotary=64, vocab=248320,
                         norm_offset=1.0, experts=256, top_k=8, moe_intermediate=512, shared_expert=512,
                         linear_key_heads=16, linear_value_heads=32, linear_key_dim=128,
                         linear_value_dim=128, conv_kernel=4),
    # meta-llama/Meta-Llama-3-8B config.json
    "llama3_8b": Model(hidden=4096, heads=32, kv_heads=8, head_dim=128, rotary=128, vocab=128256,
                       intermediate=14336),
}

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

B, T = 2, 256                       # dense calls: [B, T]
CU_SEQLENS = (0, 100, 356, 512)     # packed calls: three sequences in one row of 512 tokens
EXPERTS_RECORDED = 8
CE_HIDDEN = 64
CE_TOKENS = 64


def _rand(*shape, dtype, grad=False):
    # values do not matter (nothing executes); zeros are the cheapest allocation
    t = torch.zeros(*shape, dtype=dtype)
    return t.requires_grad_(grad)


def _backward(*outs):
    outs = [o for o in outs if o is not None and o.requires_grad]
    torch.autograd.backward(outs, [torch.zeros_like(o) for o in outs])


def _norms(tk, m: Model, dt):
    x = _rand(B, T, m.hidden, dtype=dt, grad=True)
    w = _rand(m.hidden, dtype=dt, grad=True)
    _backward(tk.rms_norm(x, w, offset=m.norm_offset, backend="triton"))
    # q_norm / k_norm over each head
    xh = _rand(B, T, m.heads, m.head_dim, dtype=dt, grad=True)
    wh = _rand(m.head_dim, dtype=dt, grad=True)
    _backward(tk.rms_norm(xh, wh, offset=m.norm_offset, backend="triton"))


def _gated_norm(tk, m: Model, dt):
    x = _rand(B, T, m.linear_value_heads, m.linear_value_dim, dtype=dt, grad=True)
    z = _rand(B, T, m.linear_value_heads, m.linear_value_dim, dtype=dt, grad=True)
    w = _rand(m.linear_value_dim, dtype=dt, grad=True)
    _backward(tk.gated_rms_norm(x, z, w, backend="triton"))


def _rope(tk, m: Model, dt):
    q = _rand(B, m.heads, T, m.head_dim, dtype=dt, grad=True)
    k = _rand(B, m.kv_heads, T, m.head_dim, dtype=dt, grad=True)
    cos = _rand(B, T, m.rotary, dtype=dt)
    sin = _rand(B, T, m.rotary, dtype=dt)
    _backward(*tk.apply_rotary_pos_emb(q, k, cos, sin, backend="triton"))


def _swiglu(tk, m: Model, dt):
    for width in (m.intermediate, m.shared_expert):
        if width:
            g = _rand(B, T, width, dtype=dt, grad=True)
            u = _rand(B, T, width, dtype=dt, grad=True)
            _backward(tk.swiglu(g, u, backend="triton"))
            x = _rand(B, T, 2 * width, dtype=dt, grad=True)
            _backward(tk.swiglu_packed(x, backend="triton"))


def _moe(tk, m: Model, dt):
    # 8 of the model's experts, each with the rows it would get from 4096 tokens routed top-k
    # over all of them (4096 * top_k / experts): the expert count is a grid size and an offset
    # table, not part of a compiled launch, while the rows per expert may pick the tile.
    e = EXPERTS_RECORDED
    rows = 4096 * m.top_k // m.experts
    tokens = rows * e // m.top_k
    x = _rand(tokens, m.hidden, dtype=dt, grad=True)
    idx = torch.stack([torch.randperm(e)[:m.top_k] for _ in range(tokens)])
    wts = _rand(tokens, m.top_k, dtype=dt, grad=True)
    gate_up = _rand(e, 2 * m.moe_intermediate, m.hidden, dtype=dt, grad=True)
    down = _rand(e, m.hidden, m.moe_intermediate, dtype=dt, grad=True)
    _backward(tk.moe_experts(x, idx, wts, gate_up, down, backend="triton"))
    # grouped_matmul itself: the up projection ([E, H, 2I]) and the down one ([E, I, H])
    offsets = (torch.arange(1, e + 1, dtype=torch.int32) * rows)
    for k_dim, n_dim in ((m.hidden, 2 * m.moe_intermediate), (m.moe_intermediate, m.hidden)):
        xs = _rand(e * rows, k_dim, dtype=dt, grad=True)
        ws = _rand(e, k_dim, n_dim, dtype=dt, grad=True)
        _backward(tk.grouped_matmul(xs, ws, offsets, backend="triton"))


def _gdn(tk, m: Model, dt):
    H, HV, K, V = m.linear_key_heads, m.linear_value_heads, m.linear_key_dim, m.linear_value_dim
    cu = torch.tensor(CU_SEQLENS, dtype=torch.int32)
    for b, t, cu_seqlens in ((B, T, None), (1, CU_SEQLENS[-1], cu)):
        q = _rand(b, t, H, K, dtype=dt, grad=True)
        k = _rand(b, t, H, K, dtype=dt, grad=True)
        v = _rand(b, t, HV, V, dtype=dt, grad=True)
        g = _rand(b, t, HV, dtype=torch.float32, grad=True)     # the models compute the decay in fp32
        beta = _rand(b, t, HV, dtype=dt, grad=True)
        o, _ = tk.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens,
                                         backend="triton")
        _backward(o)
        if cu_seqlens is None:
            # carrying states in and out (prefill after a cache, chunked training of long documents)
            h0 = _rand(b, HV, K, V, dtype=torch.float32, grad=True)
            o, ht = tk.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                              use_qk_l2norm_in_kernel=True, backend="triton")
            _backward(o, ht)
        # the conv in front of it: q, k and v channels together
        d = 2 * H * K + HV * V
        x = _rand(b, d, t, dtype=dt, grad=True)
        w = _rand(d, m.conv_kernel, dtype=dt, grad=True)
        _backward(tk.causal_conv1d(x, w, None, activation="silu", cu_seqlens=cu_seqlens, backend="triton"))
    # decoding: one token per sequence, carrying the state
    n = 4
    q = _rand(1, n, H, K, dtype=dt)
    k = _rand(1, n, H, K, dtype=dt)
    v = _rand(1, n, HV, V, dtype=dt)
    g = _rand(1, n, HV, dtype=torch.float32)
    beta = _rand(1, n, HV, dtype=dt)
    h0 = _rand(n, HV, K, V, dtype=torch.float32)
    tk.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True,
                                        cu_seqlens=torch.arange(n + 1, dtype=torch.int32), backend="triton")


def _linear_ce(tk, m: Model, dt):
    h = _rand(CE_TOKENS, CE_HIDDEN, dtype=dt, grad=True)
    w = _rand(m.vocab, CE_HIDDEN, dtype=dt, grad=True)
    y = torch.randint(0, m.vocab, (CE_TOKENS,))
    _backward(tk.fused_linear_cross_entropy(h, w, y, backend="triton"))
    # the RL path: per-token log-probabilities and entropy (their own backward pass)
    loss, logp, ent = tk.fused_linear_cross_entropy(h, w, y, return_logps=True, return_entropy=True,
                                                    backend="triton")
    _backward(loss, logp, ent)


OPS: Dict[str, Callable] = {
    "rms_norm": _norms,
    "gated_rms_norm": _gated_norm,
    "apply_rotary_pos_emb": _rope,
    "swiglu": _swiglu,
    "moe": _moe,
    "gated_delta_rule": _gdn,
    "fused_linear_cross_entropy": _linear_ce,
}


def _applies(op: str, m: Model) -> bool:
    if op == "gated_rms_norm" or op == "gated_delta_rule":
        return m.linear_value_heads > 0
    if op == "moe":
        return m.experts > 0
    if op == "swiglu":
        return bool(m.intermediate or m.shared_expert)
    return True


def record_table(models: List[str], dtypes: List[str], ops: List[str] = None):
    """The distinct launches of the table (``[Launch]``, tagged ``model/dtype/op``). Needs
    ``TRITON_INTERPRET=1`` set before Triton was imported."""
    import twinkle_kernels as tk
    from twinkle_kernels._triton_utils import gpu_configs

    from .record import recording
    torch.manual_seed(0)
    with recording(execute=False) as rec, gpu_configs():
        for name in models:
            m = MODELS[name]
            for dname in dtypes:
                for op in ops or OPS:
                    if _applies(op, m):
                        with rec.tagged(f"{name}/{dname}/{op}"):
                            OPS[op](tk, m, DTYPES[dname])
    return rec.launches


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="record the Triton launches of the model-shape table")
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--ops", default=",".join(OPS))
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        print("shapes: run with TRITON_INTERPRET=1 (python -m twinkle_kernels._triton_aot does)", file=sys.stderr)
        return 2
    from .record import write_jsonl
    launches = record_table(args.models.split(","), args.dtypes.split(","), args.ops.split(","))
    n = write_jsonl(args.out, launches)
    print(f"recorded {n} distinct launches of the model table", flush=True)
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
