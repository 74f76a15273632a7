"""Upstream Twinkle's cookbook scripts, ported with only their imports changed (examples/upstream/;
dpo_multi_lora.py, gkd_off_policy.py and grpo.py also trade their Ray lines for torchrun's, see
BEYOND_IMPORTS; the last two sample with twinkle_megatron.sampling's stand-in for vLLMSampler).

Each port is checked two ways:

- its ``diff`` against upstream's file (a copy under tests/data/upstream_cookbook/, never fetched at
  test time) touches import lines only, after the port's header comment, or exactly the lines
  BEYOND_IMPORTS names;
- it runs, on gloo ranks with a tiny local model folder and a local jsonl data set, using upstream's
  own data stack (twinkle-kit's ``CLI``, ``Dataset``, ``Template``, ``DataLoader``, preprocessors),
  and trains to the same losses, grad norms and evaluation losses as a hand-written run of the same
  steps through twinkle_megatron (tests/megatron_workers/upstream_ports_worker.py, which encodes
  the conversations with this package's own ``set_template``, not upstream's Template).

The runs need twinkle-kit, which the README's venv does not have (it pins other versions of
transformers, numpy and peft): they run in the lane ``.ci/upstream_ports``, whose venv adds
twinkle-kit and its data stack's light dependencies to the README's. Elsewhere they are skipped,
unless ``TWINKLE_UPSTREAM_LANE=1`` says they must run.
"""
import ast
import difflib
import json
import os
import re

import pytest

pytest.importorskip("megatron.core")

from tests.megatron_workers.protocol import ROOT, launch  # noqa: E402

UPSTREAM = os.path.join(ROOT, "tests", "data", "upstream_cookbook")
PORTS = os.path.join(ROOT, "examples", "upstream")
WORKER = os.path.join(ROOT, "tests", "megatron_workers", "upstream_ports_worker.py")
# port in examples/upstream/ -> its upstream file under tests/data/upstream_cookbook/
PORTED = {"tp.py": "megatron/tp.py", "tp_moe.py": "megatron/tp_moe.py", "dpo_multi_lora.py": "rl/dpo/dpo_multi_lora.py",
          "gkd_off_policy.py": "rl/gkd/gkd_off_policy.py", "grpo.py": "rl/grpo/grpo.py"}
# the lines a port changes beyond its imports, each with why (its header comment says so too)
BEYOND_IMPORTS = {
    # upstream's Ray mode (a driver and remote actor groups) is torchrun here: one process per rank
    "dpo_multi_lora.py": [
        "-    twinkle.initialize(mode='ray', nproc_per_node=MODEL_GPUS, groups=device_groups)",
        "+    twinkle.initialize(mode='local', global_device_mesh=policy_mesh)",
        "-        remote_group='policy',"],
    # the same, and the remote_group of the teacher sampler and of the DataLoader (which, outside
    # Ray, upstream's DataLoader hands on to torch's: a TypeError)
    "gkd_off_policy.py": [
        "-        mode='ray',", "-        nproc_per_node=NUM_GPUS,", "-        groups=device_groups,",
        "+        mode='local',", "+        global_device_mesh=model_mesh,",
        "-        remote_group='student_model',", "-        remote_group='teacher_sampler',",
        "-        remote_group='student_model',"],
    # the same; the model's remote_group is inside its one-line constructor call
    "grpo.py": [
        "-    twinkle.initialize(mode='ray', nproc_per_node=NUM_GPUS, groups=device_groups, lazy_collect=False)",
        "+    twinkle.initialize(mode='local', global_device_mesh=model_mesh)",
        "-        model = MegatronModel(model_id=MODEL_ID, device_mesh=model_mesh, remote_group='model', mixed_precision='bf16')",
        "+        model = MegatronModel(model_id=MODEL_ID, device_mesh=model_mesh, mixed_precision='bf16')",
        "-        remote_group='sampler',", "-        remote_group='model',"],
}
IMPORT = re.compile(r"^(import [\w.]+( as \w+)?(, [\w.]+( as \w+)?)*|from [\w.]+ import [\w, ]+)$")


# ---- the diff ---------------------------------------------------------------------------------

def non_import_changes(upstream: str, port: str) -> list:
    """The lines of ``diff upstream port`` that are not import statements, the port's leading
    comment block (its header naming the upstream file) aside; each as ``'-line'`` or ``'+line'``."""
    port_lines = port.splitlines()
    start = 0
    while start < len(port_lines) and port_lines[start].startswith("#"):
        start += 1
    bad = []
    for line in difflib.unified_diff(upstream.splitlines(), port_lines[start:], lineterm="", n=0):
        if line.startswith(("---", "+++", "@@")):
            continue
        if not IMPORT.match(line[1:].strip()):
            bad.append(line)
    return bad


