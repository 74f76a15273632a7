"""One rank of the hand-written runs that tests/megatron/test_upstream_ports.py compares the ports of upstream's
cookbook (examples/upstream/) with: the same steps written against twinkle_megatron directly, with
this package's own encoding (``set_template`` on the model's folder and ``messages`` inputs) in place
of upstream's Template, Dataset and DataLoader.

spec: ``model_dir``, ``data`` (the self-cognition jsonl), ``name`` / ``author`` (its placeholders'
values), and per run ``mesh`` (from_sizes keywords), ``samples``, ``batch_size``, ``lr``, ``warmup``,
``eval_samples``, ``eval_steps`` (steps after which the port evaluates), ``lora`` (LoraConfig
keywords). Records each step's ``calculate_metric()`` loss and grad norm and each evaluation's loss.
``kind`` "dpo" (dpo_multi_lora.py) and "gkd" (gkd_off_policy.py: ``data`` GSM8K rows, ``system``, per
run ``teacher_dir``, ``topk``, ``beta``, ``temperature``, ``max_steps``, ``save_dir``) are other loops.
"""
import json
import math
import os
import re

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import twinkle_megatron as tm  # noqa: E402
from tests.megatron_workers.serve import serve  # noqa: E402


def conversations(spec, n):
    """Upstream's SelfCognitionProcessor, written out: a system turn, the query, the response, with
    {{NAME}} / {{AUTHOR}} filled in."""
    rows = [json.loads(line) for line in open(spec["data"]) if line.strip()][:n]

    def fill(text):
        return text.replace("{{NAME}}", spec["name"]).replace("{{AUTHOR}}", spec["author"])
    return [[{"role": "system", "content": "You are a helpful assistant."},
             {"role": "user", "content": fill(r["query"])},
             {"role": "assistant", "content": fill(r["response"])}] for r in rows]


