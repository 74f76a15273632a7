"""What the facade's docstrings say is raised, is raised.

Every public object of ``twinkle_megatron`` (its ``__all__`` and their public methods) is read for
the exception classes its docstring names. Each (object, exception) pair must have an entry in
:data:`CLAIMS`: a call here that raises it (on one process, a tiny Qwen3), or the multi-process test
that makes it happen. A docstring that names a new error without an entry, or an entry whose call no
longer raises, fails: the docstrings cannot drift from the code.
"""
import builtins
import importlib
import inspect
import math
import os
import re

import pytest
import torch

pytest.importorskip("megatron.core")

from conftest import ROOT, megatron_one_rank  # noqa: E402

_ERROR = re.compile(r"\b([A-Z][A-Za-z]*(?:Error|Exception))\b")
VOCAB = 256


def documented_raises():
    """``{(qualname, exception name)}`` named in the docstrings of ``twinkle_megatron``'s public API."""
    tm = importlib.import_module("twinkle_megatron")
    out = set()
    for name in tm.__all__:
        obj = getattr(tm, name)
        items = [(name, obj)]
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            for attr, value in vars(obj).items():
                if attr.startswith("_"):
                    continue
                fn = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
                fn = fn.fget if isinstance(fn, property) else fn
                if inspect.isfunction(fn):
                    items.append((f"{name}.{attr}", fn))
        elif inspect.isclass(obj):
            continue   # an exception class's own docstring describes it, it does not claim a raise
        for qualname, o in items:
            for err in _ERROR.findall(inspect.getdoc(o) or ""):
                out.add((qualname, err))
    return out


# ---- the calls that make each documented error happen -------------------------------------------

def _tiny(tm):
    from twinkle_megatron.job.configs import tiny_qwen3_config
    m = tm.MegatronModel(model_id=tiny_qwen3_config(num_layers=1), mixed_precision="fp32", seed=3)
    m.set_optimizer("AdamW", lr=1e-3)
    m.set_loss("cross_entropy")
    return m


def _batch(seed=0):
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _mesh_sizes(tm, env):
    tm.DeviceMesh.from_sizes(tp_size=0)


def _mesh_check(tm, env):
    tm.DeviceMesh.from_sizes(world_size=2, tp_size=2).check_model(num_attention_heads=3, num_key_value_heads=1,
                                                                  num_layers=2)


def _set_optimizer(tm, env):
    env["model"].set_optimizer("AdamW", lr=1e-3, not_an_option=1)


def _fb_value(tm, env):
    b = _batch()
    b["position_id"] = torch.arange(8)[None].expand(2, -1)
    env["model"].forward_backward(inputs=b)


def _fb_type(tm, env):
    env["model"].forward_backward(inputs=_batch(), advantages=torch.zeros(2, 8))  # not an argument of its loss


def _fo_value(tm, env):
    env["model"].forward_only(inputs=_batch(), return_topk=0)


def _step_value(tm, env):
    env["model"].clip_grad_and_step(max_grad_norm=-1.0)


def _step_nonfinite(tm, env):
    m = env["model"]
    m.zero_grad()
    p = next(p for c in m.unwrapped_chunks() for p in c.parameters())
    keep = p.detach().clone()
    try:
        with torch.no_grad():
            p.fill_(math.nan)
        m.forward_backward(inputs=_batch(1))
        m.clip_grad_and_step()
    finally:
        with torch.no_grad():
            p.copy_(keep)
        m.zero_grad()


def _load_value(tm, env):
    path = env["model"].save("weights-only", output_dir=env["tmp"], save_optimizer=False)
    env["model"].load(path, load_optimizer=True)


def _multi_lora_limit(tm, env):
    from twinkle_megatron.job.configs import tiny_qwen3_config
    m = tm.MultiLoraMegatronModel(model_id=tiny_qwen3_config(num_layers=1), max_loras=1)
    m.add_adapter_to_model("a", {"r": 2, "target_modules": "all-linear"})
    m.add_adapter_to_model("b", {"r": 2, "target_modules": "all-linear"})


def _set_processor(tm, env):
    env["model"].set_processor("Qwen3Processor")


def _moe_aux(tm):
    """A one-layer Qwen3-MoE with its load-balancing loss on (router_aux_loss_coef)."""
    from twinkle_megatron.job.configs import tiny_qwen3_config
    cfg = dict(tiny_qwen3_config(num_layers=1), model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
               output_router_logits=True, router_aux_loss_coef=0.01)
    return tm.MegatronModel(model_id=cfg, mixed_precision="fp32")


