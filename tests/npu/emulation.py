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