def dpo_pairs(spec, n):
    """Upstream's EmojiDPOProcessor, written out: (chosen, rejected) conversations of a system turn,
    the prompt and each answer."""
    rows = [json.loads(line) for line in open(spec["data"]) if line.strip()][:n]
    system = {"role": "system", "content": "You are a helpful assistant."}
    return [[[system, {"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r[key]}]
             for key in ("answer_zh", "answer_en")] for r in rows]


def run_dpo(run, spec):
    """dpo_multi_lora.py's loop: per batch of pairs, this rank's contiguous share (upstream's
    DataLoader split), chosen / rejected interleaved, the base model's logps as the reference, a
    step per call with gradient accumulation over ``accumulation`` calls, metrics every
    ``accumulation`` calls."""
    import torch
    from peft import LoraConfig
    from twinkle_megatron.training.losses import DPOLoss
    from twinkle_megatron.training.metrics import DPOMetric
    mesh = tm.DeviceMesh.from_sizes(**run["mesh"])
    tm.initialize(mesh)
    try:
        name, k = "default_0", run["accumulation"]
        model = tm.MegatronModel(spec["model_dir"], device_mesh=mesh)
        model.set_template(spec["model_dir"])
        model.add_adapter_to_model(name, LoraConfig(**run["lora"]), gradient_accumulation_steps=k)
        model.set_optimizer("default", lr=run["lr"], weight_decay=0.01, adapter_name=name)
        model.set_lr_scheduler("default", lr_decay_steps=run["decay_steps"], adapter_name=name)
        model.set_loss(DPOLoss(beta=0.1, loss_type="sigmoid", sft_weight=1.0), adapter_name=name)
        model.add_metric(DPOMetric, beta=0.1, adapter_name=name)
        pairs = dpo_pairs(spec, run["samples"])
        bs, dp = run["batch_size"], model.data_parallel_rank
        batches = [pairs[i:i + bs] for i in range(0, len(pairs) - bs + 1, bs)]   # the last partial one dropped
        # torch's DataLoader draws its iterator's base seed from the global generator, and the LoRA
        # dropout masks come after that draw: the same draw here
        torch.empty((), dtype=torch.int64).random_()
        logged = []
        for i, batch in enumerate(batches, start=1):
            share = batch[mesh.get_slice(len(batch), dp)]
            inputs = [{"messages": c} for pair in share for c in pair]
            ref = model.forward_only(inputs=inputs, adapter_name=None)
            model.forward_backward(inputs=inputs, ref_logps=ref["logps"], adapter_name=name)
            model.clip_grad_and_step(adapter_name=name)
            if i % k == 0:
                logged.append(model.calculate_metric(is_training=True, adapter_name=name))
        return {"ok": True, "metrics": logged}
    finally:
        tm.shutdown()


def gsm8k_conversations(spec, n):
    """Upstream's GSM8KProcessor(system=..., add_assistant=True), written out: the system prompt,
    the question, the reference answer."""
    rows = [json.loads(line) for line in open(spec["data"]) if line.strip()][:n]
    return [[{"role": "system", "content": spec["system"]}, {"role": "user", "content": r["question"]},
             {"role": "assistant", "content": r["answer"]}] for r in rows]


def teacher_topk(teacher, ids_list, k):
    """The teacher's top-k per position of each sequence, aligned as this package's
    ``teacher_topk_logps`` (position t: the distribution of token t, from a plain transformers
    forward of the unpadded sequence; position 0 and the padding zeros), padded to the longest:
    ``([B, S, k] float32, [B, S, k] int64)``."""
    import torch
    longest = max(len(ids) for ids in ids_list)
    logps = torch.zeros(len(ids_list), longest, k)
    index = torch.zeros(len(ids_list), longest, k, dtype=torch.long)
    with torch.no_grad():
        for b, ids in enumerate(ids_list):
            lp = torch.log_softmax(teacher(input_ids=torch.tensor([ids])).logits[0].float(), -1)
            vals, idx = lp[:-1].topk(k, -1)
            logps[b, 1:len(ids)], index[b, 1:len(ids)] = vals, idx
    return logps, index


def run_gkd(run, spec):
    """gkd_off_policy.py's loop: per batch, this rank's contiguous share (upstream's DataLoader
    split), the teacher's top-k from a plain transformers forward of the teacher folder, GKD on
    the student's LoRA; metrics at steps 10, 20, ...; the adapter saved at the end. Also, on the
    base model (the student as it started): the first batch's loss with the teacher aligned as
    here, and with upstream's rolled top-k passed under this package's key (the silent
    misalignment the alias exists for)."""
    import torch
    import transformers
    from peft import LoraConfig
    from twinkle_megatron.training.losses import GKDLoss
    mesh = tm.DeviceMesh.from_sizes(**run["mesh"])
    tm.initialize(mesh)
    try:
        model = tm.MegatronModel(spec["model_dir"], device_mesh=mesh)
        model.add_adapter_to_model("default", LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05,
                                                         target_modules="all-linear"))
        model.set_optimizer("default", lr=run["lr"])
        model.set_lr_scheduler("default", lr_decay_steps=run["max_steps"])
        model.set_loss(GKDLoss(beta=run["beta"], temperature=run["temperature"]))
        template = model.set_template(spec["model_dir"])
        teacher = transformers.AutoModelForCausalLM.from_pretrained(run["teacher_dir"], dtype=torch.float32).eval()
        convs = gsm8k_conversations(spec, run["samples"])
        bs, dp = run["batch_size"], model.data_parallel_rank
        batches = [convs[i:i + bs] for i in range(0, len(convs) - bs + 1, bs)]
        k = run["topk"]

        def encoded(batch):
            share = batch[mesh.get_slice(len(batch), dp)]
            return [template.encode(c) for c in share]
        # torch's DataLoader draws its iterator's base seed from the global generator, and the LoRA
        # dropout masks come after that draw: the same draw here
        torch.empty((), dtype=torch.int64).random_()
        logged, losses = [], []
        for step, batch in enumerate(batches[:run["max_steps"]]):
            inputs = encoded(batch)
            lps, idx = teacher_topk(teacher, [e["input_ids"] for e in inputs], k)
            out = model.forward_backward(inputs=inputs, teacher_topk_logps=lps, teacher_topk_indices=idx)
            losses.append(float(out["loss"]))
            model.clip_grad_and_step()
            if step > 0 and step % 10 == 0:
                logged.append(model.calculate_metric(is_training=True))
        model.save(run["save_dir"])
        # the alignment check, after the run compared (a forward_only before it changes the run: it
        # advances torch's global generator, which the LoRA dropout masks are drawn from), on a
        # fresh model from the student's folder: the student as it started (its LoRA's B is zero)
        probe = tm.MegatronModel(spec["model_dir"], device_mesh=mesh)
        probe.set_loss(GKDLoss(beta=run["beta"], temperature=run["temperature"]))
        first = encoded(batches[0])
        lps, idx = teacher_topk(teacher, [e["input_ids"] for e in first], k)
        aligned = probe.forward_only(inputs=first, teacher_topk_logps=lps,
                                     teacher_topk_indices=idx)["loss"]
        # upstream's rolled top-k under this package's key; each row's last token (where the roll
        # brings the padding's or position 0's zeros: k probabilities of 1, which the facade
        # refuses) given a valid distribution so that the loss is computed
        rolled, rolled_idx = torch.roll(lps, -1, 1), torch.roll(idx, -1, 1)
        for b, e in enumerate(first):
            rolled[b, len(e["input_ids"]) - 1] = -math.log(k)
            rolled_idx[b, len(e["input_ids"]) - 1] = torch.arange(k)
        misaligned = probe.forward_only(inputs=first, teacher_topk_logps=rolled,
                                        teacher_topk_indices=rolled_idx)["loss"]
        return {"ok": True, "metrics": logged, "losses": losses, "aligned_loss": float(aligned),
                "misaligned_loss": float(misaligned)}
    finally:
        tm.shutdown()


def gsm8k_rewards(completion: str, truth: str) -> float:
    """grpo.py's reward, written out: format (a ``\\boxed{...}`` or ``#### <number>`` answer) plus
    accuracy (the last boxed answer, else the last ``####`` one, equal to the ground truth)."""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", completion)
    hashed = re.findall(r"####\s*([\-\d,\.\s]+)", completion)
    has_format = bool(boxed and boxed[-1].strip()) or bool(re.search(r"####\s*[\-\d,\.]+", completion))
    answer = boxed[-1] if boxed and boxed[-1].strip() else (hashed[-1] if hashed else "")
    answer = answer.replace(",", "").replace(" ", "").strip()
    correct = False
    if answer and truth:
        try:
            correct = abs(float(answer) - float(truth)) < 1e-5
        except ValueError:
            correct = answer == truth
    return float(has_format) + float(correct)


def run_grpo(run, spec):
    """grpo.py's loop (its Megatron strategy): per batch, this rank's contiguous share of the
    prompts (upstream's DataLoader split), the adapter synced into a TransformersSampler, each
    prompt sampled ``generations`` times (one input each, as the script expands them), rewards and
    group-normalised advantages, then GRPO steps of ``mini_batch`` completions; metrics after each
    step; the adapter saved at the end. Prompts are the chat template's with a generation prompt."""
    import torch
    from peft import LoraConfig
    from twinkle_megatron.sampling import CheckpointEngineManager, SamplingParams, TransformersSampler
    from twinkle_megatron.training.losses import GRPOLoss
    mesh = tm.DeviceMesh.from_sizes(**run["mesh"])
    tm.initialize(mesh)
    try:
        model = tm.MegatronModel(spec["model_dir"], device_mesh=mesh, mixed_precision="bf16")
        model.add_adapter_to_model("default", LoraConfig(target_modules=run["targets"], r=32, lora_alpha=64,
                                                         lora_dropout=0.05), gradient_accumulation_steps=1)
        model.set_optimizer("default", lr=run["lr"])
        model.set_lr_scheduler("default", lr_decay_steps=run["max_steps"], max_lr=run["lr"])
        model.set_loss(GRPOLoss(epsilon=0.2))
        sampler = TransformersSampler(spec["model_dir"], engine_args={"max_lora_rank": 32, "enable_lora": True})
        manager = CheckpointEngineManager(model=model, sampler=sampler)
        tokenizer = model.set_template(spec["model_dir"]).tokenizer
        rows = [json.loads(line) for line in open(spec["data"]) if line.strip()]
        prompts = [(tokenizer.apply_chat_template([{"role": "system", "content": spec["system"]},
                                                   {"role": "user", "content": r["question"]}],
                                                  add_generation_prompt=True, tokenize=True, return_dict=False),
                    r["answer"].split("####")[-1].strip()) for r in rows]
        bs, g, dp = run["batch_size"], run["generations"], model.data_parallel_rank
        batches = [prompts[i:i + bs] for i in range(0, len(prompts) - bs + 1, bs)]
        torch.empty((), dtype=torch.int64).random_()     # the DataLoader's draw (see run_dpo)
        params = SamplingParams(max_tokens=run["max_tokens"], num_samples=1, logprobs=1)
        logged, step = [], 0
        for batch in batches:
            if step >= run["max_steps"]:
                break
            manager.sync_weights(merge_and_sync=False)
            share = batch[mesh.get_slice(len(batch), dp)]
            expanded = [p for p in share for _ in range(g)]
            responses = sampler.sample([{"input_ids": list(ids)} for ids, _ in expanded], params)
            inputs, old, rewards = [], [], []
            for (ids, truth), resp in zip(expanded, responses):
                (seq,) = resp.sequences
                inputs.append({"input_ids": list(ids) + seq.tokens, "labels": [-100] * len(ids) + seq.tokens})
                old.append([lp[0][1] for lp in seq.logprobs])
                rewards.append(gsm8k_rewards(tokenizer.decode(seq.tokens, skip_special_tokens=True), truth))
            grouped = torch.tensor(rewards, dtype=torch.float32).view(-1, g)
            advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-8)).view(-1)
            advantages = advantages.tolist()
            for start in range(0, len(inputs), run["mini_batch"]):
                end = start + run["mini_batch"]
                model.forward_backward(inputs=inputs[start:end], old_logps=old[start:end],
                                       advantages=advantages[start:end], micro_batch_size=run["micro_batch"])
                model.clip_grad_and_step()
                step += 1
                if step >= run["max_steps"]:
                    break
                logged.append(model.calculate_metric(is_training=True))
        model.save(run["save_dir"])
        return {"ok": True, "metrics": logged}
    finally:
        tm.shutdown()