def _fb_task(tm, env):   # task='embedding' with the MoE aux loss on
    m = _moe_aux(tm)
    m.set_optimizer("AdamW", lr=1e-3)
    m.set_loss("InfonceLoss")
    m.forward_backward(inputs={"input_ids": torch.ones(2, 4, dtype=torch.long), "labels": torch.tensor([1, 0])},
                       task="embedding")


def _fo_type(tm, env):   # a per-token option with task='embedding'
    env["model"].forward_only(inputs={"input_ids": torch.ones(2, 4, dtype=torch.long)}, task="embedding",
                              return_topk=2)


def _fo_task(tm, env):
    _moe_aux(tm).forward_only(inputs={"input_ids": torch.ones(2, 4, dtype=torch.long)}, task="embedding")


def _add_metric_value(tm, env):
    env["model"].add_metric("AccuracyMetric")       # a name this package does not know


def _add_metric_type(tm, env):
    env["model"].add_metric("DPOMetric", gamma=1.0)


def _recompute_fields(tm, env):
    from twinkle_megatron import config
    from twinkle_megatron.job.configs import tiny_qwen3_config
    shape = config.model_shape(tiny_qwen3_config(num_layers=1))
    tm.RecomputeConfig("selective", modules=["moe"]).fields(shape, tm.DeviceMesh.from_sizes())


# (qualname, error) -> a call that raises it here, or the test (file::name) that makes it happen on
# several ranks
def _mesh_data_rank(tm, env):
    tm.DeviceMesh.from_sizes(world_size=2, dp_size=2).data_rank   # not the mesh initialized (or none is)


CLAIMS = {
    ("DeviceMesh.from_sizes", "ValueError"): _mesh_sizes,
    ("DeviceMesh.data_rank", "RuntimeError"): _mesh_data_rank,
    ("DeviceMesh.check_model", "ValueError"): _mesh_check,
    ("MegatronModel.set_optimizer", "TypeError"): _set_optimizer,
    ("MegatronModel.forward_backward", "ValueError"): _fb_value,
    ("MegatronModel.forward_backward", "TypeError"): _fb_type,
    ("MegatronModel.forward_backward", "InputMismatchError"):
        "tests/megatron/test_facade_inputs.py::test_two_ranks_agree_and_roll_back",
    ("MegatronModel.forward_only", "ValueError"): _fo_value,
    ("MegatronModel.clip_grad_and_step", "ValueError"): _step_value,
    ("MegatronModel.clip_grad_and_step", "NonFiniteGradientError"): _step_nonfinite,
    ("MegatronModel.load", "ValueError"): _load_value,
    ("RecomputeConfig.fields", "ValueError"): _recompute_fields,
    ("MultiLoraMegatronModel", "ValueError"): _multi_lora_limit,
    ("MegatronModel.set_processor", "TypeError"): _set_processor,
    ("MegatronModel.forward_backward", "NotImplementedError"): _fb_task,
    ("MegatronModel.forward_only", "NotImplementedError"): _fo_task,
    ("MegatronModel.forward_only", "TypeError"): _fo_type,
    ("MegatronModel.add_metric", "ValueError"): _add_metric_value,
    ("MegatronModel.add_metric", "TypeError"): _add_metric_type,
}


def test_every_documented_error_has_a_claim():
    found = documented_raises()
    assert len(found) >= 8, found
    missing = sorted(found - set(CLAIMS))
    stale = sorted(set(CLAIMS) - found)
    assert not missing, f"docstrings name these errors; add a call that raises each to CLAIMS: {missing}"
    assert not stale, f"CLAIMS lists errors no docstring names any more: {stale}"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with megatron_one_rank() as tm:
        yield {"tm": tm, "model": _tiny(tm), "tmp": str(tmp_path_factory.mktemp("ckpt"))}


@pytest.mark.parametrize("claim", sorted(CLAIMS), ids=lambda c: f"{c[0]}-{c[1]}")
def test_documented_error_is_raised(claim, env):
    how = CLAIMS[claim]
    if isinstance(how, str):   # made to happen on several ranks by the named test: it must exist
        path, name = how.split("::")
        text = open(os.path.join(ROOT, path), encoding="utf-8").read()
        assert re.search(rf"^def {name}\(", text, re.M), how
        assert claim[1] in text, (how, claim)
        return
    tm = env["tm"]
    err = getattr(tm, claim[1], None) or getattr(builtins, claim[1])
    with pytest.raises(err):
        how(tm, env)
    # the model still trains after the refusal (a documented error leaves no trace)
    m = env["model"]
    m.forward_backward(inputs=_batch(2))
    assert math.isfinite(m.clip_grad_and_step())
