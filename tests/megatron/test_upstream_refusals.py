"""Issue 47's bad input: an upstream Twinkle keyword that has no meaning here is a TypeError, never
ignored. Ray's ``remote_group`` and ``mode='ray'`` at every entry point a cookbook script calls;
upstream's other ``initialize`` keywords with what to do instead; ``ddp_config`` given with the
overlap keyword it stands for. One process, tiny Qwen3 (the alias tests proper are in
tests/megatron/test_upstream_aliases.py)."""
import pytest
import torch

pytest.importorskip("megatron.core")


RAY = [{"remote_group": "policy"}, {"mode": "ray"}]


@pytest.fixture(scope="module")
def model(tm):
    from twinkle_megatron.job.configs import tiny_qwen3_config
    m = tm.MegatronModel(model_id=tiny_qwen3_config(num_layers=1), mixed_precision="fp32")
    m.add_adapter_to_model("a", {"r": 4, "target_modules": "all-linear"})
    m.set_optimizer("AdamW", lr=1e-3)
    m.set_lr_scheduler("constant")
    return m


def _batch():
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def _entry_points(tm, m, tmp):
    from twinkle_megatron.job.configs import tiny_qwen3_config
    b = _batch()
    return {
        "MegatronModel": lambda kw: tm.MegatronModel(model_id=tiny_qwen3_config(num_layers=1), **kw),
        "add_adapter_to_model": lambda kw: m.add_adapter_to_model("z", {"r": 4, "target_modules": "all-linear"}, **kw),
        "set_optimizer": lambda kw: m.set_optimizer("AdamW", lr=1e-3, **kw),
        "set_lr_scheduler": lambda kw: m.set_lr_scheduler("constant", **kw),
        "set_loss": lambda kw: m.set_loss("cross_entropy", **kw),
        "set_template": lambda kw: m.set_template("Template", **kw),
        "set_processor": lambda kw: m.set_processor("InputProcessor", **kw),
        "add_metric": lambda kw: m.add_metric("Accuracy", **kw),
        "forward_backward": lambda kw: m.forward_backward(inputs=b, **kw),
        "forward_only": lambda kw: m.forward_only(inputs=b, **kw),
        "clip_grad_and_step": lambda kw: m.clip_grad_and_step(**kw),
        "calculate_metric": lambda kw: m.calculate_metric(is_training=True, **kw),
        "save": lambda kw: m.save("ck", output_dir=str(tmp), **kw),
        "load": lambda kw: m.load("ck", output_dir=str(tmp), **kw),
        "initialize": lambda kw: tm.initialize(tm.DeviceMesh.from_sizes(world_size=1), **kw),
        "DeviceMesh.from_sizes": lambda kw: tm.DeviceMesh.from_sizes(world_size=1, **kw),
        "get_device_placement": lambda kw: tm.get_device_placement(**kw),
    }


@pytest.mark.parametrize("kw", RAY, ids=["remote_group", "mode"])
def test_ray_keywords_are_refused_at_every_entry_point(tm, model, tmp_path, kw):
    """Each entry point raises a TypeError naming the keyword; the model still trains afterwards."""
    key = next(iter(kw))
    for name, call in _entry_points(tm, model, tmp_path).items():
        with pytest.raises(TypeError) as err:
            call(kw)
        assert key in str(err.value), (name, str(err.value))
    # the calls that say why: the model (Ray's remote_group) and initialize(mode='ray')
    why = {"remote_group": ("MegatronModel", r"Ray mode.*torchrun"), "mode": ("initialize", r"Ray mode.*torchrun")}
    where, pattern = why[key]
    with pytest.raises(TypeError, match=pattern):
        _entry_points(tm, model, tmp_path)[where](kw)
    assert tm.current_mesh() is not None          # initialize refused before tearing anything down
    out = model.forward_backward(inputs=_batch())
    assert out["count"] == 2 * 7 and torch.isfinite(torch.tensor(out["loss"]))
    model.clip_grad_and_step()


