"""The packing-aware attention (``attn_implementation="twinkle_packed"``) under torch.compile, and
the attention weights it returns when they are asked for.

Compiled: a patched model with every op of a dense family (norms, RoPE, SwiGLU, the packed
attention) compiles with ``fullgraph=True`` (aot_eager); one graph serves a packed batch (positions
restarting) and an unpacked one of the same shape with no recompile (``error_on_recompile``); the
compiled forward and backward equal eager, the packed samples equal the samples run alone, and the
unpacked logits equal unpatched transformers'; static-cache generation does not recompile. Weights: ``output_attentions=True`` gives what
unpatched ``eager`` gives. Compiling is slow on a loaded 2-core machine: tiny models, few graphs.
"""
from __future__ import annotations

import pytest
import torch

import twinkle_patches as tp
from twinkle_kernels import testing

from test_patches_models import VOCAB, batch, build

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.timeout(600)]

OPS = ("norm", "rope", "swiglu", "packed_attention")
LENGTHS = [3, 4]  # two samples packed into each row of a [2, 7] batch


@pytest.fixture(autouse=True)
def _clean():
    tp.revert()
    yield
    tp.revert()


@pytest.fixture
def dynamo(monkeypatch):
    """Dynamo really traces (a TORCHDYNAMO_DISABLE left by the Megatron CPU mode would make every
    compiled call eager) and starts from an empty cache and counters."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    with torch._dynamo.config.patch(disable=False):
        torch._dynamo.reset()
        counters.clear()
        yield counters
        torch._dynamo.reset()


def _packed_positions(b=2):
    return torch.cat([torch.arange(n) for n in LENGTHS])[None].expand(b, -1).contiguous()


def _step(model, ids, **kw):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, **kw).logits
    probe = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5))
    (logits.float() * probe).sum().backward()
    return logits.detach(), {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()
                             if p.grad is not None}


def _assert_step_close(got, want, scale=10.0):
    atol, rtol = testing.tolerance(torch.float32)
    torch.testing.assert_close(got[0], want[0], atol=atol * scale, rtol=rtol * scale)
    assert got[1].keys() == want[1].keys() and want[1]
    for n in want[1]:
        s = scale * max(1.0, float(want[1][n].abs().max()))
        torch.testing.assert_close(got[1][n], want[1][n], atol=atol * s, rtol=rtol * scale, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fullgraph_compile_packed_and_unpacked_batches_share_one_graph(family, dynamo):
    model = build(family)
    ids = batch(t=sum(LENGTHS))
    packed_pos, plain_pos = _packed_positions(), torch.arange(sum(LENGTHS))[None].expand(2, -1).contiguous()
    with torch.no_grad():
        unpatched = model(input_ids=ids, position_ids=plain_pos).logits
        cu = [0] + torch.tensor(LENGTHS).cumsum(0).tolist()
        alone = torch.cat([model(input_ids=ids[:, a:b]).logits for a, b in zip(cu[:-1], cu[1:])], dim=1)
    report = tp.apply(model, ops=OPS)
    assert model.config._attn_implementation == "eager", report  # kept; its eager is packing-aware
    want_packed = _step(model, ids, position_ids=packed_pos)
    want_plain = _step(model, ids, position_ids=plain_pos)

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got_packed = _step(compiled, ids, position_ids=packed_pos)
    graphs = dynamo["stats"]["unique_graphs"]
    assert graphs >= 1, "nothing was compiled"
    with torch._dynamo.config.patch(error_on_recompile=True):
        got_plain = _step(compiled, ids, position_ids=plain_pos)  # same shapes, positions not restarting
        got_packed_again = _step(compiled, ids, position_ids=packed_pos)
    assert dynamo["stats"]["unique_graphs"] == graphs, dict(dynamo["stats"])

    _assert_step_close(got_packed, want_packed)
    _assert_step_close(got_plain, want_plain)
    _assert_step_close(got_packed_again, want_packed)
    atol, rtol = testing.tolerance(torch.float32)
    # the packed samples stay apart under compile, and the unpacked batch is transformers' result
    torch.testing.assert_close(got_packed[0], alone, atol=atol * 10, rtol=rtol * 10)
    torch.testing.assert_close(got_plain[0], unpatched, atol=atol * 10, rtol=rtol * 10)
    assert float((got_packed[0] - got_plain[0]).abs().max()) > 1e-2  # the two batches really differ


def test_fullgraph_compile_flash_style_packing(dynamo):
    """``cu_seq_lens_q`` (DataCollatorWithFlattening's kwargs) tell the attention statically that the
    batch is packed; the check that they cover the batch is an op in the graph."""
    model = build("qwen3")
    ids = batch(t=sum(LENGTHS))[:1]
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), dtype=torch.int32)
    kw = dict(position_ids=_packed_positions(1), cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENGTHS),
              max_length_k=max(LENGTHS))
    tp.apply(model, ops=OPS)
    want = _step(model, ids, **kw)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    _assert_step_close(_step(compiled, ids, **kw), want)
    bad = torch.tensor([0, 3, 6], dtype=torch.int32)  # ends before the 7 packed tokens
    with torch.no_grad(), pytest.raises(RuntimeError, match="cu_seq_lens_q"):
        compiled(input_ids=ids, **dict(kw, cu_seq_lens_q=bad, cu_seq_lens_k=bad))
    with torch.no_grad(), pytest.raises(ValueError, match="cu_seq_lens_q"):
        model(input_ids=ids, **dict(kw, cu_seq_lens_q=bad, cu_seq_lens_k=bad))


# -- attention weights ---------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("padded", [False, True], ids=["full", "left-padded"])
def test_output_attentions_equal_unpatched_eager(family, padded):
    """An eager model, patched, returns the weights (and logits) that unpatched eager returns, bit for
    bit, with and without output_attentions: it stays eager, and an unpacked call runs the model's own
    eager_attention_forward with transformers' mask."""
    model = build(family).eval()
    ids = batch(t=7)
    kw = dict(input_ids=ids, output_attentions=True)
    if padded:
        mask = torch.ones(2, 7, dtype=torch.long)
        mask[0, :3] = 0
        kw["attention_mask"] = mask
    with torch.no_grad():
        want = model(**kw)
        tp.apply(model, ops=("packed_attention",))
        assert model.config._attn_implementation == "eager"
        got = model(**kw)
        no_weights = model(**{k: v for k, v in kw.items() if k != "output_attentions"})
    assert len(got.attentions) == len(want.attentions) == 2
    for g, w in zip(got.attentions, want.attentions):
        assert g is not None and g.shape == (2, 4, 7, 7)
        assert torch.equal(g, w)
    assert torch.equal(got.logits, want.logits)
    assert torch.equal(no_weights.logits, want.logits) and no_weights.attentions is None


def test_output_attentions_of_packed_batch_are_the_samples_alone():
    """Packed: each sample's weights are its own block (zero across samples) and equal the weights
    of the sample run alone; the logits too."""
    model = build("qwen3").eval()
    ids = batch(t=sum(LENGTHS))[:1]
    cu = [0] + torch.tensor(LENGTHS).cumsum(0).tolist()
    tp.apply(model, ops=("packed_attention",))
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=_packed_positions(1), output_attentions=True)
        alone = [model(input_ids=ids[:, a:b], output_attentions=True) for a, b in zip(cu[:-1], cu[1:])]
    atol, rtol = testing.tolerance(torch.float32)
    torch.testing.assert_close(got.logits, torch.cat([o.logits for o in alone], 1), atol=atol * 10, rtol=rtol * 10)
    assert len(got.attentions) == 2 and all(w is not None for w in got.attentions)
    for layer, w in enumerate(got.attentions):
        expected = torch.zeros_like(w)
        for (a, b), o in zip(zip(cu[:-1], cu[1:]), alone):
            expected[..., a:b, a:b] = o.attentions[layer]
        torch.testing.assert_close(w, expected, atol=atol * 10, rtol=rtol * 10)


