"""On-policy distillation (GKD) with two MegatronModels on one mesh: the student samples, the teacher
scores the samples' top-k, the student trains on them.

Each step:

1. the student's current weights are synced into its transformers replica
   (``twinkle_megatron.weight_sync.HFSampler``, KV-cache decoding) and the replica samples a
   completion for each prompt (temperature 1);
2. the teacher scores prompt + completion with ``forward_only(return_topk=k)``: its top-k
   log-probs and ids per position, aligned as ``logps`` (no ``[tokens, V]`` logits with
   ``fused_linear_ce``); with ``--teacher logits``, its full-vocabulary ``logits`` instead;
3. before training on them, the student's reverse KL to the teacher, ``KL(student || teacher)``,
   is measured on the completion tokens: over the teacher's top-k support with both sides
   renormalised there (what GKD with the top-k and beta = 1 minimises), and over the whole
   vocabulary (both models' ``logits``);
4. the student trains with ``set_loss("gkd", beta, temperature)`` on the teacher's top-k
   (``teacher_topk_logps`` / ``teacher_topk_indices``) or its full logits (``teacher_logits``).

Top-k GKD renormalises both sides over the teacher's k ids: it shapes the student inside that
support but does not push the student's mass off the other ids, so the full-vocabulary reverse KL
of a near-uniform student falls much more slowly than the top-k one (``--teacher logits`` trains
on the whole vocabulary).

The teacher is the embedded tiny Qwen3 first trained with cross entropy on a toy language (each
next token a fixed function of the previous one, with some noise) so that it differs from the
randomly initialised student. The curve (step, reverse KL, GKD loss) is written as CSV and
Markdown into ``--out-dir``.

    python examples/gkd_distill_megatron.py --steps 30 --out-dir benchmarks/results
    torchrun --nproc_per_node 2 examples/gkd_distill_megatron.py --tp 2
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import time

import torch

LANG_LO, LANG_N = 10, 40          # the toy language's tokens: [10, 50)


def language_batch(g: torch.Generator, rows: int, length: int, noise: float = 0.1) -> torch.Tensor:
    """[rows, length] int64: x_{t+1} = LANG_LO + (7 x_t + 3) mod LANG_N, a random token with
    probability ``noise``."""
    x = torch.empty(rows, length, dtype=torch.long)
    x[:, 0] = torch.randint(LANG_LO, LANG_LO + LANG_N, (rows,), generator=g)
    for t in range(1, length):
        nxt = LANG_LO + (7 * x[:, t - 1] + 3) % LANG_N
        rnd = torch.randint(LANG_LO, LANG_LO + LANG_N, (rows,), generator=g)
        x[:, t] = torch.where(torch.rand(rows, generator=g) < noise, rnd, nxt)
    return x


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor,
               topk_ids: torch.Tensor) -> tuple:
    """(top-k, full) means over the positions where ``mask`` [B, S] is True of KL(student ||
    teacher) of the next-token distributions predicting them, at temperature 1: over the
    teacher's ``topk_ids`` [B, S, k] (aligned as logps) with both sides renormalised there, and
    over the whole vocabulary. The logits are ``[B, S, V]`` as the models return them."""
    zs = student_logits.double()[:, :-1]                # position t - 1 predicts token t
    zt = teacher_logits.double()[:, :-1]
    m = mask[:, 1:]
    s, t = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    full = (s.exp() * (s - t)).sum(-1)[m].mean()
    ids = topk_ids[:, 1:]
    sk = torch.log_softmax(zs.gather(-1, ids), -1)
    tk = torch.log_softmax(zt.gather(-1, ids), -1)
    top = (sk.exp() * (sk - tk)).sum(-1)[m].mean()
    return float(top), float(full)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--teacher-steps", type=int, default=40, help="cross-entropy steps of the teacher first")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--k", type=int, default=16, help="the teacher's top-k")
    p.add_argument("--teacher", choices=("topk", "logits"), default="topk",
                   help="what the teacher gives: its top-k log-probs, or its full-vocabulary logits")
    p.add_argument("--beta", type=float, default=1.0, help="GKD's beta (1: KL(student || teacher))")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=2e-2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=None, help="write the curve (CSV and Markdown) here")
    p.add_argument("--name", default=None, help="file name stem (default gkd_distill_<date>)")
    a = p.parse_args(argv)

    if "RANK" not in os.environ:      # one process without torchrun
        from twinkle_megatron.parallel.launch import free_port
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    import twinkle_megatron as tm
    from twinkle_megatron.job.configs import tiny_qwen3_config
    from twinkle_megatron.weight_sync import HFSampler, sync

    mesh = tm.DeviceMesh.from_sizes(tp_size=a.tp)
    tm.initialize(mesh)
    start = time.perf_counter()
    try:
        teacher = tm.MegatronModel(model_id=tiny_qwen3_config(num_layers=2), device_mesh=mesh,
                                   mixed_precision="fp32", fused_linear_ce=True, seed=a.seed + 1)
        teacher.set_optimizer(optimizer_cls="AdamW", lr=3e-3)
        g = torch.Generator().manual_seed(a.seed)
        for _ in range(a.teacher_steps):
            ids = language_batch(g, 8, 24)
            teacher.forward_backward(inputs={"input_ids": ids, "labels": ids})
            teacher.clip_grad_and_step(max_grad_norm=1.0)
        student = tm.MegatronModel(model_id=tiny_qwen3_config(num_layers=2), device_mesh=mesh,
                                   mixed_precision="fp32", fused_linear_ce=True, seed=a.seed)
        student.set_optimizer(optimizer_cls="AdamW", lr=a.lr)
        student.set_loss("gkd", beta=a.beta, temperature=a.temperature)
        holder = torch.distributed.get_rank() == 0
        sampler = HFSampler.from_model(student) if holder else None
        vocab = tiny_qwen3_config()["vocab_size"]
        rows = []
        for step in range(a.steps):
            sync(student, sampler)
            prompts = language_batch(g, a.prompts, a.prompt_len)
            if holder:
                comp, _ = sampler.generate(prompts.tolist(), a.new_tokens, 1.0,
                                           torch.Generator().manual_seed(a.seed * 1000 + step), vocab_size=vocab)
                comp = torch.tensor(comp, dtype=torch.long)
            else:
                comp = torch.zeros(a.prompts, a.new_tokens, dtype=torch.long)
            torch.distributed.broadcast(comp, src=0)    # every rank trains on the same samples
            ids = torch.cat([prompts, comp], 1)
            labels = ids.clone()
            labels[:, :a.prompt_len] = -100               # the prompt: no loss
            batch = {"input_ids": ids, "labels": labels}
            top = teacher.forward_only(inputs=batch, return_topk=a.k)
            t_logits = teacher.logits(ids)
            kl_top, kl_full = reverse_kl(student.logits(ids), t_logits, labels != -100, top["topk_indices"])
            if a.teacher == "topk":
                given = {"teacher_topk_logps": top["topk_logps"], "teacher_topk_indices": top["topk_indices"]}
            else:
                given = {"teacher_logits": t_logits}
            out = student.forward_backward(inputs=batch, **given)
            student.clip_grad_and_step(max_grad_norm=1.0)
            mass = float(top["topk_logps"].double().exp().sum(-1)[labels != -100].mean())
            rows.append((step, kl_top, kl_full, out["loss"], mass))
            if holder:
                print(f"step {step}: reverse KL(student || teacher) top-{a.k} {kl_top:.4f}, full vocabulary "
                      f"{kl_full:.4f}; GKD loss {out['loss']:.4f}; teacher top-{a.k} mass {mass:.3f}", flush=True)
        wall = time.perf_counter() - start
        if holder and a.out_dir:
            write_curve(a, rows, wall)
        return rows
    finally:
        tm.shutdown()


def write_curve(a, rows, wall: float) -> None:
    os.makedirs(a.out_dir, exist_ok=True)
    stem = os.path.join(a.out_dir, a.name or f"gkd_distill_{datetime.date.today().isoformat()}")
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "reverse_kl_topk", "reverse_kl_full", "gkd_loss", "teacher_topk_mass"])
        for r in rows:
            w.writerow([r[0]] + [f"{v:.6f}" for v in r[1:]])

    def mean(col, part):
        return sum(r[col] for r in part) / len(part)
    with open(stem + ".md", "w") as f:
        f.write("# On-policy distillation (GKD): the student's reverse KL to the teacher\n\n")
        f.write(f"`python examples/gkd_distill_megatron.py --steps {a.steps} --teacher-steps {a.teacher_steps} "
                f"--prompts {a.prompts} --new-tokens {a.new_tokens} --k {a.k} --teacher {a.teacher} --beta {a.beta} "
                f"--temperature {a.temperature} --lr {a.lr} --tp {a.tp} --seed {a.seed}`; {wall:.0f} s wall.\n\n")
        f.write("Tiny Qwen3 (2 layers, hidden 128, vocabulary 259) teacher trained with cross entropy on the "
                "toy language first; the student (same shape, other seed) samples with its synced KV-cache "
                "replica, the teacher scores the samples' top-k with `forward_only(return_topk=k)`, the student "
                f"trains with `set_loss('gkd')` on them (`--teacher {a.teacher}`). Reverse KL = KL(student || "
                "teacher) at temperature 1, mean over the completion tokens of the step's samples, measured "
                "before the step trains on them: over the teacher's top-k ids with both sides renormalised "
                "there, and over the whole vocabulary.\n\n")
        for name, col in (("top-k", 1), ("full-vocabulary", 2)):
            f.write(f"{name} reverse KL: mean of the first three steps {mean(col, rows[:3]):.4f}, of the last "
                    f"three {mean(col, rows[-3:]):.4f}.\n")
        f.write("\n| step | reverse KL, top-k | reverse KL, full vocabulary | GKD loss | teacher top-k mass |\n"
                "|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r[0]} | {r[1]:.4f} | {r[2]:.4f} | {r[3]:.4f} | {r[4]:.3f} |\n")


if __name__ == "__main__":
    main()
