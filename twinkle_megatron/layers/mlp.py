"""The dense MLP and the MoE experts of megatron-core on twinkle_kernels, chosen in the layer spec.

:class:`TwinkleMLP` is megatron's ``MLP`` with the gated SiLU on ``tk.swiglu_packed``.

For the experts, megatron's ``GroupedMLP`` / ``TEGroupedMLP`` need the grouped_gemm package or
TransformerEngine (neither builds without CUDA), so the portable choice is ``SequentialMLP``: one
matmul pair per local expert in a Python loop. :class:`TwinkleGroupedMLP` keeps SequentialMLP's parameters
(``local_experts.<i>.linear_fc1/linear_fc2``: checkpoints, the facade's HF conversion and DDP see
no difference) and replaces the loop by two grouped matmuls over the tokens megatron's dispatcher
(alltoall, any EP size) already sorted by local expert::

    h = grouped_matmul(x, W1ᵀ, offsets)            # [M, 2I]  (packed [gate | up])
    y = grouped_matmul(swiglu_packed(h) * probs, W2ᵀ, offsets)

On the CPU the two grouped matmuls become one matmul per expert on its rows (the activation and
the probabilities still applied once over all rows): stacking the weights for a grouped matmul
copies every expert's weights in each forward, and its gradient comes back as one stacked
tensor, each a fresh allocation of the experts' size (Qwen3-30B-A3B's 128 experts: 1.2 GB per
layer, each way) whose page faults cost more than the products. Measured on the facade's
benchmark shape (128 experts, hidden 2048, 768, 4096 routed rows, bf16 forward and backward):
1.27-1.30 CPU s looped against 1.59-2.14 stacked, 0.13 M page faults against 0.39-0.49 M.

Expert tensor parallelism, biases, fp8/fp4, non-SwiGLU activations, probabilities applied on
the input and LoRA adapters on the experts fall through to SequentialMLP's own loop.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

import twinkle_kernels as tk


class _LinearIntoMainGrad(torch.autograd.Function):
    """``F.linear(x, w)`` whose weight gradient goes straight into ``w.main_grad``: megatron's
    gradient accumulation fusion, for the experts' per-expert products, through the function its
    own linear layers call with the flag on (``ddp.fuse_wgrad_accumulation``):
    ``tensor_parallel.layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32`` (on the CPU
    ``cpu_compat``'s, over ``twinkle_kernels.wgrad_accum``). ``w``'s returned gradient is megatron's
    dummy with ``grad_added_to_main_grad`` set (DDP's hook then adds nothing), zeros for a weight
    marked ``zero_out_wgrad``. An expert that got no rows still runs its backward, with an empty
    product."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, dy):
        from megatron.core.tensor_parallel import layers as tp_layers
        x, w = ctx.saved_tensors
        dx = dy @ w if ctx.needs_input_grad[0] else None
        tp_layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(
            x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1]), w.main_grad)
        if getattr(w, "zero_out_wgrad", False):
            return dx, torch.zeros_like(w)
        w.grad_added_to_main_grad = True
        return dx, torch.empty_like(w)


def _linear(x, w, fuse):
    """``F.linear(x, w)``, through :class:`_LinearIntoMainGrad` when ``fuse`` (the layer's
    ``gradient_accumulation_fusion``) and ``w`` is a trainable weight of x's dtype with an fp32 DDP
    ``main_grad`` under grad mode."""
    if (fuse and torch.is_grad_enabled() and w.requires_grad and w.dtype == x.dtype
            and getattr(w, "main_grad", None) is not None and w.main_grad.dtype == torch.float32):
        return _LinearIntoMainGrad.apply(x, w)
    return F.linear(x, w.to(x.dtype))


