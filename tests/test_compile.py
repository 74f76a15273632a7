"""torch.compile over the twinkle ops and patched models.

The public row-wise ops are ``torch.library`` custom ops under compile (``twinkle_kernels._library``):
opcheck judges their schemas, fake implementations and autograd registrations; compiled calls must
equal eager ones; a patched model compiles with ``fullgraph=True`` (no graph break) and its
forward and backward equal eager. Compiling is slow on a loaded 2-core machine: tiny shapes, few tests.
"""
from __future__ import annotations

import pytest
import torch

import twinkle_kernels as tk
import twinkle_patches as tp
from twinkle_kernels import _library, testing

from test_patches_models import batch, build


@pytest.fixture(autouse=True)
def _dynamo_enabled(monkeypatch):
    """torch.compile must really trace here: a TORCHDYNAMO_DISABLE left in the environment (the
    Megatron CPU mode sets it for its processes) would make every compiled call plain eager."""
    import torch._dynamo
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    with torch._dynamo.config.patch(disable=False):
        yield

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.timeout(900)]

BACKENDS = ("reference", "cpu")


def _samples(backend):
    g = torch.Generator().manual_seed(0)

    def r(*s, grad=True):
        return torch.randn(*s, generator=g).requires_grad_(grad)
    x = r(3, 5, 24)
    yield "rms_norm", (x, r(24), 1e-6, 0.0, backend)
    yield "rms_norm", (r(24, 7).t(), r(24), 1e-5, 1.0, backend)  # non-contiguous rows
    yield "gated_rms_norm", (x, r(3, 5, 24), r(24), 1e-6, backend)
    yield "swiglu", (r(4, 33), r(4, 33), backend)
    yield "swiglu_packed", (r(2, 3, 34), backend)
    cos, sin = torch.randn(2, 6, 8, generator=g), torch.randn(2, 6, 8, generator=g)
    yield "apply_rotary_pos_emb", (r(2, 4, 6, 16), r(2, 2, 6, 16), cos, sin, 1, backend)  # partial rotary


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck_every_op(backend):
    if backend == "cpu" and tk._dispatch.backend_status("cpu") is not None:
        pytest.skip("the C++ extension is not built")
    seen = set()
    for name, args in _samples(backend):
        torch.library.opcheck(getattr(torch.ops.twinkle, name).default, args)
        seen.add(name)
    assert seen == set(_library.OPS)


def test_compiled_op_equals_eager():
    torch._dynamo.reset()
    x = torch.randn(4, 9, 40, requires_grad=True)
    w = torch.randn(40, requires_grad=True)
    g = torch.randn(4, 9, 40, requires_grad=True)

    def f(x, w, g):
        y = tk.rms_norm(x, w, 1e-6)
        return tk.swiglu(tk.gated_rms_norm(y, g, w), y)

    want = f(x, w, g)
    want_grads = torch.autograd.grad(want.square().sum(), (x, w, g))
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, w, g)
    got_grads = torch.autograd.grad(got.square().sum(), (x, w, g))
    atol, rtol = testing.tolerance(torch.float32)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def _fwd_bwd(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    logits.float().square().mean().backward()
    return logits.detach(), {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()
                             if p.grad is not None}


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_patched_model_compiles_fullgraph(family):
    """fullgraph=True raises on any graph break; the compiled step equals the eager patched step."""
    torch._dynamo.reset()
    model = build(family)
    # the packing-aware attention decides per batch from position_ids whether samples are packed
    # (a data-dependent branch dynamo cannot trace), and moe_experts / the GDN ops are not custom
    # ops yet: qwen3_moe's experts stay on transformers' grouped_mm here
    report = tp.apply(model, ops=("norm", "rope", "swiglu"))
    assert any(s.spec.op == "rms_norm" for s in report.swapped), report
    ids = batch(t=7)
    want = _fwd_bwd(model, ids)
    from torch._dynamo.utils import counters
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got = _fwd_bwd(compiled, ids)
    assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
    atol, rtol = testing.tolerance(torch.float32)
    torch.testing.assert_close(got[0], want[0], atol=atol, rtol=rtol)
    assert got[1].keys() == want[1].keys()
    for n in want[1]:
        torch.testing.assert_close(got[1][n], want[1][n], atol=atol * 10, rtol=rtol * 10, msg=lambda m: f"{n}: {m}")
    tp.revert()


def test_static_cache_generation_does_not_recompile(monkeypatch):
    """transformers compiles the decoding step for a static cache; a shorter prompt reuses the graph
    (error_on_recompile), and the tokens equal unpatched greedy generation."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig
    torch._dynamo.reset()
    counters.clear()
    model = build("llama").eval()
    with torch.no_grad():
        want = [model.generate(batch(t=t)[:1], max_new_tokens=4, min_new_tokens=4, do_sample=False) for t in (6, 4)]
    tp.apply(model, ops=("norm", "rope", "swiglu"))
    cc = CompileConfig(fullgraph=True, backend="aot_eager", dynamic=False)
    cc._compile_all_devices = True  # transformers compiles on accelerators only unless told
    got = []
    with torch.no_grad():
        for i, t in enumerate((6, 4)):
            if i:
                monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
            got.append(model.generate(batch(t=t)[:1], max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                      cache_implementation="static", compile_config=cc))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    tp.revert()
