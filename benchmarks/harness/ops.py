"""What is benchmarked: each op's canonical call, shape sets and minimum cost.

Every op is called through its public ``twinkle_kernels`` name with the inputs built here
(the *canonical* layout: the one the public functions' docstrings document). An op the installed
``twinkle_kernels`` does not export is reported as missing; the definitions are written against the contract so the
op is picked up as soon as it lands.

Shapes come from real models (names in the labels):
- Qwen3-4B: hidden 2560, intermediate 9728, 32 query / 8 KV heads of 128;
- Qwen3-8B: hidden 4096, intermediate 12288, 32 / 8 heads of 128;
- Qwen3.5 (transformers' ``Qwen3_5TextConfig`` defaults): 16 key / 32 value GDN heads of
  128, conv kernel 4 (conv channels 2*16*128 + 32*128 = 8192), attention head_dim 256 with
  partial rotary factor 0.25 (64 rotary channels), 16 query / 4 KV heads;
- Qwen3-30B-A3B: hidden 2048, expert intermediate 768, 128 experts, top-8.
Full sets use 4096 tokens; ``--quick`` keeps the per-token widths and cuts tokens (and,
for MoE, the expert count and widths) so a CPU run takes seconds.

Cost model ("minimum stated in code"): memory-bound ops count the bytes that must be read
and written at least once (each input read once, each output written once; fwd+bwd is the
sum of the two, since the forward's inputs must be re-read by the backward). Matmul-bound
ops count FLOPs: 2*M*N*K per matmul, backward = 2x forward (two matmuls per forward one).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Tuple

import torch

from twinkle_kernels.testing import reduction_scale, rms_atol_scale

MODES = ("fwd", "bwd", "fwd+bwd")
# Also timed on request (``--modes``): "nograd", the forward alone under ``torch.no_grad`` (evaluation, a
# rollout's log-probs). "fwd" is a training step's forward: the inputs require grad and autograd
# records, so a fused op may compute its gradients there (fused_linear_cross_entropy's loss-only
# mode does: a first backward only scales them, the repeated "bwd" ones recompute them). "nograd"
# costs what "fwd" does in the cost model.
ALL_MODES = MODES + ("nograd",)


@dataclass
class Case:
    """One input set. ``args`` are positional (tensors or not), ``diff`` the indices of the
    differentiable ones; ``kwargs`` are constant keyword arguments."""
    args: list
    diff: Tuple[int, ...]
    kwargs: dict = field(default_factory=dict)


@dataclass
class OpSpec:
    name: str                      # benchmark name (rope, not apply_rotary_pos_emb)
    api: str                       # attribute of twinkle_kernels
    bound: str                     # "memory" (GB/s) or "compute" (TFLOP/s)
    shapes: Dict[str, List[dict]]  # "full" / "quick" -> shape dicts with a "label"
    make: Callable[[dict, torch.dtype, torch.device], Case]
    cost: Callable[[dict, torch.dtype, str], float]  # bytes or FLOPs for (shape, dtype, mode)
    gate_shape: Callable[[dict], dict] = lambda s: s  # the float64 check may use a smaller shape
    outputs: Callable[[object], Tuple[torch.Tensor, ...]] = None
    no_compile: str = ""  # why torch.compile of the reference is not benchmarked (empty: it is)
    # tolerance widening of gradient i (index into Case.diff) for reductions of the gate's case;
    # None: the harness's default (sqrt of output size over gradient size, for weight-like grads)
    grad_scale: Callable[[Case, int], float] = None
    # absolute-tolerance widening of gradient i given its float64 reference (see
    # twinkle_kernels.testing.assert_close's atol_scale); None: 1
    grad_atol_scale: Callable[[Case, int, torch.Tensor], float] = None

    def select_outputs(self, out) -> Tuple[torch.Tensor, ...]:
        if self.outputs is not None:
            return self.outputs(out)
        if isinstance(out, torch.Tensor):
            return (out,)
        return tuple(t for t in out if isinstance(t, torch.Tensor))


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _mem(fwd_elems: Tuple[int, int], bwd_elems: Tuple[int, int]):
    """Cost function from element counts (read, written) of fwd and bwd, in the input dtype."""
    def cost(s, dtype, mode):
        e = _esize(dtype)
        f = sum(fwd_elems(s)) * e
        b = sum(bwd_elems(s)) * e
        return {"fwd": f, "bwd": b, "fwd+bwd": f + b}[mode]
    return cost


def _flops(fwd_flops):
    def cost(s, dtype, mode):
        f = fwd_flops(s)
        return {"fwd": f, "bwd": 2 * f, "fwd+bwd": 3 * f}[mode]
    return cost


def _randn(shape, dtype, device, scale=1.0):
    return (torch.randn(shape, dtype=torch.float32, device=device) * scale).to(dtype)


# --- rms_norm -----------------------------------------------------------------------------------
def _rms_make(s, dtype, device):
    x = _randn((s["rows"], s["d"]), dtype, device)
    w = (1 + 0.1 * torch.randn(s["d"], device=device)).to(dtype)
    return Case([x, w, 1e-6], diff=(0, 1))


RMS_NORM = OpSpec(
    "rms_norm", "rms_norm", "memory",
    {"full": [{"label": "Qwen3-4B hidden 4096x2560", "rows": 4096, "d": 2560},
              {"label": "Qwen3-8B hidden 4096x4096", "rows": 4096, "d": 4096},
              {"label": "Qwen3 q_norm 4096*32x128", "rows": 4096 * 32, "d": 128}],
     "quick": [{"label": "Qwen3-4B hidden 256x2560", "rows": 256, "d": 2560},
               {"label": "Qwen3 q_norm 64*32x128", "rows": 64 * 32, "d": 128}]},
    _rms_make,
    # fwd: read x, w; write y.  bwd: read dy, x, w; write dx, dw.
    _mem(lambda s: (s["rows"] * s["d"] + s["d"], s["rows"] * s["d"]),
         lambda s: (2 * s["rows"] * s["d"] + s["d"], s["rows"] * s["d"] + s["d"])),
)


# --- gated_rms_norm (Qwen3.5 GDN output norm: per value head of 128) -----------------------------
def _gated_make(s, dtype, device):
    x = _randn((s["rows"], s["d"]), dtype, device)
    gate = _randn((s["rows"], s["d"]), dtype, device)
    w = (1 + 0.1 * torch.randn(s["d"], device=device)).to(dtype)
    return Case([x, gate, w, 1e-6], diff=(0, 1, 2))


GATED_RMS_NORM = OpSpec(
    "gated_rms_norm", "gated_rms_norm", "memory",
    {"full": [{"label": "Qwen3.5 GDN norm 4096*32x128", "rows": 4096 * 32, "d": 128}],
     "quick": [{"label": "Qwen3.5 GDN norm 64*32x128", "rows": 64 * 32, "d": 128}]},
    _gated_make,
    # fwd: read x, gate, w; write y.  bwd: read dy, x, gate, w; write dx, dgate, dw.
    _mem(lambda s: (2 * s["rows"] * s["d"] + s["d"], s["rows"] * s["d"]),
         lambda s: (3 * s["rows"] * s["d"] + s["d"], 2 * s["rows"] * s["d"] + s["d"])),
)


# --- rope ----------------------------------------------------------------------------------------
def rope_cos_sin(b, seq, rot, device, dtype, base=10000.0):
    """HF-style cos/sin ``[B, S, rot]`` (frequencies duplicated over the two halves) and the angles."""
    inv = 1.0 / (base ** (torch.arange(0, rot, 2, device=device, dtype=torch.float32) / rot))
    pos = torch.arange(seq, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[None].expand(b, -1, -1).to(dtype), emb.sin()[None].expand(b, -1, -1).to(dtype), emb


def _rope_make(s, dtype, device):
    q = _randn((s["b"], s["hq"], s["seq"], s["d"]), dtype, device)
    k = _randn((s["b"], s["hk"], s["seq"], s["d"]), dtype, device)
    cos, sin, _ = rope_cos_sin(s["b"], s["seq"], s["rot"], device, dtype)
    return Case([q, k, cos.contiguous(), sin.contiguous(), 1], diff=(0, 1))


def _rope_elems(s):
    qk = s["b"] * (s["hq"] + s["hk"]) * s["seq"] * s["d"]
    cs = 2 * s["b"] * s["seq"] * s["rot"]
    return qk, cs


ROPE = OpSpec(
    "rope", "apply_rotary_pos_emb", "memory",
    {"full": [{"label": "Qwen3-8B 1x4096 32/8 heads x128", "b": 1, "seq": 4096, "hq": 32, "hk": 8,
               "d": 128, "rot": 128},
              {"label": "Qwen3.5 1x4096 16/4 heads x256 rot64", "b": 1, "seq": 4096, "hq": 16, "hk": 4,
               "d": 256, "rot": 64}],
     "quick": [{"label": "Qwen3-8B 1x128 32/8 heads x128", "b": 1, "seq": 128, "hq": 32, "hk": 8,
                "d": 128, "rot": 128}]},
    _rope_make,
    # fwd: read q, k, cos, sin; write q', k'.  bwd: read dq', dk', cos, sin; write dq, dk.
    _mem(lambda s: (_rope_elems(s)[0] + _rope_elems(s)[1], _rope_elems(s)[0]),
         lambda s: (_rope_elems(s)[0] + _rope_elems(s)[1], _rope_elems(s)[0])),
)


# --- swiglu --------------------------------------------------------------------------------------
def _swiglu_make(s, dtype, device):
    return Case([_randn((s["rows"], s["i"]), dtype, device), _randn((s["rows"], s["i"]), dtype, device)],
                diff=(0, 1))


SWIGLU = OpSpec(
    "swiglu", "swiglu", "memory",
    {"full": [{"label": "Qwen3-4B MLP 4096x9728", "rows": 4096, "i": 9728},
              {"label": "Qwen3-8B MLP 4096x12288", "rows": 4096, "i": 12288},
              {"label": "Qwen3-30B-A3B experts 4096*8x768", "rows": 4096 * 8, "i": 768}],
     "quick": [{"label": "Qwen3-4B MLP 64x9728", "rows": 64, "i": 9728}]},
    _swiglu_make,
    # fwd: read gate, up; write out.  bwd: read dout, gate, up; write dgate, dup.
    _mem(lambda s: (2 * s["rows"] * s["i"], s["rows"] * s["i"]),
         lambda s: (3 * s["rows"] * s["i"], 2 * s["rows"] * s["i"])),
)


# --- chunk_gated_delta_rule ----------------------------------------------------------------------
def _gdr_make(s, dtype, device):
    b, t, h, hv, kd, vd = s["b"], s["t"], s["h"], s["hv"], s["k"], s["v"]
    q = _randn((b, t, h, kd), dtype, device)
    k = _randn((b, t, h, kd), dtype, device)
    v = _randn((b, t, hv, vd), dtype, device)
    # log-decay in (-0.5, 0) and write strength in (0, 1), as the model's gates produce
    g = (-0.5 * torch.rand(b, t, hv, device=device)).to(dtype)
    beta = torch.rand(b, t, hv, device=device).to(dtype)
    return Case([q, k, v, g, beta], diff=(0, 1, 2, 3, 4), kwargs={"use_qk_l2norm_in_kernel": True})


def _gdr_flops(s, chunk=64):
    """Chunked form (fla's formulation), per chunk of C tokens and value head: QK^T and KK^T
    (2 * 2*C*C*K), the WY products w = A(k*beta), u = A(v*beta) (2*C*C*K + 2*C*C*V), the
    intra-chunk output (2*C*C*V), and the state terms q S, w S, k^T v_new (3 * 2*C*K*V).
    The triangular solve (O(C^3)) and elementwise work are not counted."""
    c = chunk
    per_chunk = 6 * c * c * s["k"] + 4 * c * c * s["v"] + 6 * c * s["k"] * s["v"]
    return s["b"] * s["hv"] * math.ceil(s["t"] / c) * per_chunk


CHUNK_GATED_DELTA_RULE = OpSpec(
    "chunk_gated_delta_rule", "chunk_gated_delta_rule", "compute",
    {"full": [{"label": "Qwen3.5 GDN 1x4096 16/32 heads x128", "b": 1, "t": 4096, "h": 16, "hv": 32,
               "k": 128, "v": 128}],
     # quick: heads cut 4x as well: the float64 reference's autograd keeps a [HV, K, V] state per token
     "quick": [{"label": "Qwen3.5 GDN (4/8 heads) 1x128 x128", "b": 1, "t": 128, "h": 4, "hv": 8,
                "k": 128, "v": 128}]},
    _gdr_make,
    _flops(_gdr_flops),
    # the float64 reference is a token loop holding a [HV, K, V] state per token for autograd
    # (4 MiB at 32 heads): check long sequences on their first 128 tokens
    gate_shape=lambda s: dict(s, b=1, t=min(s["t"], 128)),
    outputs=lambda out: (out[0],),
    no_compile="the reference is a per-token Python loop: dynamo would unroll T steps (minutes to compile)",
)


# --- causal_conv1d -------------------------------------------------------------------------------
def _conv_make(s, dtype, device):
    x = _randn((s["b"], s["d"], s["t"]), dtype, device)
    w = _randn((s["d"], s["w"]), dtype, device, scale=0.5)
    bias = _randn((s["d"],), dtype, device, scale=0.1)
    return Case([x, w, bias, "silu"], diff=(0, 1, 2))


CAUSAL_CONV1D = OpSpec(
    "causal_conv1d", "causal_conv1d", "memory",
    {"full": [{"label": "Qwen3.5 GDN conv 1x8192x4096 W4", "b": 1, "d": 8192, "t": 4096, "w": 4}],
     "quick": [{"label": "Qwen3.5 GDN conv 1x8192x128 W4", "b": 1, "d": 8192, "t": 128, "w": 4}]},
    _conv_make,
    # fwd: read x, w, bias; write y.  bwd: read dy, x, w; write dx, dw, dbias.
    _mem(lambda s: (s["b"] * s["d"] * s["t"] + s["d"] * (s["w"] + 1), s["b"] * s["d"] * s["t"]),
         lambda s: (2 * s["b"] * s["d"] * s["t"] + s["d"] * s["w"],
                    s["b"] * s["d"] * s["t"] + s["d"] * (s["w"] + 1))),
)


# --- grouped_matmul ------------------------------------------------------------------------------
def routing(tokens: int, experts: int, top_k: int, device, seed: int = 0):
    """Random top-k routing: ``top_k_index [T, k]`` (distinct experts per token)."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=gen)
    return scores.topk(top_k, dim=-1).indices.to(device)


def _gmm_make(s, dtype, device):
    idx = routing(s["tokens"], s["e"], s["top_k"], device).reshape(-1)
    counts = torch.bincount(idx, minlength=s["e"])
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    m = int(counts.sum())
    x = _randn((m, s["kdim"]), dtype, device)
    w = _randn((s["e"], s["kdim"], s["n"]), dtype, device, scale=s["kdim"] ** -0.5)
    return Case([x, w, offsets], diff=(0, 1))


GROUPED_MATMUL = OpSpec(
    "grouped_matmul", "grouped_matmul", "compute",
    {"full": [{"label": "Qwen3-30B-A3B gate_up 4096*8 x 2048->1536 E128", "tokens": 4096, "top_k": 8, "e": 128,
               "kdim": 2048, "n": 1536},
              {"label": "Qwen3-30B-A3B down 4096*8 x 768->2048 E128", "tokens": 4096, "top_k": 8, "e": 128,
               "kdim": 768, "n": 2048}],
     "quick": [{"label": "MoE (scaled) gate_up 64*8 x 512->384 E16", "tokens": 64, "top_k": 8, "e": 16,
                "kdim": 512, "n": 384}]},
    _gmm_make,
    _flops(lambda s: 2 * s["tokens"] * s["top_k"] * s["kdim"] * s["n"]),
    gate_shape=lambda s: dict(s, tokens=min(s["tokens"], 256)),
    grad_scale=lambda c, i: reduction_scale(_max_group(c.args[2])) if i == 1 else 1.0,
)


# --- moe_experts ---------------------------------------------------------------------------------
def _max_group(offsets: torch.Tensor) -> int:
    counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long())
    return int(counts.max()) if counts.numel() else 0


