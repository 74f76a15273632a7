"""A small pure-torch EMULATION of the torch_npu operators twinkle calls, written from their
documented semantics (Ascend torch_npu API reference). It lets CPU tests check how twinkle
marshals arguments (layouts, eps, which tensor goes where). It is test-only: it lives under
tests/ and is never importable from the package. It says nothing about real NPU numerics.
"""
import torch
import torch.nn.functional as F


class EmulatedTorchNpu:
    calls = []

    def npu_rms_norm(self, x, gamma, epsilon=1e-6):
        self.calls.append(("npu_rms_norm", x.shape, gamma.shape, x.dtype, gamma.dtype, epsilon))
        if gamma.shape != x.shape[x.dim() - gamma.dim():]:
            raise RuntimeError(f"gamma shape {tuple(gamma.shape)} must match the trailing dims of x {tuple(x.shape)}")
        dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + epsilon)
        return (xf * rstd * gamma.float()).to(x.dtype), rstd

    def npu_rotary_mul(self, x, r1, r2, rotary_mode="half"):
        self.calls.append(("npu_rotary_mul", x.shape, r1.shape, x.dtype, r1.dtype, rotary_mode))
        if x.dim() != 4 or r1.dim() != 4 or r2.dim() != 4:
            raise RuntimeError("npu_rotary_mul: x, r1 and r2 must be 4-D")
        if r1.dtype != x.dtype or r2.dtype != x.dtype:
            raise RuntimeError("npu_rotary_mul: r1/r2 dtype must equal x's")
        if x.shape[-1] % 2 or r1.shape[-1] != x.shape[-1]:
            raise RuntimeError("npu_rotary_mul: D must be even and equal in x and r1")
        torch.broadcast_shapes(x.shape, r1.shape)
        x1, x2 = torch.chunk(x, 2, -1)
        return (r1 * x + r2 * torch.cat((-x2, x1), dim=-1)).to(x.dtype)

    def npu_swiglu(self, x, dim=-1):
        self.calls.append(("npu_swiglu", x.shape, x.dtype, dim))
        if not x.is_contiguous():
            raise RuntimeError("npu_swiglu: non-contiguous input is not supported")
        if x.numel() == 0:
            raise RuntimeError("npu_swiglu: empty input is not supported")
        a, b = torch.chunk(x, 2, dim)
        return (F.silu(a.float()) * b.float()).to(x.dtype)

    # -- MoE ------------------------------------------------------------------------------------
    def npu_grouped_matmul(self, x, weight, *, bias=None, group_list=None, split_item=0, group_type=-1,
                           group_list_type=0, **unused):
        """The "single x, single y, E weights" form: x=[x [M, K]], weight=E x [K, N], M split by group_list.

        torch_npu registers no autograd for this call: the emulated result is detached, so a
        gradient can only come from twinkle's own backward."""
        self.calls.append(("npu_grouped_matmul", len(x), len(weight), tuple(weight[0].shape), group_list.dtype,
                           split_item, group_type, group_list_type, sorted(unused)))
        if len(x) != 1 or x[0].dim() != 2:
            raise RuntimeError("emulated npu_grouped_matmul: only the single 2-D x form is emulated")
        if split_item not in (2, 3) or group_type != 0:
            raise RuntimeError("emulated npu_grouped_matmul: split_item must be 2/3 and group_type 0 (split M)")
        if len(weight) > 128 or any(w.dim() != 2 for w in weight):
            raise RuntimeError("npu_grouped_matmul: at most 128 weights, each 2-D [K, N]")
        if not isinstance(group_list, torch.Tensor) or group_list.dtype != torch.int64:
            raise RuntimeError("npu_grouped_matmul: group_list must be an int64 tensor")
        if group_list.numel() != len(weight):
            raise RuntimeError("npu_grouped_matmul: one group_list entry per weight")
        ends = group_list.tolist() if group_list_type == 0 else torch.cumsum(group_list, 0).tolist()
        xx = x[0]
        if ends and ends[-1] != xx.shape[0]:
            raise RuntimeError("npu_grouped_matmul: the groups must cover the rows of x")
        for w in weight:
            if w.dtype != xx.dtype or w.shape[0] != xx.shape[1]:
                raise RuntimeError("npu_grouped_matmul: weight must be [K, N] in x's dtype")
        y = torch.zeros(xx.shape[0], weight[0].shape[1], dtype=xx.dtype)
        start = 0
        with torch.no_grad():
            for e, end in enumerate(ends):
                y[start:end] = (xx[start:end].float() @ weight[e].float()).to(xx.dtype)
                start = end
        return [y]

    def npu_moe_token_permute(self, tokens, indices, num_out_tokens=None, padded_mode=False):
        """-> (permuted [T*k, H], sorted_indices int32 [T*k]), as aclnnMoeTokenPermute documents
        (padded_mode False): first = argsort(flatten(indices)); sorted_indices = argsort(first), i.e.
        the permuted row of pair s = t*k + j; permuted[sorted_indices[s]] = tokens[s // k]. Rows come
        grouped by ascending expert id. Differentiable (torch_npu registers a backward)."""
        self.calls.append(("npu_moe_token_permute", tokens.shape, indices.dtype, padded_mode))
        if indices.dtype not in (torch.int32, torch.int64) or indices.dim() != 2:
            raise RuntimeError("npu_moe_token_permute: indices must be int32/int64 [T, k]")
        if padded_mode:
            raise RuntimeError("npu_moe_token_permute: padded_mode=True is not supported")
        first = torch.argsort(indices.reshape(-1), stable=True)
        sorted_indices = torch.argsort(first)
        return tokens.index_select(0, first // indices.shape[1]), sorted_indices.to(torch.int32)

    def npu_moe_token_unpermute(self, permuted_tokens, sorted_indices, probs=None, padded_mode=False,
                                restore_shape=None):
        """out[t] = sum_j probs[t, j] * permuted_tokens[sorted_indices[t*k + j]]."""
        self.calls.append(("npu_moe_token_unpermute", permuted_tokens.shape, sorted_indices.dtype,
                           None if probs is None else probs.dtype))
        if probs is not None and probs.dtype != permuted_tokens.dtype:
            raise RuntimeError("npu_moe_token_unpermute: probs must have the tokens' dtype")
        k = probs.shape[1] if probs is not None else 1
        g = permuted_tokens.index_select(0, sorted_indices.long()).view(-1, k, permuted_tokens.shape[1])
        if probs is None:
            return g.sum(1)
        return (g.float() * probs.float().unsqueeze(-1)).sum(1).to(permuted_tokens.dtype)

    # -- attention ------------------------------------------------------------------------------
    def npu_fusion_attention(self, query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                             atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=2147483647,
                             next_tockens=2147483647, inner_precise=0, prefix=None, actual_seq_qlen=None,
                             actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False):
        """BNSD only; atten_mask bool with True = masked out; sparse_mode 0 (mask as given),
        2 (left-up causal) or 3 (right-down causal), both needing the 2048 x 2048 compressed mask."""
        self.calls.append(("npu_fusion_attention", query.shape, key.shape, head_num, input_layout, scale,
                           keep_prob, sparse_mode, None if atten_mask is None else atten_mask.dtype))
        if input_layout != "BNSD":
            raise RuntimeError("emulated npu_fusion_attention: only BNSD is emulated")
        B, N, S, D = query.shape
        Nkv, Skv = key.shape[1], key.shape[2]
        if head_num != N or N % Nkv:
            raise RuntimeError("npu_fusion_attention: head_num must be the query heads, a multiple of kv heads")
        if keep_prob != 1.0:
            raise RuntimeError("emulated npu_fusion_attention: dropout is not emulated")
        if atten_mask is not None and atten_mask.dtype != torch.bool:
            raise RuntimeError("npu_fusion_attention: atten_mask must be bool (True = masked)")
        i = torch.arange(S)[:, None]
        j = torch.arange(Skv)[None, :]
        if sparse_mode in (2, 3):
            if atten_mask is None or tuple(atten_mask.shape) != (2048, 2048):
                raise RuntimeError("npu_fusion_attention: sparse_mode 2/3 need the 2048 x 2048 compressed mask")
            masked = j > i if sparse_mode == 2 else j > i + (Skv - S)
        elif sparse_mode == 0:
            masked = atten_mask if atten_mask is not None else torch.zeros(S, Skv, dtype=torch.bool)
        else:
            raise RuntimeError(f"emulated npu_fusion_attention: sparse_mode {sparse_mode} is not emulated")
        rep = N // Nkv
        k = key.repeat_interleave(rep, 1).float()
        v = value.repeat_interleave(rep, 1).float()
        s = (query.float() @ k.transpose(-1, -2)) * scale
        s = s.masked_fill(masked, float("-inf"))
        p = torch.softmax(s, -1)
        out = (p @ v).to(query.dtype)
        smax = s.amax(-1, keepdim=True)
        return out, smax, p.sum(-1, keepdim=True), torch.empty(0), 0, 0, 0