def run_one(run, spec):
    if run.get("kind") == "dpo":
        return run_dpo(run, spec)
    if run.get("kind") == "gkd":
        return run_gkd(run, spec)
    if run.get("kind") == "grpo":
        return run_grpo(run, spec)
    import torch
    from peft import LoraConfig
    mesh = tm.DeviceMesh.from_sizes(**run["mesh"])
    tm.initialize(mesh)
    try:
        model = tm.MegatronModel(spec["model_dir"], device_mesh=mesh)
        model.set_template(spec["model_dir"])
        model.add_adapter_to_model("default", LoraConfig(**run["lora"]))
        model.set_optimizer("default", lr=run["lr"])
        train = conversations(spec, run["samples"])
        bs = run["batch_size"]
        batches = [train[i:i + bs] for i in range(0, len(train), bs)]
        model.set_lr_scheduler("default", lr_warmup_steps=run["warmup"], lr_decay_steps=len(batches))
        losses, norms, evals = [], [], []
        # torch's DataLoader draws its iterator's base seed from the global generator, which the LoRA
        # dropout masks come from too: the port's draws, once for training and once per evaluation
        torch.empty((), dtype=torch.int64).random_()
        dp = model.data_parallel_rank
        tokens = []
        for step, batch in enumerate(batches):
            # this rank's contiguous share, as upstream's DataLoader splits a batch over the DP ranks
            model.forward_backward(inputs=[{"messages": c} for c in batch[mesh.get_slice(len(batch), dp)]])
            model.clip_grad_and_step()
            m = model.calculate_metric(is_training=True)
            losses.append(m["loss"])
            norms.append(m["grad_norm"])
            tokens.append(m["num_tokens"])
            if step in run["eval_steps"]:
                torch.empty((), dtype=torch.int64).random_()
                held = conversations(spec, run["eval_samples"])
                for i in range(0, len(held), bs):
                    part = held[i:i + bs]
                    model.forward_only(inputs=[{"messages": c} for c in part[mesh.get_slice(len(part), dp)]])
                evals.append(model.calculate_metric(is_training=False)["loss"])
        return {"ok": True, "losses": losses, "grad_norms": norms, "eval_losses": evals, "num_tokens": tokens,
                "sp": model.mesh.sequence_parallel}
    finally:
        tm.shutdown()


if __name__ == "__main__":
    serve(run_one)
