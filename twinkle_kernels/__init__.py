"""Twinkle kernels: fused LLM training ops with reference, C++ (CPU), Triton (CUDA) and NPU backends.

Every op takes ``backend=None`` ("auto"), "reference", "cpu", "triton" or "npu"; see
:mod:`twinkle_kernels._dispatch` for the selection order. Importing this package
imports neither triton nor the C++ extension; they load on first use.
"""
from ._dispatch import BACKENDS, BackendUnavailableError, backend_status, default_backend, reset
from .gdn import (causal_conv1d, causal_conv1d_cp, causal_conv1d_update, chunk_gated_delta_rule,
                  chunk_gated_delta_rule_cp, fused_recurrent_gated_delta_rule)
from .norm import gated_rms_norm, rms_norm
from .rope import apply_rotary_pos_emb
from .swiglu import swiglu, swiglu_packed
from .moe import grouped_matmul, grouped_matmul_backward, moe_experts
from .linear_ce import fused_linear_cross_entropy, vocab_parallel_fused_linear_cross_entropy
from .sum_squares import sum_of_squares
from .adamw import adamw_step
from .wgrad import wgrad_accum

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "backend_status",
    "default_backend",
    "reset",
    "rms_norm",
    "gated_rms_norm",
    "apply_rotary_pos_emb",
    "swiglu",
    "swiglu_packed",
    "grouped_matmul",
    "grouped_matmul_backward",
    "moe_experts",
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "causal_conv1d",
    "causal_conv1d_update",
    "chunk_gated_delta_rule_cp",
    "causal_conv1d_cp",
    "fused_linear_cross_entropy",
    "vocab_parallel_fused_linear_cross_entropy",
    "sum_of_squares",
    "adamw_step",
    "wgrad_accum",
]