def _per_expert(x, sizes, probs, fc1, fc2, fuse=(False, False)):
    """The experts on the CPU (see the module docstring): ``x`` [M, H] rows sorted by expert,
    ``sizes[e]`` of them for expert e, ``probs`` [M] fp32; ``fc1[e]`` [2I, H] (packed [gate | up]),
    ``fc2[e]`` [H, I] -> [M, H] in ``x``'s dtype. ``fuse``: whether fc1's / fc2's weight gradients
    go straight into their ``main_grad`` (:func:`_linear`)."""
    h = torch.cat([_linear(xe, w, fuse[0]) for xe, w in zip(x.split(sizes), fc1)])
    # the expert MLP applies the routing probability after the activation (fp32 probs)
    h = (tk.swiglu_packed(h) * probs.unsqueeze(-1)).to(x.dtype)
    return torch.cat([_linear(he, w, fuse[1]) for he, w in zip(h.split(sizes), fc2)])


@functools.lru_cache(maxsize=None)
def grouped_mlp_class() -> type:
    from megatron.core.transformer.moe.experts import SequentialMLP

    class TwinkleGroupedMLP(SequentialMLP):
        """SequentialMLP whose local experts run as grouped matmuls (see the module docstring)."""

        def _fused_ok(self) -> bool:
            c = self.config
            return (c.gated_linear_unit and c.activation_func is F.silu and not c.add_bias_linear
                    and not c.fp8 and not getattr(c, "fp4", None)
                    and not c.moe_apply_probs_on_input
                    and (c.expert_tensor_parallel_size or 1) == 1
                    and getattr(c, "activation_func_clamp_value", None) is None
                    and not getattr(c, "glu_linear_offset", 0.0)
                    # LoRA on the experts runs from hooks on their linears: the loop calls them
                    and getattr(self.local_experts[0].linear_fc1, "lora", None) is None
                    and getattr(self.local_experts[0].linear_fc2, "lora", None) is None)

        def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
            if not self._fused_ok():
                return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
            x = permuted_local_hidden_states
            counts = torch.as_tensor(tokens_per_expert, device=x.device)
            if counts.numel() != self.num_local_experts:
                raise ValueError(f"tokens_per_expert has {counts.numel()} entries for "
                                 f"{self.num_local_experts} local experts")
            if x.device.type == "cpu":
                first = self.local_experts[0]
                return _per_expert(x, counts.tolist(), permuted_probs,
                                   [e.linear_fc1.weight for e in self.local_experts],
                                   [e.linear_fc2.weight for e in self.local_experts],
                                   (getattr(first.linear_fc1, "gradient_accumulation_fusion", False),
                                    getattr(first.linear_fc2, "gradient_accumulation_fusion", False))), None
            offsets = torch.cumsum(counts, 0).to(torch.int32)
            # [E, out, in] -> [E, in, out] views: grouped_matmul takes any strides.
            w1 = torch.stack([e.linear_fc1.weight for e in self.local_experts]).transpose(1, 2)
            w2 = torch.stack([e.linear_fc2.weight for e in self.local_experts]).transpose(1, 2)
            h = tk.swiglu_packed(tk.grouped_matmul(x, w1.to(x.dtype), offsets))
            # The expert MLP applies the routing probability after the activation (fp32 probs).
            h = (h * permuted_probs.unsqueeze(-1)).to(x.dtype)
            return tk.grouped_matmul(h, w2.to(x.dtype), offsets), None

    return TwinkleGroupedMLP


@functools.lru_cache(maxsize=None)
def mlp_class() -> type:
    from megatron.core.transformer.mlp import MLP

    class TwinkleMLP(MLP):
        """megatron's MLP with the gated SiLU on ``tk.swiglu_packed`` (fc1 emits ``[gate | up]``,
        each half TP-sharded: megatron's packed layout)."""

        def forward(self, hidden_states, per_token_scale=None, **kwargs):
            c = self.config
            if not (c.gated_linear_unit and c.activation_func is F.silu and not c.add_bias_linear
                    and per_token_scale is None and not c.use_te_activation_func
                    and getattr(c, "activation_func_clamp_value", None) is None
                    and not getattr(c, "glu_linear_offset", 0.0)):
                return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
            h, _ = self.linear_fc1(hidden_states)
            return self.linear_fc2(tk.swiglu_packed(h))

    return TwinkleMLP