def _moe_grad_scale(c: Case, i: int) -> float:
    hs, idx, _, gate_up, _ = c.args
    if i in (2, 3):  # d gate_up_proj, d down_proj: sums over the tokens routed to one expert
        return reduction_scale(int(torch.bincount(idx.reshape(-1), minlength=gate_up.shape[0]).max()))
    return 1.0


def _moe_grad_atol_scale(c: Case, i: int, ref: torch.Tensor) -> float:
    """d top_k_weights[t, j] is a dot product over H of an expert output (rounded to the input
    dtype) with the output gradient: its rounding error is a fraction of eps times the typical
    entry (the rms, about sqrt(H) times the summands' size), whatever the entry's own size. In
    bf16 at the quick shape (H=512, rms 14) every implementation measured, eager bf16 included,
    makes errors of 0.06-0.18 on entries near 0, beyond the table's 0.02 x sqrt(H)/4+1 = 0.13;
    twice the rms keeps a margin of 3, and a wrong routing or weighting errs by about the rms."""
    return rms_atol_scale(ref) if i == 1 else 1.0


def _moe_make(s, dtype, device):
    t, e, k, h, i = s["tokens"], s["e"], s["top_k"], s["h"], s["i"]
    hs = _randn((t, h), dtype, device)
    idx = routing(t, e, k, device)
    wts = torch.softmax(torch.randn(t, k, device=device), -1).to(dtype)
    gate_up = _randn((e, 2 * i, h), dtype, device, scale=h ** -0.5)
    down = _randn((e, h, i), dtype, device, scale=i ** -0.5)
    return Case([hs, idx, wts, gate_up, down], diff=(0, 2, 3, 4))