def test_output_attentions_on_a_model_built_with_twinkle_packed():
    """A model that asks for twinkle_packed by name (sdpa underneath) still returns weights when
    they are asked for: those of transformers' eager attention."""
    from transformers import AutoModelForCausalLM
    from test_patches_models import _cfg
    tp.apply(families=["qwen3"], ops=("packed_attention",))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_cfg("qwen3"), attn_implementation="twinkle_packed").eval()
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = model(input_ids=ids, output_attentions=True)
        model.set_attn_implementation("eager")
        want = model(input_ids=ids, output_attentions=True)
    assert len(got.attentions) == len(want.attentions) == 2
    for g, w in zip(got.attentions, want.attentions):
        assert torch.equal(g, w)
    assert torch.equal(got.logits, want.logits)


def test_static_cache_generation_with_packed_attention_does_not_recompile(dynamo):
    """transformers' compiled decode step with a static cache, the packing-aware attention patched
    with the row-wise ops: keys (the cache) are longer than the queries, so the attention takes the
    plain path without reading values; a shorter prompt reuses the graph and tokens equal unpatched."""
    from transformers import CompileConfig
    model = build("llama").eval()
    prompts = [batch(t=t)[:1] for t in (6, 4)]
    with torch.no_grad():
        want = [model.generate(p, max_new_tokens=4, min_new_tokens=4, do_sample=False) for p in prompts]
    tp.apply(model, ops=OPS)
    assert model.config._attn_implementation == "eager"
    cc = CompileConfig(fullgraph=True, backend="aot_eager", dynamic=False)
    cc._compile_all_devices = True  # transformers compiles on accelerators only unless told
    got = []
    with torch.no_grad():
        for p, strict in zip(prompts, (False, True)):
            with torch._dynamo.config.patch(error_on_recompile=strict):
                got.append(model.generate(p, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                          cache_implementation="static", compile_config=cc))
    assert dynamo["stats"]["unique_graphs"] == 1, dict(dynamo["stats"])
    for g, w in zip(got, want):
        assert torch.equal(g, w)