@pytest.mark.parametrize("port", sorted(PORTED))
def test_port_differs_from_upstream_in_imports_only(port):
    upstream = open(os.path.join(UPSTREAM, PORTED[port])).read()
    text = open(os.path.join(PORTS, port)).read()
    assert non_import_changes(upstream, text) == BEYOND_IMPORTS.get(port, [])
    assert f"cookbook/{PORTED[port]}" in text.splitlines()[0]          # the header names its upstream file
    assert text != upstream and "twinkle_megatron" in text              # and the imports did change


def test_the_diff_check_sees_a_changed_line_and_a_removed_one():
    upstream = "import twinkle\nfrom twinkle.model import MegatronModel\n\nmodel = MegatronModel(model_id=x)\n"
    port = "# header\nimport twinkle_megatron as twinkle\nfrom twinkle_megatron import MegatronModel\n\n" \
           "model = MegatronModel(model_id=x)\n"
    assert non_import_changes(upstream, port) == []
    assert non_import_changes(upstream, port.replace("(model_id=x)", "(model_id=y)")) == [
        "-model = MegatronModel(model_id=x)", "+model = MegatronModel(model_id=y)"]
    assert non_import_changes(upstream, port.replace("\nmodel = MegatronModel(model_id=x)", "")) == [
        "-model = MegatronModel(model_id=x)"]
    # an import made into something else is not an import
    assert non_import_changes("import os\n", "import os; os.environ['X'] = '1'\n") != []


# ---- what the ports needed: initialize's and the data's upstream conventions ------------------

def test_upstreams_transformers_backend_is_refused_by_name():
    """grpo.py imports upstream's TransformersModel for its --strategy native_fsdp branch; the
    port's import of it builds nothing and says what to use."""
    from twinkle_megatron.upstream import TransformersModel
    with pytest.raises(TypeError, match="upstream Twinkle's transformers .* use MegatronModel"):
        TransformersModel(model_id="x", device_mesh=None)


@pytest.fixture
def no_launcher(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)


def test_initialize_takes_upstreams_keywords(no_launcher):
    """``twinkle.initialize(mode='local', global_device_mesh=mesh)``; Ray's mode, both meshes, or an
    unknown keyword are TypeErrors before anything is set up."""
    import twinkle_megatron as tm
    from twinkle_megatron.parallel import mesh as mesh_mod
    mesh = tm.DeviceMesh.from_sizes(tp_size=2)
    assert mesh_mod.upstream_mesh(None, {"mode": "local", "global_device_mesh": mesh}) is mesh
    assert mesh_mod.upstream_mesh(mesh, {}) is mesh
    assert mesh_mod.upstream_mesh(None, {}) == tm.DeviceMesh.from_sizes()       # upstream: dp over the world
    with pytest.raises(TypeError, match="give mesh or global_device_mesh"):
        tm.initialize(mesh, global_device_mesh=mesh)
    with pytest.raises(TypeError, match=r"initialize\(mode='ray'\): upstream Twinkle's Ray mode .* torchrun"):
        tm.initialize(mode="ray", global_device_mesh=mesh)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['nproc_per_node'\]"):
        tm.initialize(global_device_mesh=mesh, nproc_per_node=8)
    with pytest.raises(TypeError, match="must be a twinkle_megatron.DeviceMesh"):
        tm.initialize(global_device_mesh="dp=2")
    assert tm.current_mesh() is None
    assert tm.get_device_placement() == "No device mesh: call twinkle_megatron.initialize first."
    with pytest.raises(TypeError, match="Ray device groups do not exist here"):
        tm.get_device_placement(device_group=[])


def test_the_mesh_splits_data_as_upstreams_dataloader_asks(tm_one_rank):
    """``DataLoader(device_mesh=mesh)`` reads ``data_world_size``, ``data_rank`` and ``get_slice``."""
    tm = tm_one_rank
    mesh = tm.DeviceMesh.from_sizes(world_size=6, dp_size=3, tp_size=2)
    assert mesh.data_world_size == 3
    # contiguous shares, the first (10 % 3) ranks one longer; together every sample once
    shares = [list(range(10))[mesh.get_slice(10, r)] for r in range(3)]
    assert shares == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert [list(range(2))[mesh.get_slice(2, r)] for r in range(3)] == [[0], [1], []]
    one = tm.current_mesh()
    assert one.data_rank == 0 and one.get_slice(5) == slice(0, 5)
    with pytest.raises(RuntimeError, match="is not the one initialized"):
        mesh.data_rank


