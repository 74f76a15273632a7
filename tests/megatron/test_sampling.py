"""twinkle_megatron.sampling.TransformersSampler, the stand-in for upstream Twinkle's vLLMSampler,
against plain transformers on fresh random weights and inputs: prompt log-probs (vLLM's
convention: position 0 None, raw log_softmax, top-k descending) against a float64 forward,
greedy completions against ``generate``, seeded sampling reproducible, sampled log-probs against
a teacher-forced forward; bad arguments refused naming them."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from twinkle_megatron.sampling import SampleResponse, SamplingParams, TransformersSampler  # noqa: E402

VOCAB = 96


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Qwen3 with random weights saved in float64 (config torch_dtype float64)."""
    import transformers
    from twinkle_megatron.job.configs import tiny_qwen3_config
    cfg = dict(tiny_qwen3_config(num_layers=2), vocab_size=VOCAB, bos_token_id=None, eos_token_id=3, pad_token_id=0)
    cfg.pop("torch_dtype")
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    with torch.no_grad():       # larger weights than the default init: peaked, well-separated distributions
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    path = tmp_path_factory.mktemp("model")
    model.save_pretrained(str(path))
    return str(path)


def reference(folder, dtype=torch.float64):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def prompts(seed, lengths=(7, 12, 3)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_prompt_logprobs_equal_a_plain_forward(folder, dtype):
    """``max_tokens=0, prompt_logprobs=k`` (upstream's GKD teacher call): position 0 None; position
    t the top-k of log_softmax(logits[t - 1]) in descending order, and token t's own log-prob; no
    sequence generated, the input feature handed back as it came."""
    sampler = TransformersSampler(folder, engine_args={"dtype": dtype, "max_logprobs": 8,
                                                       "logprobs_mode": "raw_logprobs"})
    ref = reference(folder)
    k = 5
    inputs = [{"input_ids": ids, "labels": ids[1:] + [-100]} for ids in prompts(seed=int(torch.seed() % 2**31))]
    out = sampler.sample(inputs, SamplingParams(max_tokens=0, temperature=1.0, prompt_logprobs=k, num_samples=1))
    assert len(out) == len(inputs) and all(isinstance(r, SampleResponse) for r in out)
    tol = 0 if dtype == "float64" else 2e-5
    for item, resp in zip(inputs, out):
        ids = item["input_ids"]
        with torch.no_grad():
            want = torch.log_softmax(ref(input_ids=torch.tensor([ids])).logits[0].double(), -1)
        assert resp.prompt_token_ids == ids
        assert resp.topk_prompt_logprobs[0] is None and resp.prompt_logprobs[0] is None
        assert len(resp.topk_prompt_logprobs) == len(ids)
        for t in range(1, len(ids)):
            vals, idx = want[t - 1].topk(k)
            got = resp.topk_prompt_logprobs[t]
            assert [i for i, _ in got] == idx.tolist()
            assert torch.allclose(torch.tensor([v for _, v in got], dtype=torch.float64), vals, atol=tol, rtol=0)
            assert [v for _, v in got] == sorted((v for _, v in got), reverse=True)
            assert abs(resp.prompt_logprobs[t] - want[t - 1, ids[t]].item()) <= tol
        (seq,) = resp.sequences
        assert seq.tokens == [] and seq.new_input_feature == item and seq.stop_reason == "length"


def test_prompt_logprobs_take_numpy_features_and_one_input(folder):
    """Upstream's DataLoader gives numpy arrays; one dict is one input."""
    import numpy as np
    sampler = TransformersSampler(folder, engine_args={"dtype": "float64"})
    ids = prompts(seed=5, lengths=(6,))[0]
    (a,) = sampler.sample({"input_ids": np.array(ids)}, {"max_tokens": 0, "prompt_logprobs": 3})
    (b,) = sampler.sample([{"input_ids": ids}], SamplingParams(max_tokens=0, prompt_logprobs=3))
    assert a.topk_prompt_logprobs == b.topk_prompt_logprobs and a.sequences[0].new_input_feature == {"input_ids": ids}
    (c,) = sampler.sample([{"input_ids": ids}], SamplingParams(max_tokens=0))
    assert c.topk_prompt_logprobs is None and c.prompt_logprobs is None      # not asked (vLLM: 0 is none too)


def test_greedy_completions_equal_transformers_generate(folder):
    import transformers
    sampler = TransformersSampler(folder, engine_args={"dtype": "float64"})
    ref = reference(folder)
    for ids in prompts(seed=11):
        (resp,) = sampler.sample([{"input_ids": ids}], SamplingParams(max_tokens=6, temperature=0, logprobs=1))
        want = ref.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=3, pad_token_id=0,
                            generation_config=transformers.GenerationConfig())[0, len(ids):].tolist()
        (seq,) = resp.sequences
        assert seq.tokens == want
        assert seq.stop_reason == ("stop" if want[-1] == 3 else "length")
        assert seq.new_input_feature["input_ids"] == ids + want


