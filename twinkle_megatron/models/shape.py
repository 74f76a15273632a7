"""``ModelShape``: a model as the families describe it, shared by every family and the layers above."""
from __future__ import annotations

import dataclasses
from typing import Tuple


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the weight converter and the spec builders need to know about an HF model, read from
    its config.json by its family's ``config.model_shape`` (:mod:`twinkle_megatron.models`)."""
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int = 0
    moe_intermediate_size: int = 0
    moe_topk: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0   # Qwen3.5-MoE: a sigmoid-gated shared expert
    shared_expert_gated: bool = True           # False: the shared expert's output is added as is (GLM)
    # routing (transformers' names in brackets): "softmax" or "sigmoid" scores; a score-correction
    # bias used only to choose experts (e_score_correction_bias); group-limited top-k over
    # router_num_groups groups keeping router_group_topk (n_group / topk_group, 0: none); the
    # weights scaled by routed_scaling_factor
    router_score_function: str = "softmax"
    router_expert_bias: bool = False
    router_num_groups: int = 0
    router_group_topk: int = 0
    routed_scaling_factor: float = 1.0
    first_k_dense: int = 0                  # the first layers keep a dense MLP (first_k_dense_replace)
    # Qwen3.5 hybrid: per-layer "linear_attention" (Gated DeltaNet) / "full_attention"; empty for
    # the all-attention families.
    layer_types: Tuple[str, ...] = ()
    linear_conv_kernel_dim: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    # transformers' sliding window (0: none): a token sees keys less than sliding_window positions
    # back, in the global layers (0-based) sliding_window_layers
    sliding_window: int = 0
    sliding_window_layers: Tuple[int, ...] = ()
    partial_rotary_factor: float = 1.0
    rope_scaling_factor: float = 0.0        # llama3 RoPE scaling (Llama-3.1): its factor; 0 = none
    zero_centered_norm: bool = False        # RMSNorm scale is (1 + weight)
    attention_output_gate: bool = False     # q_proj also emits a per-head sigmoid output gate
    hf_prefix: str = "model."               # where the decoder's weights live in the HF checkpoint
    # values only the model's own family reads ((name, value) pairs; e.g. DeepSeek-V3's MLA sizes)
    family_fields: Tuple[Tuple[str, object], ...] = ()

    def family_field(self, name: str):
        """The value of ``family_fields`` entry ``name``; KeyError naming it if absent."""
        for k, v in self.family_fields:
            if k == name:
                return v
        raise KeyError(f"{self.model_type} shape has no family field {name!r}")

    def is_moe(self, layer: int) -> bool:
        """Whether global layer ``layer`` (0-based) has routed experts."""
        return bool(self.num_experts) and layer >= self.first_k_dense

    @property
    def hybrid(self) -> bool:
        return bool(self.layer_types)

    def is_linear(self, layer: int) -> bool:
        """Whether global layer ``layer`` (0-based) is a Gated DeltaNet layer."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"