def _upstream_sample(ids, labels):
    """A sample as upstream's Template writes it (Template._add_attention_fields, _roll_labels)."""
    import numpy as np
    return {"input_ids": list(ids), "labels": np.roll(np.array(labels), -1), "attention_mask": [1] * len(ids),
            "position_ids": list(range(len(ids))), "length": len(ids), "messages": [], "query": "raw column"}


def test_upstream_template_samples_get_their_labels_rolled_back():
    import torch
    from twinkle_megatron import upstream
    ids, labels = [5, 6, 7, 8, 9], [-100, -100, 7, 8, 9]
    sample = _upstream_sample(ids, labels)
    assert list(sample["labels"]) == [-100, 7, 8, 9, -100]       # upstream: position t holds token t + 1
    assert upstream.is_input_features([sample]) and not upstream.is_input_features([{"input_ids": ids}])
    (got,) = upstream.input_features([sample])
    assert sorted(got) == ["input_ids", "labels"]                 # trivial mask / positions and raw columns left out
    assert got["input_ids"].tolist() == ids and got["labels"].tolist() == labels
    packed = dict(sample, position_ids=[0, 1, 0, 1, 2], attention_mask=[1, 1, 1, 1, 0])
    (kept,) = upstream.input_features([packed])
    assert kept["position_ids"].tolist() == [0, 1, 0, 1, 2] and kept["attention_mask"].tolist() == [1, 1, 1, 1, 0]
    with pytest.raises(ValueError, match=r"inputs\[1\]: mixes upstream Template samples"):
        upstream.input_features([sample, {"input_ids": ids, "labels": labels}])
    with pytest.raises(ValueError, match=r"'length'=4 but input_ids has 5 tokens"):
        upstream.input_features([dict(sample, length=4)])
    with pytest.raises(ValueError, match="labels shape"):
        upstream.input_features([dict(sample, labels=torch.zeros(3, dtype=torch.long))])


@pytest.fixture(scope="module")
def tm_one_rank():
    from conftest import megatron_one_rank
    with megatron_one_rank() as tm:
        yield tm


def test_a_step_on_upstream_samples_equals_the_step_on_the_same_tokens(tm_one_rank):
    """The facade takes upstream Template's samples as they come out of its DataLoader: the loss,
    logps and grad norm equal those of the same tokens with this package's labels; passing upstream's
    rolled labels as ours would train on the next token (a different loss, checked too)."""
    import torch
    from twinkle_megatron.job.configs import tiny_qwen3_config
    tm = tm_one_rank
    g = torch.Generator().manual_seed(0)
    ours, theirs, wrong = [], [], []
    for n in (7, 4, 9):
        ids = torch.randint(0, 256, (n,), generator=g).tolist()
        labels = [-100] * 2 + ids[2:]
        ours.append({"input_ids": ids, "labels": labels})
        theirs.append(_upstream_sample(ids, labels))
        wrong.append({"input_ids": ids, "labels": list(theirs[-1]["labels"])})
    outs = []
    for inputs in (ours, theirs, wrong):
        m = tm.MegatronModel(model_id=tiny_qwen3_config(num_layers=1), mixed_precision="fp32", seed=3)
        m.set_optimizer("AdamW", lr=1e-2)
        out = m.forward_backward(inputs=inputs, return_logps=True)
        outs.append((out, m.clip_grad_and_step()))
    (a, na), (b, nb), (c, _) = outs
    assert a["loss"] == b["loss"] and na == nb
    assert torch.equal(a["logps"], b["logps"])
    assert c["loss"] != a["loss"]


# ---- the runs ---------------------------------------------------------------------------------

WORDS = ["<unk>", "<|im_start|>", "<|im_end|>", "\n", "system", "user", "assistant", "You", "are", "a",
         "helpful", "assistant.", "hello", "who", "what", "is", "your", "name", "I", "am", "made", "by",
         "fine", "thanks", "how", "you", "twinkle", "ms", "hi", "there"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ROWS = [("hello how are you", "fine thanks I am {{NAME}}"), ("who are you", "I am {{NAME}} made by {{AUTHOR}}"),
        ("what is your name", "{{NAME}}"), ("hi there", "hello I am {{NAME}} by {{AUTHOR}}"),
        ("who made you", "{{AUTHOR}} made me"), ("are you helpful", "I am a helpful assistant.")]
NAME, AUTHOR = "twinkle", "ms"
MOE = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=64, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=64, max_position_embeddings=256, intermediate_size=128,
           moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, head_dim=16,
           norm_topk_prob=True, tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0,
           decoder_sparse_step=1, mlp_only_layers=[], torch_dtype="float32")


