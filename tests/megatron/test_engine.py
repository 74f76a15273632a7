"""The training engine under the facade (twinkle_megatron/training/engine.py): what it holds, the
config objects the constructor's flat keywords fill, and the one schedule path (a single-adapter
call is a call with one group; mixed batches: tests/megatron/test_multi_lora.py)."""
import ast
import os

import pytest
import torch

pytest.importorskip("megatron.core")

from conftest import ROOT  # noqa: E402


def _config():
    from twinkle_megatron.job.configs import tiny_qwen3_config
    return tiny_qwen3_config(num_layers=2)


def test_config_objects_equal_the_flat_keywords(tm):
    from twinkle_megatron import PrecisionConfig, RecomputeConfig
    from twinkle_megatron.parallel.ddp import OverlapOptions
    flat = tm.MegatronModel(model_id=_config(), mixed_precision="fp32", recompute_granularity="full",
                            recompute_method="uniform", recompute_num_layers=1, overlap_grad_reduce=True,
                            bucket_size=1000)
    objs = tm.MegatronModel(model_id=_config(), precision=PrecisionConfig("fp32"),
                            recompute=RecomputeConfig("full", "uniform", 1),
                            overlap=OverlapOptions(overlap_grad_reduce=True, bucket_size=1000))
    for m in (flat, objs):
        assert m.dtype == torch.float32 and m.mixed_precision == "fp32"
        assert (m.config.recompute_granularity, m.config.recompute_method, m.config.recompute_num_layers) == \
            ("full", "uniform", 1)
        assert m.overlap == OverlapOptions(True, False, 1000) == m.engine.overlap
        assert m.engine.config is m.config and m.engine.chunks is m.unwrapped_chunks()
    # the same checks run on the objects' values
    with pytest.raises(ValueError, match="recompute_method"):
        tm.MegatronModel(model_id=_config(), recompute=RecomputeConfig("full", "sideways", 1))
    with pytest.raises(ValueError, match="mixed_precision must be one of"):
        PrecisionConfig("fp8")


@pytest.mark.parametrize("kwargs, match", [
    ({"precision": "fp32"}, "precision must be a PrecisionConfig"),
    ({"recompute": {"granularity": "full"}}, "recompute must be a RecomputeConfig"),
    ({"mixed_precision": "fp32", "precision": "PC"}, r"give precision= or \['mixed_precision'\], not both"),
    ({"recompute_granularity": "full", "recompute": "RC"}, r"give recompute= or \['recompute_granularity'\]"),
    ({"bucket_size": 10, "overlap_grad_reduce": True, "overlap": "OO"},
     r"give overlap= or \['bucket_size', 'overlap_grad_reduce'\], not both"),
])
def test_config_objects_or_flat_keywords_not_both(kwargs, match):
    import twinkle_megatron as tm
    from twinkle_megatron import PrecisionConfig, RecomputeConfig
    from twinkle_megatron.parallel.ddp import OverlapOptions
    real = {"PC": PrecisionConfig(), "RC": RecomputeConfig(), "OO": OverlapOptions()}
    kwargs = {k: real.get(v, v) if isinstance(v, str) and k in ("precision", "recompute", "overlap") else v
              for k, v in kwargs.items()}
    with pytest.raises(TypeError, match=match):   # checked before any process group is needed
        tm.MegatronModel(model_id=_config(), device_mesh=tm.DeviceMesh.from_sizes(world_size=1), **kwargs)


@pytest.mark.parametrize("fused", [False, True])
def test_lm_head_path_is_fixed_when_built(tm, fused):
    """The spec provider decides the LM-head path once, per chunk: the fused linear CE reads the
    output layer's weight shard; off, the chunk returns logits."""
    m = tm.MegatronModel(model_id=_config(), mixed_precision="fp32", fused_linear_ce=fused)
    (head,) = m.engine.heads
    (chunk,) = m.unwrapped_chunks()
    if not fused:
        assert head is None
        return
    weight = chunk.shared_embedding_or_output_weight() if chunk.share_embeddings_and_output_weights \
        else chunk.output_layer.weight
    assert head.weight is weight


def test_train_state_is_the_engines(tm):
    """Per-adapter state lives in the engine; the facade's attributes read the resolved state."""
    m = tm.MegatronModel(model_id=_config(), mixed_precision="fp32")
    m.add_adapter_to_model("a", {"r": 4, "target_modules": "all-linear"})
    m.add_adapter_to_model("b", {"r": 2, "target_modules": ["q_proj"]})
    for name in ("a", "b"):
        m.set_optimizer("AdamW", lr=1e-3, adapter_name=name)
    assert set(m.engine.states) == {None, "a", "b"}
    assert m.train_state("a") is m.engine.states["a"] and m.train_state("a").optimizer is not None
    with pytest.raises(ValueError, match="adapter_name is required"):
        m.train_state()
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    m.forward_backward(inputs={"input_ids": ids, "labels": ids}, adapter_name="b")
    assert m.engine.states["b"].has_grads and not m.engine.states["a"].has_grads
    assert m.engine.states["b"].pending_tokens == 2 * 7       # its loss count, finalised at its step
    assert m.clip_grad_and_step(adapter_name="b") > 0
    assert m.engine.states["b"].cur_step == 1 and m.engine.states["a"].cur_step == 0
    m.remove_adapter("b")
    assert set(m.engine.states) == {None, "a"}


def _functions(path, name):
    tree = ast.parse(open(path).read())
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]


def test_one_forward_step_in_the_package():
    """Single-adapter calls, mixed batches and forward_only run one schedule path. The one other
    forward step is upstream's ``task='embedding'`` (training/embedding.py): sentence rows pooled
    to one vector each, no per-token outputs, under the same transaction guard."""
    found = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "twinkle_megatron")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                found += [os.path.relpath(path, ROOT)] * len(_functions(path, "forward_step"))
    assert sorted(found) == ["twinkle_megatron/training/embedding.py", "twinkle_megatron/training/schedule.py"], found


@pytest.mark.parametrize("spec", [False, True], ids=["local", "twinkle"])
def test_forward_only_runs_without_dropout(tm, spec):
    """forward_only (reference and old log-probs, evaluation) runs the model in eval mode, as
    megatron's own evaluation does: with LoRA dropout 0.5 two calls give the same log-probs, equal
    to the same adapter at dropout 0, and draw nothing from torch's generator; training calls keep
    their dropout (the modules are back in train mode)."""
    from peft import LoraConfig
    from twinkle_megatron.job.configs import tiny_qwen3_config
    cfg = tiny_qwen3_config(num_layers=1)
    ids = torch.randint(0, cfg["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    got = {}
    for p in (0.5, 0.0):
        m = tm.MegatronModel(cfg, mixed_precision="fp32", seed=5, use_twinkle_kernels=spec)
        m.add_adapter_to_model("a", LoraConfig(r=4, lora_alpha=8, lora_dropout=p, target_modules="all-linear",
                                               init_lora_weights=False))
        m.set_optimizer("AdamW", lr=1e-2)
        rng = torch.get_rng_state()
        got[p] = [m.forward_only(inputs=batch)["logps"] for _ in range(2)]
        assert torch.equal(torch.get_rng_state(), rng), "forward_only drew random numbers"
        assert all(c.training for c in m.unwrapped_chunks())
        if p:
            a, b = (m.forward_backward(inputs=batch)["loss"] for _ in range(2))
            assert a != b, "training calls keep the adapter's dropout"
    assert torch.equal(got[0.5][0], got[0.5][1])
    assert torch.equal(got[0.5][0], got[0.0][0])