def test_sampled_logprobs_equal_a_teacher_forced_forward_and_the_seed_reproduces(folder):
    """num_samples rows per prompt; ``logprobs=1`` gives each sampled token's log-prob, raw mode:
    log_softmax of the logits of the whole sequence fed at once (float64 vs float64: 1e-9);
    processed mode with temperature 2: the log-prob under softmax(logits / 2). The same
    ``SamplingParams.seed`` draws the same tokens; the engine seed is the default otherwise."""
    raw = TransformersSampler(folder, engine_args={"dtype": "float64", "logprobs_mode": "raw_logprobs"})
    processed = TransformersSampler(folder, engine_args={"dtype": "float64"})
    ref = reference(folder)
    ids = prompts(seed=21, lengths=(5,))[0]
    for sampler, temperature in ((raw, 1.0), (processed, 2.0)):
        params = SamplingParams(max_tokens=5, num_samples=3, logprobs=1, temperature=temperature, seed=7)
        (resp,) = sampler.sample([{"input_ids": ids}], params)
        (again,) = sampler.sample([{"input_ids": ids}], params)
        assert [s.tokens for s in resp.sequences] == [s.tokens for s in again.sequences]
        assert len(resp.sequences) == 3
        for seq in resp.sequences:
            full = ids + seq.tokens
            with torch.no_grad():
                logits = ref(input_ids=torch.tensor([full])).logits[0, len(ids) - 1:-1]
            want = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(seq.tokens)[:, None])[:, 0]
            got = torch.tensor([lp[0][1] for lp in seq.logprobs], dtype=torch.float64)
            assert [lp[0][0] for lp in seq.logprobs] == seq.tokens
            assert torch.allclose(got, want, atol=1e-9, rtol=0), (got, want)
    a = TransformersSampler(folder, engine_args={"dtype": "float64", "seed": 3})
    b = TransformersSampler(folder, engine_args={"dtype": "float64", "seed": 3})
    p = SamplingParams(max_tokens=4, num_samples=4)
    assert [s.tokens for s in a.sample([{"input_ids": ids}], p)[0].sequences] == \
           [s.tokens for s in b.sample([{"input_ids": ids}], p)[0].sequences]


def test_top_k_and_top_p_keep_only_their_ids(folder):
    """top_k=1 is greedy; top_p small enough keeps only the top id (the top id is always kept)."""
    sampler = TransformersSampler(folder, engine_args={"dtype": "float64"})
    ids = prompts(seed=31, lengths=(6,))[0]
    (greedy,) = sampler.sample([{"input_ids": ids}], SamplingParams(max_tokens=5, temperature=0))
    for params in (SamplingParams(max_tokens=5, top_k=1), SamplingParams(max_tokens=5, top_p=1e-6)):
        (resp,) = sampler.sample([{"input_ids": ids}], params)
        assert resp.sequences[0].tokens == greedy.sequences[0].tokens