@pytest.fixture
def upstream_stack():
    """twinkle-kit's data stack (present in the lane's venv only)."""
    if os.environ.get("TWINKLE_UPSTREAM_LANE") == "1":
        import twinkle.dataset  # noqa: F401  (the lane must run these: an ImportError fails it)
    else:
        pytest.importorskip("twinkle.dataset", reason="twinkle-kit is installed by .ci/upstream_ports only")


def _folder(tmp_path, config: dict, name: str = "model", words=WORDS) -> str:
    """A model folder: ``config`` and a word-level tokenizer of ``words`` with a ChatML template
    (no weights: the model initialises from its seed, the same in the port and the hand-written run)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="removed")
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="<|im_end|>",
                                  pad_token="<unk>", additional_special_tokens=["<|im_start|>", "<|im_end|>", "\n"])
    tok.chat_template = CHATML
    tok.save_pretrained(str(folder))
    return str(folder)


def _data(tmp_path, n: int) -> str:
    path = tmp_path / "self_cognition.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            q, r = ROWS[i % len(ROWS)]
            f.write(json.dumps({"query": q, "response": r}) + "\n")
    return str(path)


def _run_port(tmp_path, port: str, nprocs: int, args: list, work: str = "port") -> dict:
    """``examples/upstream/<port> args`` on ``nprocs`` gloo ranks (as torchrun would start it); the
    metrics its rank 0 logged: {"train": [dict per step], "eval": [dict per evaluation]}."""
    from twinkle_megatron.parallel.launch import run_ranks
    # upstream's CLI reads every TWINKLE_* variable as a setting: the port sees none of the test's
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWINKLE_")}
    env.update(OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    work = tmp_path / work
    work.mkdir(exist_ok=True)       # it may hold the script's local data already (_gsm8k)
    ranks = run_ranks([os.path.join(PORTS, port), *args], nprocs, timeout=300, env=env, cwd=str(work),
                      log_dir=str(work))
    assert [r.returncode for r in ranks] == [0] * nprocs, "\n".join(r.output[-4000:] for r in ranks)
    out = ranks[0].output
    train = [ast.literal_eval(m) for m in re.findall(r"Current is step \d+ of \d+, metric: (\{.*\})", out)]
    evals = [ast.literal_eval(m) for m in re.findall(r"Eval metric: (\{.*\})", out)]
    return {"train": train, "eval": evals, "output": out}


def _run_by_hand(tmp_path, model_dir, data, nprocs, run) -> dict:
    spec = {"model_dir": model_dir, "data": data, "name": NAME, "author": AUTHOR, "runs": [dict(run, name="hand")]}
    res, rcs, logs, _ = launch(nprocs, spec, str(tmp_path / "hand"), timeout=300, script=WORKER)
    assert rcs == [0] * nprocs and all(r is not None for r in res), "\n".join(l[-3000:] for l in logs)
    assert res[0]["hand"]["ok"], res[0]["hand"].get("traceback")
    return res[0]["hand"]


def _assert_same_training(port, hand, steps):
    assert len(port["train"]) == steps, port["output"][-3000:]
    assert [m["loss"] for m in port["train"]] == hand["losses"]
    assert [m["grad_norm"] for m in port["train"]] == hand["grad_norms"]
    assert [m["loss"] for m in port["eval"]] == hand["eval_losses"]
    assert [m["num_tokens"] for m in port["train"]] == hand["num_tokens"]
    assert hand["losses"][-1] < hand["losses"][0]          # it trained


# upstream's CLI defaults; the dropout masks come from torch's global generator, which upstream's
# DataLoader (torch's) draws from once per iterator: the hand-written run makes the same draws
LORA = {"target_modules": "all-linear", "r": 8, "lora_alpha": 32, "lora_dropout": 0.05}


@pytest.mark.multiprocess
def test_tp_port_trains_as_the_hand_written_run(tmp_path, upstream_stack):
    """cookbook/megatron/tp.py as tp.sh runs it (LoRA, cosine schedule, an evaluation and a checkpoint
    at each eval step), TP2 on 2 ranks: 3 steps of 4 samples."""
    from twinkle_megatron.job.configs import tiny_qwen3_config
    model_dir = _folder(tmp_path, dict(tiny_qwen3_config(num_layers=2), vocab_size=64, bos_token_id=None,
                                       eos_token_id=2, pad_token_id=0))
    data = _data(tmp_path, 12)
    out = tmp_path / "out"
    port = _run_port(tmp_path, "tp.py", 2, [
        "--model-id", model_dir, "--dataset-id", data, "--template-cls", "Template", "--dp-size", "1",
        "--pp-size", "1", "--cp-size", "1", "--tp-size", "2", "--batch-size", "4", "--lr", "1e-3",
        "--train-samples", "12", "--eval-samples", "4", "--log-interval", "1", "--eval-interval", "1",
        "--output-dir", str(out), "--model-name", NAME, "--model-author", AUTHOR])
    hand = _run_by_hand(tmp_path, model_dir, data, 2, {
        "mesh": {"tp_size": 2}, "samples": 12, "batch_size": 4, "lr": 1e-3, "warmup": 0, "eval_samples": 4,
        "eval_steps": [1, 2], "lora": LORA})
    _assert_same_training(port, hand, 3)
    # the checkpoints it saved: the best evaluation's and the last, each an adapter with its trainer state
    for name in ("checkpoint-1", "last-checkpoint"):
        assert (out / name / "adapter_model.safetensors").is_file(), sorted(os.listdir(out))
    state = json.loads((out / "last-checkpoint" / "trainer_state.json").read_text())
    assert state["consumed_train_samples"] == 12, state


@pytest.mark.multiprocess
def test_tp_port_with_dp2_splits_each_batch_over_the_dp_ranks(tmp_path, upstream_stack):
    """tp.py with --dp-size 2: initialize(mode=, global_device_mesh=) tells upstream's infrastructure
    the mesh, so its DataLoader hands each rank half of each batch of 4 (num_tokens counts the batch
    once), as the hand-written run's two DP ranks take their shares."""
    from twinkle_megatron.job.configs import tiny_qwen3_config
    model_dir = _folder(tmp_path, dict(tiny_qwen3_config(num_layers=2), vocab_size=64, bos_token_id=None,
                                       eos_token_id=2, pad_token_id=0))
    data = _data(tmp_path, 8)
    port = _run_port(tmp_path, "tp.py", 2, [
        "--model-id", model_dir, "--dataset-id", data, "--template-cls", "Template", "--dp-size", "2",
        "--pp-size", "1", "--cp-size", "1", "--tp-size", "1", "--batch-size", "4", "--lr", "1e-3",
        "--train-samples", "8", "--eval-samples", "4", "--log-interval", "1", "--eval-interval", "1",
        "--output-dir", str(tmp_path / "out"), "--model-name", NAME, "--model-author", AUTHOR])
    hand = _run_by_hand(tmp_path, model_dir, data, 2, {
        "mesh": {"dp_size": 2}, "samples": 8, "batch_size": 4, "lr": 1e-3, "warmup": 0, "eval_samples": 4,
        "eval_steps": [1], "lora": LORA})
    _assert_same_training(port, hand, 2)