MOE_EXPERTS = OpSpec(
    "moe_experts", "moe_experts", "compute",
    {"full": [{"label": "Qwen3-30B-A3B experts 4096 tok H2048 I768 E128 top8", "tokens": 4096, "e": 128,
               "top_k": 8, "h": 2048, "i": 768}],
     "quick": [{"label": "MoE (scaled) 64 tok H512 I192 E16 top8", "tokens": 64, "e": 16, "top_k": 8,
                "h": 512, "i": 192}]},
    _moe_make,
    # per routed token: gate_up (2*H*2I) + down (2*I*H)
    _flops(lambda s: 6 * s["tokens"] * s["top_k"] * s["h"] * s["i"]),
    gate_shape=lambda s: dict(s, tokens=min(s["tokens"], 256)),
    grad_scale=_moe_grad_scale,
    grad_atol_scale=_moe_grad_atol_scale,
)


# --- fused_linear_cross_entropy (LM head + loss) --------------------------------------------------
def _lce_make(s, dtype, device):
    n, h, v = s["n"], s["h"], s["v"]
    hidden = _randn((n, h), dtype, device)
    weight = _randn((v, h), dtype, device, scale=h ** -0.5)
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[::8] = -100  # prompt tokens that are not trained on
    return Case([hidden, weight, labels.to(device)], diff=(0, 1))