def test_bad_arguments_are_refused_naming_them(folder, tmp_path):
    with pytest.raises(TypeError, match=r"engine_args \['enforce_eager'\] have no meaning"):
        TransformersSampler(folder, engine_args={"enforce_eager": True})
    with pytest.raises(TypeError, match=r"\['remote_group'\] belong to upstream Twinkle's Ray mode"):
        TransformersSampler(folder, remote_group="teacher")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        TransformersSampler(folder, engine_args={"tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="logprobs_mode"):
        TransformersSampler(folder, engine_args={"logprobs_mode": "logits"})
    sampler = TransformersSampler(folder, engine_args={"max_logprobs": 4, "max_model_len": 8})
    one = [{"input_ids": [5, 6, 7]}]
    with pytest.raises(ValueError, match=r"prompt_logprobs=5 exceeds engine_args\['max_logprobs'\]=4"):
        sampler.sample(one, SamplingParams(max_tokens=0, prompt_logprobs=5))
    with pytest.raises(ValueError, match="longer than engine_args\\['max_model_len'\\]=8"):
        sampler.sample([{"input_ids": list(range(4, 13))}], SamplingParams(max_tokens=1))
    (capped,) = sampler.sample(one, SamplingParams(max_tokens=50, temperature=0, stop=[-1]))
    assert len(capped.sequences[0].tokens) <= 5                     # prompt + completion <= max_model_len
    with pytest.raises(ValueError, match="stops on token ids only"):
        sampler.sample(one, SamplingParams(max_tokens=2, stop="</s>"))
    with pytest.raises(ValueError, match="repetition_penalty"):
        sampler.sample(one, SamplingParams(max_tokens=2, repetition_penalty=1.1))
    with pytest.raises(TypeError, match=r"unknown field\(s\) \['best_of'\]"):
        sampler.sample(one, {"max_tokens": 2, "best_of": 2})
    with pytest.raises(ValueError, match="need set_template first"):
        sampler.sample([{"messages": [{"role": "user", "content": "hi"}]}], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="SamplingParams.top_p must be a number in"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="adapter_path"):
        sampler.sample(one, SamplingParams(max_tokens=1), adapter_path=str(tmp_path))


def test_upstream_sampling_params_object_is_taken_field_by_field():
    """Any object with SamplingParams' fields (upstream's dataclass) converts; one without them is
    a TypeError naming what is missing."""
    class Upstream:                      # the shape of twinkle.data_format.SamplingParams
        max_tokens, seed, stop, temperature, top_k, top_p = 0, None, None, 1.0, -1, 1.0
        repetition_penalty, logprobs, prompt_logprobs, num_samples = 1.0, None, 64, 1
    p = SamplingParams.coerce(Upstream())
    assert p == SamplingParams(max_tokens=0, prompt_logprobs=64)
    with pytest.raises(TypeError, match="without"):
        SamplingParams.coerce(object())


# ---- CheckpointEngineManager: the trainer's weights in the sampler -------------------------------

@pytest.fixture(scope="module")
def tm_one_rank():
    from conftest import megatron_one_rank
    with megatron_one_rank() as tm:
        yield tm


def _trainer_and_folder(tm, tmp_path, lora_r=4):
    """A fp32 MegatronModel with a LoRA adapter, one step trained (so that the adapter is not
    zero), and a weightless folder of its config for the sampler."""
    from peft import LoraConfig
    from twinkle_megatron.job.configs import tiny_qwen3_config
    cfg = dict(tiny_qwen3_config(num_layers=2), vocab_size=VOCAB, bos_token_id=None, eos_token_id=3, pad_token_id=0)
    (tmp_path / "config.json").write_text(__import__("json").dumps(cfg))
    model = tm.MegatronModel(model_id=cfg, mixed_precision="fp32", seed=5)
    model.add_adapter_to_model("default", LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_modules="all-linear"))
    model.set_optimizer("default", lr=1e-2)
    return model, str(tmp_path)


def _step(model, seed):
    ids = prompts(seed=seed, lengths=(9, 6))
    model.forward_backward(inputs=[{"input_ids": i, "labels": i} for i in ids])
    model.clip_grad_and_step()


def _max_gap(model, sampler, ids):
    """max |sampler's prompt log-prob - the trainer's forward_only log-prob| over the tokens."""
    want = model.forward_only(inputs=[{"input_ids": ids, "labels": ids}])["logps"][0]
    (resp,) = sampler.sample([{"input_ids": ids}], SamplingParams(max_tokens=0, prompt_logprobs=1))
    got = torch.tensor(resp.prompt_logprobs[1:], dtype=torch.float64)
    return (got - want[1:len(ids)].double()).abs().max().item()


@pytest.mark.parametrize("merge", [False, True])
def test_sync_weights_makes_the_samplers_logprobs_the_trainers(tm_one_rank, tmp_path, merge):
    """After ``sync_weights`` the sampler's log-probs of fresh tokens equal the trainer's
    ``forward_only`` (fp32 both: 1e-4); a step later they do not until the next sync
    (merge_and_sync=False: the base and adapter once, then the adapter alone)."""
    from twinkle_megatron.sampling import CheckpointEngineManager
    model, folder = _trainer_and_folder(tm_one_rank, tmp_path)
    _step(model, 1)
    sampler = TransformersSampler(folder, engine_args={"enable_lora": True, "max_lora_rank": 8})
    ids = prompts(seed=int(torch.seed() % 2**31), lengths=(11,))[0]
    with pytest.raises(RuntimeError, match="has no weights and none were synced yet"):
        sampler.sample([{"input_ids": ids}], SamplingParams(max_tokens=0, prompt_logprobs=1))
    manager = CheckpointEngineManager(model=model, sampler=sampler)
    first = manager.sync_weights(merge_and_sync=merge)
    assert first["full"] and _max_gap(model, sampler, ids) < 1e-4
    _step(model, 2)
    stale = _max_gap(model, sampler, ids)
    assert stale > 1e-3, stale
    again = manager.sync_weights(merge_and_sync=merge)
    assert again["full"] is merge                            # unmerged: the adapter alone after the first
    assert _max_gap(model, sampler, ids) < 1e-4
    assert (sampler.replica.adapter_name is None) is merge


def test_sync_weights_refuses_what_the_sampler_cannot_hold(tm_one_rank, tmp_path):
    from twinkle_megatron.sampling import CheckpointEngineManager
    model, folder = _trainer_and_folder(tm_one_rank, tmp_path, lora_r=16)
    with pytest.raises(ValueError, match="needs engine_args=\\{'enable_lora': True\\}"):
        CheckpointEngineManager(model=model, sampler=TransformersSampler(folder)).sync_weights(merge_and_sync=False)
    small = TransformersSampler(folder, engine_args={"enable_lora": True, "max_lora_rank": 8})
    with pytest.raises(ValueError, match=r"rank 16 > engine_args\['max_lora_rank'\]=8"):
        CheckpointEngineManager(model=model, sampler=small).sync_weights(merge_and_sync=False)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['platform'\]"):
        CheckpointEngineManager(model=model, sampler=small, platform="GPU")


def test_a_synced_qwen3_5_samples_what_the_trainer_computes(tm_one_rank, tmp_path):
    """A vision-language Qwen3.5 checkpoint (Gated DeltaNet + gated attention layers): the trainer
    streams ``model.language_model.*``, the sampler holds the text model (``model.*``). After a
    merged sync, the log-probs of the tokens it samples with its KV / recurrent cache (raw mode)
    equal the trainer's ``forward_only`` of prompt + completion (fp32 both), as do its prompt
    log-probs."""
    import transformers
    from twinkle_megatron.job.configs import tiny_qwen3_5_config
    from twinkle_megatron.sampling import CheckpointEngineManager
    text = {k: v for k, v in tiny_qwen3_5_config(num_layers=4).items() if k != "architectures"}
    text.update(vocab_size=VOCAB, bos_token_id=None, eos_token_id=3, pad_token_id=0)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
    cfg = transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    cfg.save_pretrained(str(tmp_path))
    model = tm_one_rank.MegatronModel(str(tmp_path), mixed_precision="fp32", seed=9)
    sampler = TransformersSampler(str(tmp_path), engine_args={"logprobs_mode": "raw_logprobs"})
    CheckpointEngineManager(model=model, sampler=sampler).sync_weights()
    ids = prompts(seed=int(torch.seed() % 2**31), lengths=(7,))[0]
    assert _max_gap(model, sampler, ids) < 1e-4
    (resp,) = sampler.sample([{"input_ids": ids}], SamplingParams(max_tokens=8, logprobs=1, seed=4))
    (seq,) = resp.sequences
    full = ids + seq.tokens
    want = model.forward_only(inputs=[{"input_ids": full, "labels": full}])["logps"][0, len(ids):len(full)]
    got = torch.tensor([lp[0][1] for lp in seq.logprobs])
    assert seq.tokens and torch.allclose(got, want.float(), atol=1e-4, rtol=0), (got, want)