@pytest.mark.multiprocess
def test_tp_port_resumes_bit_for_bit(tmp_path, upstream_stack):
    """tp.py's --resume-from-checkpoint (model.resume_from_checkpoint, the DataLoader skipping the
    consumed samples, upstream's progress keys): from checkpoint-1 it repeats steps 2 and 3 of the
    run that saved it, bit for bit (no dropout: the generator's state is not part of a checkpoint)."""
    from twinkle_megatron.job.configs import tiny_qwen3_config
    model_dir = _folder(tmp_path, dict(tiny_qwen3_config(num_layers=2), vocab_size=64, bos_token_id=None,
                                       eos_token_id=2, pad_token_id=0))
    args = ["--model-id", model_dir, "--dataset-id", _data(tmp_path, 16), "--template-cls", "Template",
            "--dp-size", "1", "--pp-size", "1", "--cp-size", "1", "--tp-size", "2", "--batch-size", "4",
            "--lr", "1e-3", "--train-samples", "16", "--eval-samples", "4", "--log-interval", "1",
            "--eval-interval", "1", "--lora-dropout", "0", "--output-dir", str(tmp_path / "out")]
    first = _run_port(tmp_path, "tp.py", 2, args)
    again = _run_port(tmp_path, "tp.py", 2, args + ["--resume-from-checkpoint", str(tmp_path / "out" / "checkpoint-1")],
                      work="resumed")
    assert len(first["train"]) == 4 and len(again["train"]) == 2, again["output"][-3000:]
    for got, want in zip(again["train"], first["train"][2:]):
        assert (got["loss"], got["grad_norm"], got["lr"]) == (want["loss"], want["grad_norm"], want["lr"])
    assert [m["loss"] for m in again["eval"]] == [m["loss"] for m in first["eval"][1:]]


