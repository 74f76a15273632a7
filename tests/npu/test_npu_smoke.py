"""NPU smoke tests: every row-wise op on a real Ascend NPU against the float64 reference.

They skip, saying why, wherever no NPU is present (every machine this project's CI has).
"""
import pytest
import torch

import twinkle_kernels as tk
from twinkle_kernels import npu, testing

_why = npu.unavailable_reason()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"no Ascend NPU here: {_why}")


def _cos(*shape):
    return torch.randn(*shape).clamp(-1, 1)  # npu_rotary_mul documents r1/r2 in [-1, 1]


# name -> (call(*inputs, backend), inputs, how many leading inputs get gradients)
CASES = {
    "rms_norm": (lambda x, w, backend: tk.rms_norm(x, w, backend=backend),
                 lambda: [torch.randn(16, 256), torch.randn(256)], 2),
    "rms_norm_offset": (lambda x, w, backend: tk.rms_norm(x, w, offset=1.0, backend=backend),
                        lambda: [torch.randn(16, 256), torch.randn(256) * 0.1], 2),
    "gated_rms_norm": (lambda x, g, w, backend: tk.gated_rms_norm(x, g, w, backend=backend),
                       lambda: [torch.randn(16, 256), torch.randn(16, 256), torch.randn(256)], 3),
    "rope": (lambda q, k, c, s, backend: tk.apply_rotary_pos_emb(q, k, c, s, backend=backend),
             lambda: [torch.randn(2, 4, 32, 128), torch.randn(2, 2, 32, 128), _cos(2, 32, 128), _cos(2, 32, 128)], 2),
    "rope_partial": (lambda q, k, c, s, backend: tk.apply_rotary_pos_emb(q, k, c, s, backend=backend),
                     lambda: [torch.randn(2, 4, 32, 128), torch.randn(2, 2, 32, 128), _cos(2, 32, 64),
                              _cos(2, 32, 64)], 2),
    "swiglu": (lambda g, u, backend: tk.swiglu(g, u, backend=backend),
               lambda: [torch.randn(16, 512), torch.randn(16, 512)], 2),
    "swiglu_packed": (lambda x, backend: tk.swiglu_packed(x, backend=backend), lambda: [torch.randn(16, 1024)], 1),
}


def _run(fn, inputs, n_grad, backend):
    xs = [t.detach().clone().requires_grad_(i < n_grad) for i, t in enumerate(inputs)]
    out = fn(*xs, backend=backend)
    outs = out if isinstance(out, tuple) else (out,)
    sum((o.double() * (i + 1)).sum() for i, o in enumerate(outs)).backward()
    return [o.detach().cpu() for o in outs], [x.grad.cpu() for x in xs[:n_grad]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_npu_op_matches_reference(case, dtype):
    fn, make, n_grad = CASES[case]
    inputs = make()
    outs, grads = _run(fn, [t.to("npu", dtype) for t in inputs], n_grad, "npu")
    routs, rgrads = _run(fn, [t.double() for t in inputs], n_grad, "reference")
    for o, r in zip(outs, routs):
        testing.assert_close(o, r, dtype)
    for g, r in zip(grads, rgrads):
        testing.assert_close(g, r, dtype, scale=4.0, name="grad")
