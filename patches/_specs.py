"""The declarative registry: which transformers targets each family has, and what replaces them.

A :class:`PatchSpec` names one target in one modeling module:

- ``kind="class"``: an ``nn.Module`` class. The module global is replaced by a subclass whose
  ``forward`` calls the twinkle op (models built afterwards), and instances already built are
  moved to that subclass (``__class__`` swap: parameters, buffers and ``state_dict`` keys stay).
- ``kind="function"``: a module-global function (``apply_rotary_pos_emb``, the Gated DeltaNet
  functions); the modeling code looks it up at call time, so one swap serves every model.
- ``kind="attention"``: the module global ``ALL_ATTENTION_FUNCTIONS`` becomes the module's own
  ``AttentionInterface`` whose ``sdpa`` and ``eager`` are packing-aware (``_attention.family_interface``);
  models keep the implementation their user set. ``kind="attention_name"`` (one spec, family
  ``"all"``): registers ``twinkle_packed`` in ``transformers.AttentionInterface`` for models that ask
  for it by name; the global ``sdpa`` entry is never touched.
- ``kind="experts"``: registers "twinkle" (``twinkle_patches.hf_experts``) in
  ``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`` and swaps the experts class like
  ``"class"``, leaving transformers' switch intact: the patched forward runs the twinkle op only
  when ``config._experts_implementation == "twinkle"``; ``"eager"``, ``"batched_mm"``,
  ``"grouped_mm"`` (``set_experts_implementation``, ``experts_implementation=``) run transformers'
  own code. "twinkle" becomes the default: models of the family built while patched without
  ``experts_implementation=`` select it, and a model given to ``apply`` on the default
  (``grouped_mm``) is switched to it; revert restores the previous selection.

The family table below is the single source: names were checked against transformers 5.17 (the
oldest admitted) and 5.25 (``tests/patches/test_patches.py::test_canary_every_registered_target_exists_in_installed_transformers``
fails loudly when one disappears; ``tests/patches/test_patches_targets.py`` when one is skipped). From 5.25
the ``"function"`` targets are held in transformers' hub-kernel wrappers; ``apply`` swaps those too
(see ``twinkle_patches._apply._hub_wrapped``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

DEVICES = ("cpu", "cuda", "npu")

# op -> Ascend toggle that governs it (besides TWINKLE_NPU_PATCH, which governs all)
OP_TOGGLES: Dict[str, str] = {
    "rms_norm": "TWINKLE_NPU_FUSED_OPS",
    "gated_rms_norm": "TWINKLE_NPU_FUSED_OPS",
    "apply_rotary_pos_emb": "TWINKLE_NPU_FUSED_OPS",
    "swiglu": "TWINKLE_NPU_FUSED_OPS",
    "moe_experts": "TWINKLE_NPU_MOE_PATCH",
    "chunk_gated_delta_rule": "TWINKLE_NPU_FLA",
    "fused_recurrent_gated_delta_rule": "TWINKLE_NPU_FLA",
    "causal_conv1d": "TWINKLE_NPU_FLA",
    "causal_conv1d_update": "TWINKLE_NPU_FLA",
    "fused_linear_cross_entropy": "TWINKLE_NPU_FUSED_OPS",
    # not a twinkle_kernels op: torch SDPA with a mask that keeps packed samples apart (_attention.py)
    "packed_attention": "TWINKLE_NPU_FUSED_OPS",
}
OPS = tuple(OP_TOGGLES)
# Ops that change what a forward returns (``logits`` is None in a fused training step): applied only
# when named in ``apply(ops=...)``, never by ``ops=None``.
OPT_IN_OPS: Tuple[str, ...] = ("fused_linear_cross_entropy",)
# Names accepted by ``apply(ops=...)`` besides the op names themselves.
OP_ALIASES: Dict[str, Tuple[str, ...]] = {
    "rope": ("apply_rotary_pos_emb",),
    "norm": ("rms_norm", "gated_rms_norm"),
    "experts": ("moe_experts",),
    "attention": ("packed_attention",),
    "linear_ce": ("fused_linear_cross_entropy",),
    "gdn": ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d", "causal_conv1d_update"),
}


# What a patched layer runs while torch.compile traces it (``apply(under_compile=...)``). A twinkle
# custom op is opaque to inductor: it cannot fuse it with the matmuls and elementwise ops around it,
# and each call pays its dispatch. For the row-wise ops that fusion is the whole point, so under
# compile their layers can hand inductor a traceable decomposition instead. The other ops' value is
# not fusion (a grouped matmul, the chunked delta rule, the conv over packed samples, the fused LM
# head's memory): they keep their custom ops unless measured otherwise (the experts, see "auto").
# op -> the decomposition traced in its place
COMPILE_DECOMPOSITIONS: Dict[str, str] = {
    "rms_norm": "twinkle_kernels.rms_norm_reference",
    "gated_rms_norm": "twinkle_kernels.gated_rms_norm_reference",
    "apply_rotary_pos_emb": "twinkle_kernels.apply_rotary_pos_emb_reference",
    "swiglu": "twinkle_kernels.swiglu_reference",
    "moe_experts": "transformers' grouped_mm experts",
    # unpacked calls only (no cu_seqlens / cu_seq_lens_q: a trace-time constant); packed ones keep
    # the custom op, since transformers' torch code would carry state across the samples
    "chunk_gated_delta_rule": "transformers' torch_chunk_gated_delta_rule (unpacked calls)",
    "causal_conv1d": "transformers' torch causal_conv1d_fn (unpacked calls)",
}
# under_compile="auto" (the default), measured on a CPU with inductor (benchmarks/results/
# compiled_model_step_cpu_2026-12-01*.md): the row-wise custom ops made a compiled patched model
# 0.51-0.59x the speed of a compiled unpatched one (decomposed: as fast); the experts custom op costs
# its compiled model 0.8x, and alone 0.71-0.75x transformers' compiled grouped_mm up to 2048 tokens,
# 64 experts (its backward reruns the forward), so it decomposes too; the Gated DeltaNet chunk op
# loses on short sequences and wins on long ones (one call, batch 1, 1 thread, CPU time, transformers'
# / twinkle's: 0.73 at T=256, 0.88 at 1024, 1.13 at 2048, 1.54 at 4096), so under "auto" unpacked
# calls shorter than GDN_CHUNK_KERNEL_MIN_TOKENS decompose and longer ones keep the op (the sequence
# length is a trace-time shape: static, or a symbolic size dynamo guards on); packed calls keep it.
ROWWISE_OPS: Tuple[str, ...] = ("rms_norm", "gated_rms_norm", "apply_rotary_pos_emb", "swiglu")
GDN_CHUNK_KERNEL_MIN_TOKENS = 1536
# choice -> {op: True (always decompose) | n (decompose calls of fewer than n tokens per sequence)}
UNDER_COMPILE_CHOICES: Dict[str, Dict[str, object]] = {
    "auto": {**{o: True for o in ROWWISE_OPS}, "moe_experts": True,
             "chunk_gated_delta_rule": GDN_CHUNK_KERNEL_MIN_TOKENS},
    "decompose_rowwise": {o: True for o in ROWWISE_OPS},
    "kernels": {},
    "decompose_all": {o: True for o in COMPILE_DECOMPOSITIONS},
}
DEFAULT_UNDER_COMPILE = "auto"


def transformers_experts_compile() -> bool:
    """Whether transformers' ``grouped_mm`` experts compile forward and backward: only where its
    fallback's backward is an opaque op of its own (``transformers::grouped_mm_fallback_backward``).
    Older releases (5.17) loop over ``offs.tolist()`` in that backward, which torch.compile cannot
    trace (a data-dependent guard), unpatched too; there "auto" keeps the experts custom op."""
    try:
        import torch
        import transformers.integrations.moe  # noqa: F401  (registers its ops)
        return hasattr(torch.ops.transformers, "grouped_mm_fallback_backward")
    except (ImportError, AttributeError, RuntimeError):
        return False


def normalize_under_compile(choice) -> Dict[str, object]:
    """``apply(under_compile=...)`` -> ``{op: True | n}``: the ops whose layers trace their
    decomposition under compile, always (True) or for calls of fewer than n tokens per sequence."""
    if isinstance(choice, str):
        key = choice.strip().lower()
        if key in UNDER_COMPILE_CHOICES:
            out = dict(UNDER_COMPILE_CHOICES[key])
            if key == "auto" and not transformers_experts_compile():
                out.pop("moe_experts")
            return out
        choice = (choice,)
    try:
        names = tuple(choice)
    except TypeError:
        raise TypeError(f"under_compile must be one of {sorted(UNDER_COMPILE_CHOICES)} or op names, got "
                        f"{type(choice).__name__}") from None
    try:
        ops = normalize_ops(names)
    except ValueError as e:
        raise ValueError(f"under_compile: {e}; or one of {sorted(UNDER_COMPILE_CHOICES)}") from None
    bad = [o for o in ops if o not in COMPILE_DECOMPOSITIONS]
    if bad:
        raise ValueError(f"under_compile: {bad} have no decomposition (they always run their custom op under "
                         f"torch.compile); ops that do: {list(COMPILE_DECOMPOSITIONS)}")
    return {o: True for o in ops}


@dataclass(frozen=True)
class PatchSpec:
    """One patch: ``module.target`` is replaced by ``impl``, which calls ``twinkle_kernels.<op>``."""

    family: str
    module: str
    target: str
    kind: str        # "class" | "function" | "experts" | "attention" | "attention_name"
    op: str          # the twinkle_kernels op it needs
    impl: str        # key of the replacement in twinkle_patches._impls
    devices: Tuple[str, ...] = DEVICES

    @property
    def name(self) -> str:
        return f"{self.family}:{self.target}"

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.target}"

    def __str__(self) -> str:
        return f"{self.name:<48} {self.kind:<8} {self.op:<32} devices={','.join(self.devices)}"


@dataclass(frozen=True)
class Family:
    module: str
    norms: Tuple[str, ...] = ()           # Llama-style: x_normed.to(dtype) * weight, eps in variance_epsilon
    zero_centred_norms: Tuple[str, ...] = ()  # norm(x.float()) * (1 + weight), eps in self.eps
    gated_norms: Tuple[str, ...] = ()     # forward(hidden_states, gate): norm * silu(gate)
    rope: bool = True                     # module global apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    mlps: Tuple[str, ...] = ()            # down(act(gate(x)) * up(x))
    experts: Tuple[str, ...] = ()         # @use_experts_implementation classes
    gdn: bool = False                     # Gated DeltaNet module globals
    causal_lm: Tuple[str, ...] = ()       # *ForCausalLM: lm_head + self.loss_function(logits, labels, ...)
    attention: bool = True                # ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)


_M = "transformers.models.{0}.modeling_{0}"

FAMILIES: Dict[str, Family] = {
    "llama": Family(_M.format("llama"), norms=("LlamaRMSNorm",), mlps=("LlamaMLP",), causal_lm=("LlamaForCausalLM",)),
    "qwen2": Family(_M.format("qwen2"), norms=("Qwen2RMSNorm",), mlps=("Qwen2MLP",), causal_lm=("Qwen2ForCausalLM",)),
    "qwen3": Family(_M.format("qwen3"), norms=("Qwen3RMSNorm",), mlps=("Qwen3MLP",), causal_lm=("Qwen3ForCausalLM",)),
    "qwen3_moe": Family(_M.format("qwen3_moe"), norms=("Qwen3MoeRMSNorm",), mlps=("Qwen3MoeMLP",),
                        experts=("Qwen3MoeExperts",), causal_lm=("Qwen3MoeForCausalLM",)),
    "qwen3_next": Family(_M.format("qwen3_next"), zero_centred_norms=("Qwen3NextRMSNorm",),
                         gated_norms=("Qwen3NextRMSNormGated",), mlps=("Qwen3NextMLP",),
                         experts=("Qwen3NextExperts",), gdn=True, causal_lm=("Qwen3NextForCausalLM",)),
    "qwen3_5": Family(_M.format("qwen3_5"), zero_centred_norms=("Qwen3_5RMSNorm",),
                      gated_norms=("Qwen3_5RMSNormGated",), mlps=("Qwen3_5MLP",), gdn=True, causal_lm=("Qwen3_5ForCausalLM",)),
    "qwen3_5_moe": Family(_M.format("qwen3_5_moe"), zero_centred_norms=("Qwen3_5MoeRMSNorm",),
                          gated_norms=("Qwen3_5MoeRMSNormGated",), mlps=("Qwen3_5MoeMLP",),
                          experts=("Qwen3_5MoeExperts",), gdn=True, causal_lm=("Qwen3_5MoeForCausalLM",)),
    # Mixtral has no dense MLP class in transformers 5.x: every FFN is an experts block.
    "mixtral": Family(_M.format("mixtral"), norms=("MixtralRMSNorm",), experts=("MixtralExperts",), causal_lm=("MixtralForCausalLM",)),
    "glm4_moe": Family(_M.format("glm4_moe"), norms=("Glm4MoeRMSNorm",), mlps=("Glm4MoeMLP",),
                       experts=("Glm4MoeExperts",), causal_lm=("Glm4MoeForCausalLM",)),
    # DeepSeek-V3 calls apply_rotary_pos_emb only with config.rope_interleave=False (the default
    # checkpoints use apply_rotary_pos_emb_interleave, which no twinkle op serves).
    "deepseek_v3": Family(_M.format("deepseek_v3"), norms=("DeepseekV3RMSNorm",), mlps=("DeepseekV3MLP",),
                          experts=("DeepseekV3Experts",), causal_lm=("DeepseekV3ForCausalLM",)),
}

@dataclass(frozen=True)
class MoeRouting:
    """Where a family routes tokens (``twinkle_patches.router_replay``; off unless the user asks).

    ``block``: the sparse MoE block, called with hidden states ``[B, S, H]``; ``router``: the class of
    its ``gate``, whose ``forward`` returns ``(router_logits, weights [T, k], ids [T, k])`` for the
    ``T = B * S`` tokens. ``scoring``, read from transformers 5.17 and 5.23 (identical there; on 5.25
``tests/patches/test_router_replay_hf.py``'s bit-equal replay of every family still holds):
    ``"softmax"``: weights are ``softmax(logits)`` (fp32) at the ids, divided by their sum when the
    router's ``norm_topk_prob`` is true (always for routers without that attribute), cast to the
    logits' dtype when ``cast`` is true; ``"sigmoid"``: ``sigmoid(logits)`` (fp32) at the ids, divided
    by their sum + 1e-20 when ``norm_topk_prob``, times ``routed_scaling_factor``.
    """

    family: str
    block: str
    router: str
    scoring: str
    cast: bool = True


ROUTING: Dict[str, MoeRouting] = {r.family: r for r in (
    MoeRouting("qwen3_moe", "Qwen3MoeSparseMoeBlock", "Qwen3MoeTopKRouter", "softmax"),
    MoeRouting("qwen3_next", "Qwen3NextSparseMoeBlock", "Qwen3NextTopKRouter", "softmax"),
    MoeRouting("qwen3_5_moe", "Qwen3_5MoeSparseMoeBlock", "Qwen3_5MoeTopKRouter", "softmax"),
    MoeRouting("mixtral", "MixtralSparseMoeBlock", "MixtralTopKRouter", "softmax", cast=False),
    MoeRouting("glm4_moe", "Glm4MoeMoE", "Glm4MoeTopkRouter", "sigmoid"),
    MoeRouting("deepseek_v3", "DeepseekV3MoE", "DeepseekV3TopkRouter", "sigmoid"),
)}


# Accepted spellings of family names: "Qwen3-MoE", "qwen3.5", "Qwen3_5_Moe" ...
def normalize_family(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"families must hold strings, got {type(name).__name__}")
    key = name.strip().lower().replace("-", "_").replace(".", "_")
    if key not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known families: {sorted(FAMILIES)}")
    return key


def normalize_ops(ops) -> Tuple[str, ...]:
    if isinstance(ops, str):
        ops = (ops,)
    out: List[str] = []
    for o in ops:
        if not isinstance(o, str):
            raise TypeError(f"ops must hold strings, got {type(o).__name__}")
        key = o.strip().lower()
        if key in OP_TOGGLES:
            out.append(key)
        elif key in OP_ALIASES:
            out.extend(OP_ALIASES[key])
        else:
            raise ValueError(f"unknown op {o!r}; known ops: {list(OPS)} (aliases: {sorted(OP_ALIASES)})")
    return tuple(dict.fromkeys(out))


def _family_specs(family: str, f: Family) -> List[PatchSpec]:
    s: List[PatchSpec] = []
    for cls in f.norms:
        s.append(PatchSpec(family, f.module, cls, "class", "rms_norm", "rms_norm"))
    for cls in f.zero_centred_norms:
        s.append(PatchSpec(family, f.module, cls, "class", "rms_norm", "rms_norm_zero_centred"))
    for cls in f.gated_norms:
        s.append(PatchSpec(family, f.module, cls, "class", "gated_rms_norm", "gated_rms_norm"))
    if f.rope:
        s.append(PatchSpec(family, f.module, "apply_rotary_pos_emb", "function", "apply_rotary_pos_emb", "rope"))
    for cls in f.mlps:
        s.append(PatchSpec(family, f.module, cls, "class", "swiglu", "swiglu_mlp"))
    for cls in f.experts:
        s.append(PatchSpec(family, f.module, cls, "experts", "moe_experts", "experts"))
    for cls in f.causal_lm:
        s.append(PatchSpec(family, f.module, cls, "class", "fused_linear_cross_entropy", "fused_linear_cross_entropy"))
    if f.attention:
        s.append(PatchSpec(family, f.module, "ALL_ATTENTION_FUNCTIONS", "attention", "packed_attention",
                           "packed_attention"))
    if f.gdn:
        s.append(PatchSpec(family, f.module, "torch_chunk_gated_delta_rule", "function", "chunk_gated_delta_rule",
                           "gdn_chunk"))
        s.append(PatchSpec(family, f.module, "torch_recurrent_gated_delta_rule", "function",
                           "fused_recurrent_gated_delta_rule", "gdn_recurrent"))
        s.append(PatchSpec(family, f.module, "causal_conv1d_fn", "function", "causal_conv1d", "conv1d"))
        s.append(PatchSpec(family, f.module, "causal_conv1d_update", "function", "causal_conv1d_update",
                           "conv1d_update"))
    return s


# One spec for every family: registers the packing-aware attention under its own name
# (AttentionInterface); family "all" matches any family selection.
ATTENTION_SPEC = PatchSpec("all", "transformers.modeling_utils", "AttentionInterface", "attention_name", "packed_attention",
                           "packed_attention")

SPECS: Tuple[PatchSpec, ...] = tuple(sp for fam, f in FAMILIES.items() for sp in _family_specs(fam, f)) + \
    (ATTENTION_SPEC,)