@pytest.mark.multiprocess
def test_tp_moe_port_trains_as_the_hand_written_run(tmp_path, upstream_stack):
    """cookbook/megatron/tp_moe.py with tp_moe.sh's --sequence-parallel: a Qwen3-MoE with TP2 on 2
    ranks, 2 steps; it ends by saving the LoRA merged into the weights (merge_lora=True)."""
    model_dir = _folder(tmp_path, dict(MOE, bos_token_id=None, eos_token_id=2, pad_token_id=0))
    data = _data(tmp_path, 8)
    port = _run_port(tmp_path, "tp_moe.py", 2, [
        "--model-id", model_dir, "--dataset-id", data, "--template-cls", "Template", "--dp-size", "1",
        "--tp-size", "2", "--pp-size", "1", "--ep-size", "1", "--sequence-parallel", "--batch-size", "4",
        "--lr", "1e-3", "--train-samples", "8", "--eval-samples", "4", "--log-interval", "1",
        "--eval-interval", "1", "--model-name", NAME, "--model-author", AUTHOR])
    hand = _run_by_hand(tmp_path, model_dir, data, 2, {
        "mesh": {"tp_size": 2, "sequence_parallel": True}, "samples": 8, "batch_size": 4, "lr": 1e-3,
        "warmup": 0, "eval_samples": 4, "eval_steps": [1], "lora": LORA})
    assert hand["sp"] is True
    _assert_same_training(port, hand, 2)
    assert os.path.isdir(tmp_path / "port" / "output" / "last-checkpoint")