FUSED_LINEAR_CROSS_ENTROPY = OpSpec(
    "fused_linear_cross_entropy", "fused_linear_cross_entropy", "compute",
    {"full": [{"label": "Qwen3-4B LM head 4096 tok H2560 V151936", "n": 4096, "h": 2560, "v": 151936}],
     # quick: the vocabulary cut 16x and the tokens 16x, hidden size kept
     "quick": [{"label": "Qwen3-4B LM head (scaled) 256 tok H2560 V9496", "n": 256, "h": 2560, "v": 9496}]},
    _lce_make,
    # the logits GEMM (2*N*H*V); backward: d hidden and d weight, one GEMM each
    _flops(lambda s: 2 * s["n"] * s["h"] * s["v"]),
    # the float64 check holds [N, V] fp64 logits and their gradient: at most 256 tokens
    gate_shape=lambda s: dict(s, n=min(s["n"], 256)),
    grad_scale=lambda c, i: reduction_scale(c.args[1].shape[0] if i == 0 else c.args[0].shape[0]),
)


OPS: Dict[str, OpSpec] = {o.name: o for o in (RMS_NORM, GATED_RMS_NORM, ROPE, SWIGLU, CHUNK_GATED_DELTA_RULE,
                                              CAUSAL_CONV1D, GROUPED_MATMUL, MOE_EXPERTS,
                                              FUSED_LINEAR_CROSS_ENTROPY)}


def twinkle_fn(spec: OpSpec):
    """The public twinkle_kernels function of ``spec``, or None when this install lacks it."""
    import twinkle_kernels
    return getattr(twinkle_kernels, spec.api, None)


def shape_str(s: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in s.items() if k != "label")
