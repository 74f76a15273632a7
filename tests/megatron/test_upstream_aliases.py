"""Upstream Twinkle's spellings, accepted with upstream's meaning (docs/upstream.md): each alias
gives what the package's own name gives, bit for bit; an alias with its name is a TypeError naming
both; upstream's Ray keywords are refused with what to do instead. One process, tiny Qwen3 (the
GKD ``teacher_topk_logprobs`` convention is in tests/megatron/test_gkd.py)."""
import pytest
import torch

pytest.importorskip("megatron.core")


VOCAB = 256


def _cfg():
    from twinkle_megatron.job.configs import tiny_qwen3_config
    return tiny_qwen3_config(num_layers=1)


def _batch(seed=0):
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _lora(tm, cls=None, **kw):
    m = (cls or tm.MegatronModel)(model_id=_cfg(), mixed_precision="fp32", seed=2, **kw)
    m.add_adapter_to_model("a", {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    m.set_optimizer("AdamW", lr=1e-2)
    # move the adapter off zero, so the adapted and the base model differ
    m.forward_backward(inputs=_batch(1))
    m.clip_grad_and_step()
    return m


def test_disable_lora_is_the_base_model(tm):
    m = _lora(tm)
    base = m.forward_only(inputs=_batch(), adapter_name=None)["logps"]
    assert torch.equal(m.forward_only(inputs=_batch(), disable_lora=True)["logps"], base)
    adapted = m.forward_only(inputs=_batch(), disable_lora=False)["logps"]
    assert torch.equal(adapted, m.forward_only(inputs=_batch())["logps"]) and not torch.equal(adapted, base)
    # upstream's DPO cookbook names the adapter whose LoRA it disables: the base model; an unknown one is refused
    assert torch.equal(m.forward_only(inputs=_batch(), disable_lora=True, adapter_name="a")["logps"], base)
    with pytest.raises(ValueError, match="adapter_name='b'"):
        m.forward_only(inputs=_batch(), disable_lora=True, adapter_name="b")
    with pytest.raises(TypeError, match="disable_lora=True or adapter_name=None, not both"):
        m.forward_only(inputs=_batch(), disable_lora=True, adapter_name=None)
    with pytest.raises(TypeError, match="disable_lora must be a bool"):
        m.forward_only(inputs=_batch(), disable_lora=1)


def test_ref_outputs_is_ref_logps(tm):
    ref = torch.randn(2, 8, generator=torch.Generator().manual_seed(3)) * 0.1 - 3
    results = []
    for kw in ({"ref_logps": ref}, {"ref_outputs": {"logps": ref}}):
        m = tm.MegatronModel(model_id=_cfg(), mixed_precision="fp32", seed=4)
        m.set_optimizer("AdamW", lr=1e-2)
        m.set_loss("grpo", beta=0.1)
        out = m.forward_backward(inputs=_batch(), advantages=torch.tensor([1.0, -1.0]), **kw)
        results.append((out["loss"], m.clip_grad_and_step()))
    assert results[0] == results[1]
    with pytest.raises(TypeError, match="ref_outputs .* or ref_logps"):
        m.forward_backward(inputs=_batch(), advantages=torch.tensor([1.0, -1.0]), ref_logps=ref,
                           ref_outputs={"logps": ref})
    with pytest.raises(TypeError, match="ref_outputs must be a dict with 'logps'"):
        m.forward_backward(inputs=_batch(), advantages=torch.tensor([1.0, -1.0]), ref_outputs=ref)


def test_constructor_keywords(tm):
    m = tm.MegatronModel(model_id=_cfg(), ddp_config={"overlap_grad_reduce": True, "bucket_size": 1000},
                         use_distributed_optimizer=True, variable_seq_lengths=True)
    assert (m.overlap.overlap_grad_reduce, m.overlap.bucket_size) == (True, 1000)
    m.set_optimizer("AdamW")                        # the constructor's choice
    assert m.train_state().ddp_config.use_distributed_optimizer
    with pytest.raises(TypeError, match=r"ddp_config\['bucket_size'\] or bucket_size="):
        tm.MegatronModel(model_id=_cfg(), ddp_config={"bucket_size": 10}, bucket_size=20)
    with pytest.raises(ValueError, match=r"ddp_config: \['grad_reduce_in_fp32'\] are not set"):
        tm.MegatronModel(model_id=_cfg(), ddp_config={"grad_reduce_in_fp32": True})
    with pytest.raises(ValueError, match="variable_seq_lengths=False"):
        tm.MegatronModel(model_id=_cfg(), variable_seq_lengths=False)
    with pytest.raises(TypeError, match="Ray mode.*torchrun"):
        tm.MegatronModel(model_id=_cfg(), remote_group="model")
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['not_a_keyword'\]"):
        tm.MegatronModel(model_id=_cfg(), not_a_keyword=1)


def test_multi_lora_model_keeps_upstreams_limits(tm):
    m = _lora(tm, cls=tm.MultiLoraMegatronModel, max_loras=2, max_r=8)
    assert isinstance(m, tm.MegatronModel) and m.max_length == 8192
    with pytest.raises(ValueError, match="r=16 > max_r=8"):
        m.add_adapter_to_model("big", {"r": 16, "target_modules": "all-linear"})
    m.add_adapter_to_model("b", {"r": 8, "target_modules": "all-linear"})
    with pytest.raises(ValueError, match="max_loras=2: this model holds 2 adapters"):
        m.add_adapter_to_model("c", {"r": 4, "target_modules": "all-linear"})
    m.remove_adapter("b")
    m.add_adapter_to_model("c", {"r": 4, "target_modules": "all-linear"})
    assert sorted(m.adapters) == ["a", "c"]
    with pytest.raises(ValueError, match="max_loras must be a positive int"):
        tm.MultiLoraMegatronModel(model_id=_cfg(), max_loras=0)


def test_calculate_metric_offers_upstreams_keys(tm):
    m = tm.MegatronModel(model_id=_cfg(), mixed_precision="fp32")
    m.set_optimizer("AdamW", lr=2e-3)
    m.forward_backward(inputs=_batch())
    m.clip_grad_and_step()
    got = m.calculate_metric(is_training=True)
    assert got["learning rate"] == got["lr"] == pytest.approx(2e-3) and got["iters"] == got["step"] == 1
    with pytest.raises(ValueError, match="reported by the facade already"):
        m.add_metric("learning rate", lambda x: (x.logps.sum(), x.loss_mask.sum()))