def _qwen3_5_folder(tmp_path, words=WORDS, vocab_size=64) -> str:
    """A tiny Qwen3.5 (vision + text) folder: upstream's Qwen3_5Template, which the DPO and GRPO
    scripts name, reads its rope-index function from the vision-language class; the facade trains
    the text decoder."""
    import transformers
    from twinkle_megatron.job.configs import tiny_qwen3_5_config
    text = {k: v for k, v in tiny_qwen3_5_config(num_layers=4).items() if k != "architectures"}
    text.update(vocab_size=vocab_size, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
    cfg = transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    return _folder(tmp_path, cfg.to_dict(), words=words)


DPO_ROWS = [("hello how are you", "fine thanks", "hi there"), ("who are you", "I am twinkle", "I am a helpful assistant."),
            ("what is your name", "twinkle", "ms"), ("hi there", "hello", "how are you"),
            ("who made you", "ms made me", "I am made by you")]


@pytest.mark.multiprocess
def test_dpo_multi_lora_port_trains_as_the_hand_written_run(tmp_path, upstream_stack):
    """cookbook/rl/dpo/dpo_multi_lora.py (its Ray lines made torchrun's, see BEYOND_IMPORTS): a
    MultiLoraMegatronModel with DP2 on 2 ranks, upstream's DataLoader splitting each batch of 8
    pairs over them, the base model as the reference (disable_lora=True), DPOLoss with upstream's
    sft_weight 1, DPOMetric, gradient accumulation 2: the 50 pairs it reads make 6 calls, 3 steps."""
    model_dir = _qwen3_5_folder(tmp_path)
    data = tmp_path / "dpo.jsonl"
    with open(data, "w") as f:
        for i in range(50):
            p, c, r = DPO_ROWS[i % len(DPO_ROWS)]
            f.write(json.dumps({"prompt": p, "answer_zh": c, "answer_en": r}) + "\n")
    port = _run_port(tmp_path, "dpo_multi_lora.py", 2, [
        "--model-id", model_dir, "--dataset-id", str(data), "--batch-size", "8",
        "--gradient-accumulation-steps", "2", "--lr", "1e-3"])
    logged = [ast.literal_eval(m) for m in re.findall(r"\[Step \d+/\d+\] (\{.*\})", port["output"])]
    hand = _run_by_hand(tmp_path, model_dir, str(data), 2, {
        "kind": "dpo", "mesh": {"world_size": 2, "dp_size": 2}, "samples": 50, "batch_size": 8, "lr": 1e-3,
        "accumulation": 2, "decay_steps": 7, "lora": LORA})
    assert len(logged) == 3, port["output"][-3000:]
    for got, want in zip(logged, hand["metrics"]):
        for key in ("loss", "grad_norm", "lr", "rewards/margins", "logps/chosen", "logps/rejected", "nll"):
            assert got[key] == want[key], (key, got[key], want[key])
    assert logged[-1]["loss"] < logged[0]["loss"]
    assert os.path.isdir(tmp_path / "port" / "output" / "dpo-lora-final-checkpoint")


# ---- GKD: the teacher's top-k from twinkle_megatron.sampling.TransformersSampler -----------------

GKD_SYSTEM = ('You are a helpful math assistant. Solve the problem step by step and put '
              'your final answer within #### <number>')       # gkd_off_policy.py's SYSTEM_PROMPT


def _weights_folder(tmp_path, name: str, seed: int) -> str:
    """A tiny Qwen3 folder with random weights (``seed``), float32, and the ChatML tokenizer."""
    import torch
    import transformers
    from twinkle_megatron.job.configs import tiny_qwen3_config
    cfg = dict(tiny_qwen3_config(num_layers=2), vocab_size=64, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    folder = _folder(tmp_path, cfg, name=name)
    cfg.pop("torch_dtype")
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def _gsm8k(tmp_path, n: int, work: str) -> str:
    """GSM8K-shaped rows (question, answer ending in '#### <number>') where the script reads them:
    it names ``ms://modelscope/gsm8k``, and upstream's Dataset loads an existing local path before
    asking the hub, so the rows go to ``<work>/ms:/modelscope/gsm8k/train.jsonl`` (the port runs in
    ``<work>``; the id read as a relative path). Returns the jsonl path."""
    folder = tmp_path / work / "ms:" / "modelscope" / "gsm8k"
    folder.mkdir(parents=True)
    path = folder / "train.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            q, r = ROWS[i % len(ROWS)]
            answer = r.replace("{{NAME}}", NAME).replace("{{AUTHOR}}", AUTHOR) + f" #### {i}"
            f.write(json.dumps({"question": q, "answer": answer}) + "\n")
    return str(path)


def _gkd_runs(tmp_path, nprocs, teacher, lr, work):
    student = _weights_folder(tmp_path, "student", seed=1)
    teacher = student if teacher == "student" else _weights_folder(tmp_path, "teacher", seed=2)
    data = _gsm8k(tmp_path, 44, work)
    port = _run_port(tmp_path, "gkd_off_policy.py", nprocs, [
        "--student-model-id", student, "--teacher-model-id", teacher, "--model-gpus", str(nprocs),
        "--sampler-gpus", str(nprocs), "--batch-size", "4", "--max-steps", "11", "--lr", str(lr),
        "--gkd-beta", "0.5", "--gkd-temperature", "1.0", "--gkd-topk", "8"], work=work)
    logged = [ast.literal_eval(m) for m in re.findall(r"\[Step \d+/\d+\] (\{.*\})", port["output"])]
    spec = {"model_dir": student, "data": data, "system": GKD_SYSTEM, "runs": [{
        "kind": "gkd", "name": "hand", "mesh": {"dp_size": nprocs}, "teacher_dir": teacher, "samples": 44,
        "batch_size": 4, "max_steps": 11, "lr": lr, "beta": 0.5, "temperature": 1.0, "topk": 8,
        "save_dir": str(tmp_path / "hand-final")}]}
    res, rcs, logs, _ = launch(nprocs, spec, str(tmp_path / "hand"), timeout=300, script=WORKER)
    assert rcs == [0] * nprocs and all(r is not None for r in res), "\n".join(l[-3000:] for l in logs)
    hand = res[0]["hand"]
    assert hand["ok"], hand.get("traceback")
    return port, logged, hand


@pytest.mark.multiprocess
def test_gkd_off_policy_port_trains_as_the_hand_written_run(tmp_path, upstream_stack):
    """cookbook/rl/gkd/gkd_off_policy.py with DP2 on 2 ranks, 11 steps of 4 samples (2 per rank):
    the teacher's top-k prompt log-probs from TransformersSampler (upstream's vLLM call, its
    rolled-by-1 alignment and padding) train the student LoRA exactly as the hand-written run that
    takes the top-k from a plain transformers forward in this package's alignment: the same logged
    metrics at step 10 and the same adapter weights at the end, bit for bit."""
    from safetensors.torch import load_file
    port, logged, hand = _gkd_runs(tmp_path, 2, "teacher", 1e-3, "port")
    assert len(logged) == 1 and len(hand["metrics"]) == 1, port["output"][-3000:]
    for key in ("loss", "grad_norm", "lr", "num_tokens", "teacher_mass"):
        assert logged[0][key] == hand["metrics"][0][key], (key, logged[0][key], hand["metrics"][0][key])
    assert hand["losses"][-1] < hand["losses"][0]        # it trained
    got = load_file(str(tmp_path / "port" / "output" / "gkd-offpolicy-final" / "adapter_model.safetensors"))
    want = load_file(str(tmp_path / "hand-final" / "adapter_model.safetensors"))
    assert sorted(got) == sorted(want) and all(got[k].equal(want[k]) for k in want)


@pytest.mark.multiprocess
def test_gkd_off_policy_port_with_the_student_as_its_own_teacher_has_no_loss(tmp_path, upstream_stack):
    """The student as its own teacher: the port's loss (its step-10 metric, lr 1e-9 so that the
    student stays itself) is zero up to the student's bf16 against the teacher's float32 forward
    (measured 3.7e-7), as is the hand-written run's first loss; the same top-k in upstream's
    rolled alignment given under this package's key (the rename alone) gives a loss over 1e-3."""
    port, logged, hand = _gkd_runs(tmp_path, 1, "student", 1e-9, "port")
    assert len(logged) == 1, port["output"][-3000:]
    assert logged[0]["loss"] < 1e-5 and hand["aligned_loss"] < 1e-5 and hand["losses"][0] < 1e-5, (logged, hand)
    assert hand["misaligned_loss"] > 1e-3, hand
    assert logged[0]["loss"] == hand["metrics"][0]["loss"]


# ---- GRPO: sampling with TransformersSampler, the adapter synced every batch ---------------------

GSM8K_SYSTEM = ('You are a helpful math assistant. Solve the problem step by step '
                'and put your final answer within \\boxed{}.')      # GSM8KProcessor's default system prompt
# the 12 modules grpo.py's LoraConfig names (Qwen3.5's attention, MLP and Gated DeltaNet projections)
GRPO_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"]
# a vocabulary where an untrained model's completions often hold an answer: '####', digits and
# boxed digits are words, so that rewards vary within a group and GRPO has advantages to train on
GRPO_WORDS = WORDS[:12] + ["####"] + [str(i) for i in range(5)] + ["\\boxed{%d}" % i for i in range(5)]
GRPO_WORDS = GRPO_WORDS + [f"w{i}" for i in range(32 - len(GRPO_WORDS))]


@pytest.mark.multiprocess
def test_grpo_port_trains_as_the_hand_written_run(tmp_path, upstream_stack):
    """cookbook/rl/grpo/grpo.py (the Megatron strategy) with DP2 on 2 ranks: a tiny Qwen3.5 with a
    LoRA on its 12 attention / MLP / Gated DeltaNet projections, 2 batches of 4 prompts (2 per
    rank), 4 generations each, sampled by TransformersSampler (seed 42 + rank, as upstream's
    engine) after CheckpointEngineManager.sync_weights(merge_and_sync=False); rewards from
    upstream's GSM8K functions, group-normalised advantages, GRPO steps of 4 completions
    (micro-batches of 2). The hand-written run (its own chat-template prompts, rewards and
    advantages, twinkle_megatron's GRPOLoss) logs the same loss, grad norm, lr and token counts at
    every step and saves the same adapter, bit for bit: the same completions were sampled from
    the same synced weights."""
    from safetensors.torch import load_file
    model_dir = _qwen3_5_folder(tmp_path, words=GRPO_WORDS, vocab_size=len(GRPO_WORDS))
    folder = tmp_path / "port" / "ms:" / "modelscope" / "gsm8k"     # where the script's dataset id points (see _gsm8k)
    folder.mkdir(parents=True)
    data = folder / "train.jsonl"
    with open(data, "w") as f:
        for i in range(8):
            f.write(json.dumps({"question": "what is a", "answer": f"a is #### {i % 5}"}) + "\n")
    port = _run_port(tmp_path, "grpo.py", 2, [
        "--model-id", model_dir, "--model-gpus", "2", "--sampler-gpus", "2", "--num-generations", "4",
        "--max-tokens", "12", "--batch-size", "4", "--mini-batch-size", "4", "--micro-batch-size", "2",
        "--max-steps", "4", "--lr", "1e-3", "--save-steps", "50"])
    logged = [ast.literal_eval(m) for m in re.findall(r"\[Step \d+/\d+\] (\{.*\})", port["output"])]
    spec = {"model_dir": model_dir, "data": str(data), "system": GSM8K_SYSTEM, "runs": [{
        "kind": "grpo", "name": "hand", "mesh": {"dp_size": 2}, "targets": GRPO_TARGETS, "lr": 1e-3,
        "max_steps": 4, "batch_size": 4, "generations": 4, "max_tokens": 12, "mini_batch": 4, "micro_batch": 2,
        "save_dir": str(tmp_path / "hand-final")}]}
    res, rcs, logs, _ = launch(2, spec, str(tmp_path / "hand"), timeout=300, script=WORKER)
    assert rcs == [0, 0] and all(r is not None for r in res), "\n".join(l[-3000:] for l in logs)
    hand = res[0]["hand"]
    assert hand["ok"], hand.get("traceback")
    assert len(logged) == 3 and len(hand["metrics"]) == 3, port["output"][-3000:]
    for got, want in zip(logged, hand["metrics"]):
        for key in ("loss", "grad_norm", "lr", "num_tokens", "clip_frac"):
            assert got[key] == want[key], (key, got[key], want[key])
    assert any(m["grad_norm"] > 0 for m in logged)        # rewards varied: it trained
    got = load_file(str(tmp_path / "port" / "output" / "grpo-gsm8k-checkpoint" / "adapter_model.safetensors"))
    want = load_file(str(tmp_path / "hand-final" / "adapter_model.safetensors"))
    assert sorted(got) == sorted(want) and all(got[k].equal(want[k]) for k in want)