@pytest.mark.parametrize("key", ["nproc_per_node", "ncpu_proc_per_node", "groups", "lazy_collect", "full_determinism",
                                 "name", "notifier", "remote_group"])
def test_upstreams_other_initialize_keywords_say_what_to_do(key):
    from twinkle_megatron.parallel import mesh as mesh_mod
    with pytest.raises(TypeError) as err:
        mesh_mod.upstream_mesh(None, {"mode": "local", key: 1})
    msg = str(err.value)
    assert f"unexpected keyword argument(s) ['{key}']" in msg and "upstream Twinkle's, with no meaning here" in msg
    assert mesh_mod.UPSTREAM_INITIALIZE_KEYWORDS[key] in msg
    with pytest.raises(TypeError, match=r"\['not_upstream'\]$"):   # a keyword upstream does not have either
        mesh_mod.upstream_mesh(None, {"not_upstream": 1})


@pytest.mark.parametrize("key, flat", [("overlap_grad_reduce", True), ("overlap_param_gather", True),
                                       ("bucket_size", 20)])
def test_ddp_config_with_its_flat_keyword_names_both(tm, key, flat):
    from twinkle_megatron.job.configs import tiny_qwen3_config
    other = {"overlap_grad_reduce": False, "overlap_param_gather": False, "bucket_size": 10}[key]
    with pytest.raises(TypeError, match=rf"ddp_config\['{key}'\] or {key}=, not both"):
        tm.MegatronModel(model_id=tiny_qwen3_config(num_layers=1), ddp_config={key: other}, **{key: flat})


@pytest.mark.parametrize("key, flat, given", [("overlap_grad_reduce", False, True), ("overlap_param_gather", False, True)])
def test_ddp_config_with_its_flat_keyword_at_its_default_names_both(tm, key, flat, given):
    """The flat keyword given at its default value (off) beside ddp_config's other value is a clash
    too: it is not taken silently either way."""
    from twinkle_megatron.job.configs import tiny_qwen3_config
    with pytest.raises(TypeError, match=rf"ddp_config\['{key}'\] or {key}=, not both"):
        tm.MegatronModel(model_id=tiny_qwen3_config(num_layers=1), ddp_config={key: given}, **{key: flat})


def test_distributed_optimizer_name_with_use_distributed_optimizer_false_is_refused(tm):
    """set_optimizer('MegatronDistributedOptimizer', use_distributed_optimizer=False) contradicts
    itself: refused naming both, not silently the distributed optimizer; the name alone (or with
    True) is the distributed optimizer."""
    from twinkle_megatron.job.configs import tiny_qwen3_config
    m = tm.MegatronModel(model_id=tiny_qwen3_config(num_layers=1), mixed_precision="fp32")
    with pytest.raises(ValueError, match="MegatronDistributedOptimizer.*use_distributed_optimizer=False"):
        m.set_optimizer("MegatronDistributedOptimizer", use_distributed_optimizer=False)
    m.set_optimizer("MegatronDistributedOptimizer", lr=1e-3)
    assert m.train_state().opt_config.use_distributed_optimizer


@pytest.mark.parametrize("key, hint", [("config", "model_dir_or_config"), ("tokenizer_id", "set_template")])
def test_upstream_model_keywords_taken_otherwise_say_what_to_do(tm, key, hint):
    """Upstream's MegatronModel(config=, tokenizer_id=) are refused with what this package takes
    instead; a keyword upstream does not have either stays the plain unexpected-keyword error."""
    from twinkle_megatron.job.configs import tiny_qwen3_config
    with pytest.raises(TypeError, match=rf"\['{key}'\] are upstream Twinkle's, not taken here: {key}: .*{hint}"):
        tm.MegatronModel(model_id=tiny_qwen3_config(num_layers=1), **{key: object()})
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['not_upstream'\]$"):
        tm.MegatronModel(model_id=tiny_qwen3_config(num_layers=1), not_upstream=1)
