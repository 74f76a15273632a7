"""The ops whose autograd runs in C++ on the cpu backend (rms_norm, apply_rotary_pos_emb, swiglu).

Their values and gradients against the float64 reference, over shapes, layouts and dtypes, are
test_rowwise's. Here: what a C++ ``torch::autograd::Function`` changes about the graph itself:
the node is the C++ one, a retained graph runs twice, a saved input changed in place is caught,
no graph is built without grad, a double backward is refused instead of silently dropping this
op's part, and a build that predates the op says so.
"""
import pytest
import torch

import twinkle_kernels as tk
from twinkle_kernels import _cpu_ext
from twinkle_kernels.norm import rms_norm_reference
from twinkle_kernels.rope import apply_rotary_pos_emb_reference
from twinkle_kernels.swiglu import swiglu_reference
from twinkle_kernels.testing import assert_close

pytestmark = pytest.mark.skipif(_cpu_ext.unavailable_reason() is not None, reason="the C++ extension is not built")


def _rms(seed=0, shape=(3, 5, 24)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).requires_grad_()
    return (x, w), lambda x, w: tk.rms_norm(x, w, 1e-6, backend="cpu"), \
        lambda x, w: rms_norm_reference(x, w, 1e-6)


def _rope(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 7, 16, generator=g).requires_grad_()
    k = torch.randn(2, 2, 7, 16, generator=g).requires_grad_()
    ang = torch.randn(2, 7, 8, generator=g)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def fast(q, k):
        a, b = tk.apply_rotary_pos_emb(q, k, cos, sin, backend="cpu")
        return a.sum() + (b * b).sum()

    def ref(q, k):
        a, b = apply_rotary_pos_emb_reference(q, k, cos, sin)
        return a.sum() + (b * b).sum()
    return (q, k), fast, ref


def _swiglu(seed=0):
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(3, 9, 40, generator=g).requires_grad_()
    up = torch.randn(3, 9, 40, generator=g).requires_grad_()
    return (gate, up), lambda a, b: tk.swiglu(a, b, backend="cpu"), swiglu_reference


CASES = {"rms_norm": _rms, "rope": _rope, "swiglu": _swiglu}
NODE = {"rms_norm": "RMSNormFunction", "rope": "RotaryFunction", "swiglu": "SwiGLUFunction"}


def _loss(out):
    return out if out.dim() == 0 else (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum()


@pytest.mark.parametrize("name", CASES)
def test_the_graph_node_is_the_cpp_function(name):
    inputs, fast, _ = CASES[name]()
    out = fast(*inputs)
    node = out.grad_fn
    if name == "rope":  # the loss is a sum over both outputs: find the op's node below it
        seen, stack = set(), [node]
        while stack:
            n = stack.pop()
            if n is None or n in seen:
                continue
            seen.add(n)
            if NODE[name] in n.name():
                node = n
                break
            stack.extend(f for f, _ in n.next_functions)
    assert "CppNode" in node.name() and NODE[name] in node.name(), node.name()


@pytest.mark.parametrize("name", CASES)
def test_matches_the_float64_reference_and_a_retained_graph_runs_twice(name):
    inputs, fast, ref = CASES[name](seed=1)
    loss = _loss(fast(*inputs))
    loss.backward(retain_graph=True)
    first = [t.grad.clone() for t in inputs]
    loss.backward()
    for t, g in zip(inputs, first):
        torch.testing.assert_close(t.grad, 2 * g, rtol=0, atol=0)   # the same gradient, added again
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    _loss(ref(*ref_inputs)).backward()
    for g, r in zip(first, ref_inputs):
        assert_close(g, r.grad.float(), torch.float32)


@pytest.mark.parametrize("name", CASES)
def test_only_the_inputs_that_require_grad_get_one(name):
    inputs, fast, ref = CASES[name](seed=2)
    frozen = inputs[1].detach()
    _loss(fast(inputs[0], frozen)).backward()
    ref_x = inputs[0].detach().double().requires_grad_()
    _loss(ref(ref_x, frozen.double())).backward()
    assert frozen.grad is None
    assert_close(inputs[0].grad, ref_x.grad.float(), torch.float32)


# rope saves only cos / sin (the op is linear in q and k), so changing q or k afterwards is harmless
@pytest.mark.parametrize("name", ["rms_norm", "swiglu"])
def test_an_input_changed_in_place_after_the_forward_is_caught(name):
    inputs, fast, _ = CASES[name](seed=3)
    base = [t.detach().clone().requires_grad_() for t in inputs]
    views = [b * 1 for b in base]   # non-leaf copies, so they can be changed in place
    loss = _loss(fast(*views))
    views[0].add_(1.0)
    # torch's message depends on whether the saved tensor is the input or a view of it
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()


@pytest.mark.parametrize("name", CASES)
def test_no_graph_without_grad(name):
    inputs, fast, _ = CASES[name](seed=4)
    with torch.no_grad():
        out = fast(*inputs)
    assert out.grad_fn is None and not out.requires_grad


@pytest.mark.parametrize("name", CASES)
def test_a_double_backward_is_refused_not_silently_partial(name):
    inputs, fast, _ = CASES[name](seed=5)
    loss = _loss(fast(*inputs))
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(loss, inputs, create_graph=True)


def test_a_build_without_the_op_says_rebuild():
    with pytest.raises(RuntimeError, match=r"has no op 'no_such_op'.*rebuild"):
        _cpu_ext.op("no_such_op")


def test_poisoned_outputs_are_all_written(monkeypatch):
    """With poisoning on (conftest), a fresh output is NaN until the kernel writes it: every
    element of every output and gradient is finite after the ops, on a row count that does not
    divide the vector block."""
    from twinkle_kernels import _alloc
    assert _alloc.poisoning()
    for name, case in CASES.items():
        inputs, fast, _ = case(seed=6)
        out = fast(*inputs)
        assert torch.isfinite(out).all(), name
        _loss(out).backward()
        for t in inputs:
            assert torch.isfinite(t.grad).all(), name
