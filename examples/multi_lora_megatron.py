"""Three tenants on one base model, trained together in mixed batches (CPU/gloo by default).

    python examples/multi_lora_megatron.py                 # 2 processes, data parallel 2
    python examples/multi_lora_megatron.py --tp 2          # 2 processes, tensor parallel 2 (+ SP)
    torchrun --nproc_per_node 2 examples/multi_lora_megatron.py

One randomly initialised tiny Qwen3 (transformers' initialisation with ``--init-std``: at megatron's
0.02 the frozen random LM head cannot make confident predictions; it knows none of the tasks;
every rank builds the same one from the seed) carries three LoRA adapters, one
per embedded task of ``twinkle_megatron.job.data``: ``add`` (``417+96=513``), ``sort``
(``sort 5 1 4>1 4 5``) and ``brackets`` (``([{|}])``). Every step is ONE
``forward_backward(inputs=batch, adapter_names=[...])``: each row is one task line of one tenant,
the rows of all three tenants are mixed in the batch, the base model's forward and backward run
once, and each adapter gets exactly the gradient of its own rows (normalised over its own tokens).
``clip_grad_and_step()`` then steps all three, each with its own optimizer.

At the end it prints a 3 x 3 table: each adapter's greedy accuracy on each task's held-out lines
(the fraction of answer tokens, the part after ``=`` / ``>`` / ``|`` and the end token, whose
argmax prediction given the line so far is right). Each adapter is good at its own task only.
"""
import argparse
import os
import random
import sys

import torch

TENANTS = {"add": "addition", "sort": "sorting", "brackets": "brackets"}
SEPARATORS = {"addition": "=", "sorting": ">", "brackets": "|"}


def encode(task: str, rng: random.Random, length: int):
    """One task line as (input_ids, labels) [length]: labels on the answer and the end token only."""
    from twinkle_megatron.job.data import BOS, EOS, PAD, TASKS, ByteTokenizer
    tok = ByteTokenizer()
    line = TASKS[task](rng)
    cut = line.index(SEPARATORS[task]) + 1
    prompt = [BOS] + tok.encode(line[:cut], add_special=False)
    answer = tok.encode(line[cut:], add_special=False) + [EOS]
    ids = (prompt + answer)[:length]
    labels = ([-100] * len(prompt) + answer)[:length]
    pad = length - len(ids)
    return torch.tensor(ids + [PAD] * pad), torch.tensor(labels + [-100] * pad)


def task_batch(task: str, n: int, seed: int, length: int):
    rng = random.Random(seed)
    rows = [encode(task, rng, length) for _ in range(n)]
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


@torch.no_grad()
def accuracy(model, adapter: str, ids: torch.Tensor, labels: torch.Tensor) -> float:
    """Greedy next-token accuracy of ``adapter`` on the answer tokens (labels != -100)."""
    from twinkle_megatron.job.data import ByteTokenizer
    logits = model.logits(ids, adapter_name=adapter)[:, :-1, :ByteTokenizer().vocab_size]
    target = labels[:, 1:]
    mask = target != -100
    return float(((logits.argmax(-1) == target) & mask).sum() / mask.sum())


def random_base(std: float, seed: int) -> str:
    """A directory with a randomly initialised tiny Qwen3 (HF format), the same on every rank (each
    writes its own copy: transformers' save_pretrained would write on rank 0 only)."""
    import json
    import tempfile
    import transformers
    from safetensors.torch import save_file
    from twinkle_megatron.job.configs import tiny_qwen3_config
    torch.manual_seed(seed)
    config = {k: v for k, v in tiny_qwen3_config(num_layers=2).items() if k not in ("architectures", "model_type")}
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config, initializer_range=std))
    path = tempfile.mkdtemp(prefix="multi_lora_base_")
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(hf.config.to_dict(), architectures=["Qwen3ForCausalLM"]), f)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (the rest is data parallel)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rows", type=int, default=8, help="rows per tenant per step (global)")
    p.add_argument("--length", type=int, default=24)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank of each adapter")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--eval-rows", type=int, default=64)
    p.add_argument("--init-std", type=float, default=0.1, help="initializer_range of the random base")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if "RANK" not in os.environ:
        from twinkle_megatron.parallel.launch import free_port, supervise
        if args.nproc > 1:
            env = dict(os.environ, TORCHDYNAMO_DISABLE="1")
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
            return supervise([os.path.abspath(__file__), *(sys.argv[1:] if argv is None else argv)],
                             args.nproc, env=env, name="multi_lora")
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    import twinkle_megatron as tm

    mesh = tm.DeviceMesh.from_sizes(tp_size=args.tp, sequence_parallel=args.tp > 1)
    tm.initialize(mesh, seed=args.seed)
    model = tm.MegatronModel(random_base(args.init_std, args.seed), device_mesh=mesh, mixed_precision="fp32",
                             seed=args.seed)
    for name in TENANTS:
        model.add_adapter_to_model(name, {"r": args.rank, "lora_alpha": 2 * args.rank,
                                          "target_modules": "all-linear"})
        model.set_optimizer("AdamW", lr=args.lr, weight_decay=0.0, adapter_name=name)
        model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=5, num_training_steps=args.steps,
                               adapter_name=name)
    rank0 = int(os.environ["RANK"]) == 0
    dp, dps = model.data_parallel_rank, mesh.dp_size
    if args.rows % dps:
        raise SystemExit(f"--rows={args.rows} is not divisible by the data-parallel size {dps}")
    share = args.rows // dps
    for step in range(args.steps):
        ids, labels, names = [], [], []
        for k, (name, task) in enumerate(TENANTS.items()):
            i, l = task_batch(task, args.rows, seed=10_000 * step + k, length=args.length)
            ids.append(i[dp * share:(dp + 1) * share])
            labels.append(l[dp * share:(dp + 1) * share])
            names += [name] * share
        order = torch.randperm(len(names), generator=torch.Generator().manual_seed(step))   # mixed rows
        batch = {"input_ids": torch.cat(ids)[order], "labels": torch.cat(labels)[order]}
        out = model.forward_backward(inputs=batch, adapter_names=[names[i] for i in order.tolist()])
        norms = model.clip_grad_and_step(max_grad_norm=1.0)
        if rank0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step + 1:3d}  " + "  ".join(f"{n}: loss {out[n]['loss']:.3f} |g| {norms[n]:.2f}"
                                                      for n in TENANTS), flush=True)
    table = {}
    for name in TENANTS:
        for task in TENANTS.values():
            ids, labels = task_batch(task, args.eval_rows, seed=999_999 + len(task), length=args.length)
            table[name, task] = accuracy(model, name, ids, labels)
    if rank0:
        print("\ngreedy accuracy on the answer tokens (rows: adapter, columns: task)")
        print(f"{'':10s}" + "".join(f"{t:>11s}" for t in TENANTS.values()))
        for name in TENANTS:
            print(f"{name:10s}" + "".join(f"{table[name, t]:11.2f}" for t in TENANTS.values()), flush=True)
    tm.shutdown()
    own = [table[n, t] for n, t in TENANTS.items()]
    others = [table[n, t] for n in TENANTS for t in TENANTS.values() if TENANTS[n] != t]
    if rank0:
        print(f"own task: min {min(own):.2f}; other tasks: max {max(others):.2f}", flush=True)
    return table


if __name__ == "__main__":
    result = main()
    sys.exit(result if isinstance(result, int) else 0)
