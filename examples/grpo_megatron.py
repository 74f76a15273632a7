"""GRPO on the embedded procedural tasks with the Megatron facade (CPU/gloo by default).

    torchrun --nproc_per_node 2 examples/grpo_megatron.py --tp 2          # tensor parallel 2
    torchrun --nproc_per_node 2 examples/grpo_megatron.py --dp 2          # data parallel 2
    python examples/grpo_megatron.py                                      # one process
    torchrun --nproc_per_node 3 examples/grpo_megatron.py --tp 2 --sampler-rank 2   # sampler process
    python examples/grpo_megatron.py --moe --router-replay R3              # MoE, the sampler's routing

The policy starts from a checkpoint briefly SFT-trained by ``twinkle_megatron.job`` (made on the
spot into ``--sft-dir`` when it is missing). Each step:

1. samples ``--group`` completions for each prompt from the current policy: by default with a
   transformers replica of the policy that decodes with a KV cache
   (``twinkle_megatron.weight_sync.HFSampler``), refreshed from ``model.get_hf_state_dict()``
   after each step's optimizer updates (with ``--lora-rank``: the base weights once, then the
   adapter alone). The replica sits on one rank per data-parallel replica (its TP rank 0), which
   hands the completions to its TP peers; with ``--sampler-rank R`` launch rank R instead runs
   one replica in a process of its own, outside the trainer's world, fed by
   ``weight_sync.TrainerSync`` / ``WeightSender`` over a process group of its own and serving
   every data-parallel rank's prompts. ``--sampler logits`` samples with the old loop instead
   (``MegatronModel.logits`` over the whole sequence for every new token, no cache: quadratic in
   length); ``--time-logits`` also runs that loop on the same prompts and seed each step, for its
   time and to check that both draw the same tokens;
2. scores them with a rule-based reward: exact answers of ``sort ...>`` and bracket tails
   (``a+b=`` with ``--tasks``), with partial credit per correct character; the prompts are drawn
   from a fixed pool (``--prompt-pool``, the training set);
3. normalises the rewards within each prompt's group (the advantages);
4. takes ``old_logps`` from ``forward_only`` and ``ref_logps`` from the frozen SFT model;
5. runs ``forward_backward`` with ``set_loss('grpo')`` and ``clip_grad_and_step``,
   ``--updates`` times over the batch (the second and later passes are off-policy, so the ratio
   clips).

MoE (``--moe``: the policy is a tiny Qwen3-MoE, 4 experts, top-2): ``--router-replay`` keeps the
trainer's experts the sampler's. ``R2``: ``forward_only(..., return_routed_experts=True)`` records
the routing of the rollout batch with the old logps, and every ``forward_backward`` of the step
replays it (the later, off-policy updates route as the first). ``R3``: the replica returns the
routing of every prompt and completion token (``generate(..., return_routed_experts=True)``) and
both the old logps and every update replay it, so the trainer's log-probs are the sampler's. ``off``
(the default): each side routes for itself, and tokens the two route differently get other logps.

Prints reward, KL to the SFT model, clip fraction, entropy, the sync and sampling times per step
and the largest difference between the replica's log-probs of the sampled tokens and the
trainer's (``old_logps``, the ones GRPO uses); ``--plot`` writes the reward curve. Each
data-parallel rank samples its own prompts.
"""
import argparse
import json
import math
import os
import random
import subprocess
import sys
import time

import torch

from twinkle_megatron import DeviceMesh, MegatronModel, shutdown
from twinkle_megatron.job.data import BOS, EOS, PAD, TASKS, ByteTokenizer
from twinkle_megatron.weight_sync import HFSampler, sync
from twinkle_megatron.weight_sync.sampler import next_tokens

TOK = ByteTokenizer()
SEPARATORS = {"addition": "=", "sorting": ">", "brackets": "|"}


def make_prompt(rng: random.Random, tasks):
    """(prompt text, answer text) of one task line, split at its separator."""
    task = rng.choice(tasks)
    line = TASKS[task](rng)
    cut = line.index(SEPARATORS[task]) + 1
    return line[:cut], line[cut:]


def reward(completion: str, answer: str) -> float:
    """1 for the exact answer; else the fraction of answer characters right in place, minus a
    little for extra characters (0 for an empty completion)."""
    if completion == answer:
        return 1.0
    hits = sum(a == b for a, b in zip(completion, answer))
    return max(0.0, hits / max(len(answer), 1) - 0.1 * max(0, len(completion) - len(answer)) / max(len(answer), 1))


def prompt_ids(prompts):
    return [[BOS] + TOK.encode(p, add_special=False) for p in prompts]


@torch.no_grad()
def sample_logits_loop(model, prompts, max_new_tokens, temperature, generator, eos=EOS):
    """Completions (token lists, EOS included when produced) sampled from the current weights by
    running ``model.logits`` over every whole sequence for each new token (no cache). Every TP
    rank draws the same tokens: the same logits and the same generator. ``eos=None``: every row
    runs ``max_new_tokens``."""
    seqs = prompt_ids(prompts)
    done = [False] * len(seqs)
    out = [[] for _ in seqs]
    for _ in range(max_new_tokens):
        longest = max(len(s) for s in seqs)
        ids = torch.tensor([s + [PAD] * (longest - len(s)) for s in seqs])
        logits = model.logits(ids)                                  # [N, L, V] fp32
        last = logits[torch.arange(len(seqs)), torch.tensor([len(s) - 1 for s in seqs])]
        tokens = next_tokens(last, temperature, generator, TOK.vocab_size)   # never a padded vocab row
        for i, t in enumerate(tokens.tolist()):
            if not done[i]:
                seqs[i].append(t)
                out[i].append(t)
                done[i] = t == eos
        if all(done):
            break
    return out


def timed(fn, *args):
    """``(fn(*args), (wall seconds, process CPU seconds))``."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args)
    return out, (time.perf_counter() - wall, time.process_time() - cpu)


class Replica:
    """The KV-cache sampler of this data-parallel replica: a transformers (peft with
    ``--lora-rank``) copy of the policy on its TP rank 0, fully synced now; :meth:`sync` after
    each step's updates sends the weights again (with LoRA: the adapter alone)."""

    def __init__(self, model, args):
        from megatron.core import parallel_state as ps
        self.model, self.args = model, args
        self.adapter = "default" if args.lora_rank else None
        self.group = ps.get_tensor_model_parallel_group() if args.tp > 1 else None
        self.src = ps.get_tensor_model_parallel_src_rank()
        # receivers="replicas" gives the stream to the TP / PP / CP rank 0 of each replica
        holder = ps.get_tensor_model_parallel_rank() == 0
        self.sampler = HFSampler.from_model(model, adapter_name=self.adapter) if holder else None
        self.first = sync(model, self.sampler, adapter_name=self.adapter, full=True)

    def sync(self):
        return sync(self.model, self.sampler, adapter_name=self.adapter, full=self.adapter is None)

    def sample(self, prompts, max_new_tokens, temperature, seed, eos=EOS):
        """``(completions, log-probs, sampler CPU seconds, routing)`` from the replica (routing: per
        row, with ``--router-replay R3``, else None); its TP peers get the same."""
        out = [None]
        if self.sampler is not None:
            cpu = time.process_time()
            got = generate(self.sampler, prompt_ids(prompts), max_new_tokens, temperature, seed, eos,
                           routing=self.args.router_replay == "R3")
            out[0] = got[:2] + (time.process_time() - cpu, got[2] if len(got) > 2 else None)
        if self.group is not None:
            import torch.distributed as dist
            dist.broadcast_object_list(out, src=self.src, group=self.group)
        return out[0]


def generate(sampler, ids, max_new_tokens, temperature, seed, eos, routing=False):
    """``(completions, logps)``, and with ``routing`` the routing of each row: int64
    ``[len(prompt) + len(completion), L_moe, k]`` per row."""
    return sampler.generate(ids, max_new_tokens, temperature, torch.Generator().manual_seed(seed),
                            eos_token_id=eos, pad_token_id=PAD, vocab_size=TOK.vocab_size,
                            return_routed_experts=routing)


def routed_batch(rows, length, top_k):
    """``routed_experts`` [N, length, L_moe, k] for a right-padded batch from per-row routings
    ``[len(row), L_moe, k]`` (:func:`generate` with ``routing=True``). Padding positions get experts
    ``0..k-1``: valid ids, and no labelled token depends on them (they come after every token of
    their row)."""
    layers = rows[0].shape[1]
    out = torch.arange(top_k).expand(len(rows), length, layers, top_k).clone()
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


# --sampler-rank: the replica in a process of its own, outside the trainer's world. Trainer rank 0
# and the sampler join two groups of their own (weight_sync.connect): one carries the weights
# (WeightSender -> WeightReceiver, a version per sync), the other the rollout requests and
# replies (pickled objects). Every reply is followed by one weight version (the sync after that
# step's updates); a stop message, then the sender's close, end the run.

def _send_obj(group, obj, peer):
    import pickle
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    group.send([torch.tensor([data.numel()], dtype=torch.int64)], peer, 0).wait()
    group.send([data], peer, 0).wait()


def _recv_obj(group, peer):
    import pickle
    n = torch.zeros(1, dtype=torch.int64)
    group.recv([n], peer, 0).wait()
    data = torch.empty(int(n), dtype=torch.uint8)
    group.recv([data], peer, 0).wait()
    return pickle.loads(data.numpy().tobytes())


def _sync_groups(rank, args):
    """The (weights, rollout) groups between trainer rank 0 (``rank=0``) and the sampler (1)."""
    import datetime
    import torch.distributed as dist
    from twinkle_megatron.weight_sync import connect
    store = dist.TCPStore(os.environ["MASTER_ADDR"], args.sampler_port, 2, rank == 0,
                          timeout=datetime.timedelta(seconds=args.sampler_timeout))
    return tuple(connect(rank, 2, store=store, prefix=f"grpo_{what}", timeout=args.sampler_timeout)
                 for what in ("weights", "rollout"))


class RemoteReplica:
    """The same interface as :class:`Replica`, with the replica on the sampler process: every
    trainer rank calls :meth:`sync` and :meth:`sample` (collectives); rank 0 talks to the
    sampler."""

    def __init__(self, model, args):
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from twinkle_megatron import lora
        from twinkle_megatron.weight_sync import TrainerSync, WeightSender
        self.args, self.adapter = args, ("default" if args.lora_rank else None)
        self.rank, self.dp = dist.get_rank(), ps.get_data_parallel_rank()
        sender = self.rollout = None
        if self.rank == 0:
            weights, self.rollout = _sync_groups(0, args)
            sender = WeightSender(weights, dst=1, timeout=args.sampler_timeout)
            _send_obj(self.rollout, {"hf_config": model.hf_config, "dtype": str(model.dtype).split(".")[-1],
                                     "adapter": self.adapter, "lora": None if self.adapter is None else
                                     lora.adapter_config_dict(model.adapters[self.adapter], None)}, 1)
        self.trainer_sync = TrainerSync(model, sender, adapter_name=self.adapter, receivers="rank0")
        self.first = self.sync()

    def sync(self):
        full = self.adapter is None or self.trainer_sync.syncs == 0
        stats = self.trainer_sync.send()
        if stats is None:   # ranks other than 0 produce their share of the stream only
            return {"tensors": 0, "bytes": 0, "seconds": 0.0, "full": full}
        return {"tensors": stats.tensors, "bytes": stats.bytes, "seconds": stats.seconds, "full": full}

    def sample(self, prompts, max_new_tokens, temperature, seed, eos=EOS):
        import torch.distributed as dist
        mine = (self.dp, prompt_ids(prompts), seed)
        every = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(mine, every, dst=0)
        reply = [None]
        if self.rank == 0:
            batches = {dp: (ids, s) for dp, ids, s in every}      # one per data-parallel rank
            _send_obj(self.rollout, {"cmd": "sample", "batches": batches, "max_new_tokens": max_new_tokens,
                                     "temperature": temperature, "eos": eos,
                                     "routing": self.args.router_replay == "R3"}, 1)
            reply[0] = _recv_obj(self.rollout, 1)
        dist.broadcast_object_list(reply, src=0)
        got = reply[0]["out"][self.dp]
        return got[0], got[1], reply[0]["cpu"], got[2] if len(got) > 2 else None

    def close(self):
        if self.rank == 0:
            _send_obj(self.rollout, {"cmd": "stop"}, 1)
            self.trainer_sync.sender.close()


def serve_sampler(args):
    """The sampler process: build the replica from the trainer's config, apply each received
    weight version, answer rollout requests until told to stop."""
    from twinkle_megatron.weight_sync import WeightReceiver
    weights, rollout = _sync_groups(1, args)
    hello = _recv_obj(rollout, 0)
    sampler = HFSampler.from_config(hello["hf_config"], dtype=getattr(torch, hello["dtype"]),
                                    lora_config=hello["lora"], adapter_name=hello["adapter"] or "default")
    receiver = WeightReceiver(weights, src=0, timeout=args.sampler_timeout)
    sampler.refresh(receiver.receive())
    print(f"sampler process: replica synced (version {receiver.version})", flush=True)
    while True:
        req = _recv_obj(rollout, 0)
        if req["cmd"] == "stop":
            break
        cpu = time.process_time()
        out = {dp: generate(sampler, ids, req["max_new_tokens"], req["temperature"], seed, req["eos"],
                            routing=req["routing"])
               for dp, (ids, seed) in sorted(req["batches"].items())}
        _send_obj(rollout, {"out": out, "cpu": time.process_time() - cpu}, 0)
        sampler.refresh(receiver.receive())
    if receiver.receive() is not None:
        raise RuntimeError("the trainer sent weights after its stop message")
    print(f"sampler process: done after {receiver.version} weight versions", flush=True)


def split_off_sampler(args) -> bool:
    """With ``--sampler-rank``: True in the sampler process; the trainer ranks renumber into a
    world without it (their megatron job never sees the sampler)."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if not 0 <= args.sampler_rank < world or world < 2:
        raise SystemExit(f"--sampler-rank={args.sampler_rank}: the launch has {world} process(es); "
                         "launch one more than the trainer needs")
    if args.sampler_port is None:
        args.sampler_port = int(os.environ["MASTER_PORT"]) + 1
    if rank == args.sampler_rank:
        return True
    os.environ.update(RANK=str(rank - (rank > args.sampler_rank)), WORLD_SIZE=str(world - 1))
    return False


def build_batch(prompts, completions):
    """input_ids / labels [N, L] (labels only on the completion), right-padded."""
    rows, labels = [], []
    for p, c in zip(prompts, completions):
        prompt = [BOS] + TOK.encode(p, add_special=False)
        rows.append(prompt + c)
        labels.append([-100] * len(prompt) + c)
    longest = max(len(r) for r in rows)
    ids = torch.tensor([r + [PAD] * (longest - len(r)) for r in rows])
    lab = torch.tensor([l + [-100] * (longest - len(l)) for l in labels])
    return {"input_ids": ids, "labels": lab}


def ref_logps(hf, batch):
    """log p_ref(labels) [N, L] from the frozen SFT model (transformers), aligned with labels."""
    with torch.no_grad():
        logits = hf(input_ids=batch["input_ids"]).logits.float()
    lsm = torch.log_softmax(logits[:, :-1], -1)
    labels = batch["labels"][:, 1:]
    lp = lsm.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * (labels != -100)
    return torch.cat([torch.zeros(len(lp), 1), lp], 1)


def tiny_moe_config():
    """The job's tiny Qwen3 as a Qwen3-MoE: every layer 4 experts, top-2 (renormalised)."""
    from twinkle_megatron.job.configs import tiny_qwen3_config
    return dict(tiny_qwen3_config(num_layers=2), model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0)


def ensure_sft(path, steps, seed, moe=False):
    """The SFT checkpoint (twinkle_megatron.job, one process), made if missing; rank 0 makes
    it while the other ranks wait for it. ``moe``: from :func:`tiny_moe_config` (random init)."""
    final = os.path.join(path, "final")
    marker = os.path.join(final, "config.json")
    if int(os.environ.get("RANK", "0")) == 0 and not os.path.exists(marker):
        cmd = [sys.executable, "-m", "twinkle_megatron.job", "--tp", "1", "--nproc", "1", "--steps", str(steps),
               "--no-sample", "--output-dir", path, "--seed", str(seed), "--log-every", str(max(1, steps // 4))]
        if moe:
            base = os.path.join(path, "moe_config")
            os.makedirs(base, exist_ok=True)
            with open(os.path.join(base, "config.json"), "w") as f:
                json.dump(tiny_moe_config(), f, indent=1)
            cmd += ["--model-dir", base]
        # a fresh single-process job: none of torchrun's variables (with TORCHELASTIC_USE_AGENT_STORE
        # its process group would wait for torchrun's store)
        launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                    "ROLE_RANK", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "ROLE_NAME")
        env = {k: v for k, v in os.environ.items()
               if k not in launcher and not k.startswith("TORCHELASTIC_")}
        print("SFT:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env=env)
    deadline = time.monotonic() + 1800
    while not os.path.exists(marker):
        if time.monotonic() > deadline:
            raise SystemExit(f"no SFT checkpoint at {final}")
        time.sleep(1)
    time.sleep(1)   # the weights are written before config.json? be safe on the other ranks
    return final


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=None)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (global)")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--updates", type=int, default=2, help="optimizer steps per sampled batch")
    p.add_argument("--max-new-tokens", type=int, default=14)
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--ignore-eos", action="store_true",
                   help="decode --max-new-tokens tokens in every row (EOS does not end one), e.g. to time samplers")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=4, help="lr warmup (optimizer steps)")
    p.add_argument("--epsilon", type=float, default=0.2)
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (k3 to the SFT model)")
    p.add_argument("--tasks", default="sorting,brackets")
    p.add_argument("--prompt-pool", type=int, default=32,
                   help="prompts are drawn from a fixed pool of this many (the training set); 0: fresh each step")
    p.add_argument("--sft-dir", default="output/grpo_sft")
    p.add_argument("--sft-steps", type=int, default=60)
    p.add_argument("--lora-rank", type=int, default=0,
                   help="train a LoRA adapter of this rank instead (the sampler then syncs the adapter alone)")
    p.add_argument("--sampler", choices=("kv", "logits"), default="kv",
                   help="kv: a synced transformers replica with a KV cache; logits: the uncached logits loop")
    p.add_argument("--sampler-rank", type=int, default=None,
                   help="with --sampler kv: this launch rank runs the replica in a process of its own, fed "
                        "over a process group (launch one process more than the trainer needs)")
    p.add_argument("--sampler-port", type=int, default=None,
                   help="rendezvous port of the trainer-sampler groups (default: MASTER_PORT + 1)")
    p.add_argument("--sampler-timeout", type=float, default=600.0,
                   help="seconds either side waits for the other before it raises")
    p.add_argument("--time-logits", action="store_true",
                   help="with --sampler kv: also run the logits loop each step (same prompts and seed) for "
                        "its time and the fraction of completions both draw alike")
    p.add_argument("--moe", action="store_true", help="the policy is a tiny Qwen3-MoE (4 experts, top-2)")
    p.add_argument("--router-replay", choices=("off", "R2", "R3"), default="off",
                   help="MoE: R2 replays the routing forward_only records on the rollout in every update; R3 "
                        "replays the sampler's routing (old logps included); off: each side routes itself")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-json", default=None, help="write the per-step metrics here (rank 0)")
    p.add_argument("--plot", default=None, help="write the reward curve PNG here (rank 0)")
    args = p.parse_args(argv)
    if args.router_replay != "off" and not args.moe:
        raise SystemExit(f"--router-replay {args.router_replay} needs a MoE policy (--moe)")
    if args.router_replay == "R3" and args.sampler != "kv":
        raise SystemExit("--router-replay R3 replays the replica's routing: it needs --sampler kv")
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    if args.sampler_rank is not None:
        if args.sampler != "kv":
            raise SystemExit("--sampler-rank needs --sampler kv")
        if split_off_sampler(args):
            return serve_sampler(args)
    sft = ensure_sft(args.sft_dir, args.sft_steps, args.seed, moe=args.moe)

    # megatron-core runs MoE layers under TP only with sequence parallelism
    mesh = DeviceMesh.from_sizes(dp_size=args.dp, tp_size=args.tp, sequence_parallel=args.moe and args.tp > 1)
    model = MegatronModel(model_id=sft, device_mesh=mesh, mixed_precision="fp32")
    if args.lora_rank:
        model.add_adapter_to_model("default", {"r": args.lora_rank, "lora_alpha": 2 * args.lora_rank,
                                               "target_modules": "all-linear"})
    model.set_optimizer(optimizer_cls="AdamW", lr=args.lr, weight_decay=0.0)
    # a short linear warmup: Adam's first steps are full-size in every weight
    model.set_lr_scheduler(scheduler_cls="constant", num_warmup_steps=args.warmup)
    model.set_loss("grpo", epsilon=args.epsilon, beta=args.beta)
    if int(os.environ["RANK"]) == 0:
        print(model.get_train_configs(), flush=True)
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(sft, dtype=torch.float32).eval()
    rank = int(os.environ["RANK"])
    dp, dps = model.data_parallel_rank, mesh.dp_size
    if args.prompts % dps:
        raise SystemExit(f"--prompts={args.prompts} is not divisible by dp={dps}")
    tasks = args.tasks.split(",")
    pool_rng = random.Random(args.seed)
    pool = [make_prompt(pool_rng, tasks) for _ in range(args.prompt_pool)]
    replica = None
    if args.sampler == "kv":
        replica = (RemoteReplica if args.sampler_rank is not None else Replica)(model, args)
    eos = None if args.ignore_eos else EOS
    if replica is not None and rank == 0:
        print(f"sampler: transformers replica ({'peft, adapter ' + repr(replica.adapter) if replica.adapter else 'full'}),"
              f" first sync {replica.first['tensors']} tensors, {replica.first['bytes'] / 1e6:.1f} MB in "
              f"{replica.first['seconds']:.2f}s", flush=True)
    history = []
    start = time.perf_counter()
    for step in range(args.steps):
        rng = random.Random(1000 * step + dp + args.seed)                 # this DP rank's prompts
        seed = 7919 * step + dp + args.seed                               # same on its TP ranks
        pairs = [rng.choice(pool) if pool else make_prompt(rng, tasks) for _ in range(args.prompts // dps)]
        prompts = [q for q, _ in pairs for _ in range(args.group)]
        answers = [a for _, a in pairs for _ in range(args.group)]
        timing = {}
        if replica is not None:
            (completions, sampler_logps, sampler_cpu, routing), timing["sample"] = timed(
                replica.sample, prompts, args.max_new_tokens, args.temperature, seed, eos)
            timing["sample"] = (timing["sample"][0], sampler_cpu)   # the sampling process's CPU time
        if replica is None or args.time_logits:
            loop, timing["logits_sample"] = timed(
                sample_logits_loop, model, prompts, args.max_new_tokens, args.temperature,
                torch.Generator().manual_seed(seed), eos)
            if replica is None:
                completions, timing["sample"] = loop, timing.pop("logits_sample")
        texts = [TOK.decode(c) for c in completions]
        rewards = torch.tensor([reward(t, a) for t, a in zip(texts, answers)])
        grouped = rewards.view(-1, args.group)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
        batch = build_batch(prompts, completions)
        replay = {}
        if args.router_replay == "R3":   # the sampler's routing, for the old logps and every update
            replay["routed_experts"] = routed_batch(routing, batch["input_ids"].shape[1],
                                                    routing[0].shape[-1])
        rollout = model.forward_only(inputs=batch, return_routed_experts=args.router_replay == "R2", **replay)
        old = rollout["logps"]
        if args.router_replay == "R2":   # the trainer's own routing of the rollout, kept for the updates
            replay["routed_experts"] = rollout["routed_experts"]
        logp_diff = None
        if replica is not None:   # the trainer's log-probs (what GRPO uses) against the replica's
            starts = [len(q) for q in prompt_ids(prompts)]
            logp_diff = max(abs(float(old[i, starts[i] + j]) - lp) for i, row in enumerate(sampler_logps)
                            for j, lp in enumerate(row))
        ref_lp = ref_logps(ref, batch)
        metrics = []
        for _ in range(args.updates):
            out = model.forward_backward(inputs=batch, advantages=adv, old_logps=old, ref_logps=ref_lp,
                                         return_entropy=True, **replay)
            model.clip_grad_and_step(max_grad_norm=1.0)
            metrics.append(out)
        if replica is not None:   # the next step samples from the weights just trained
            synced, timing["sync"] = timed(replica.sync)
        stats = torch.tensor([float(rewards.sum()), float(len(rewards)), float((rewards == 1).sum())])
        if dps > 1:   # every DP rank's rewards
            import torch.distributed as dist
            from megatron.core import parallel_state as ps
            dist.all_reduce(stats, group=ps.get_data_parallel_group())
        row = {"step": step + 1, "reward": float(stats[0] / stats[1]), "exact": float(stats[2] / stats[1]),
               "kl": metrics[-1]["kl"], "clip_frac": max(m["clip_frac"] for m in metrics),
               "entropy": metrics[0]["mean_entropy"], "loss": metrics[0]["loss"],
               "seconds": time.perf_counter() - start, "sampler": args.sampler, "router_replay": args.router_replay}
        for k, (wall, cpu) in timing.items():   # this rank's wall and process CPU seconds
            row[f"{k}_seconds"], row[f"{k}_cpu_seconds"] = wall, cpu
        if replica is not None:
            row.update(logp_diff=logp_diff, sync_bytes=synced["bytes"], sync_full=synced["full"])
        if "logits_sample" in timing:
            row["agree"] = sum(a == b for a, b in zip(completions, loop)) / len(loop)
        history.append(row)
        if rank == 0:
            times = f"sampling {row['sample_seconds']:.2f}s"
            if "logits_sample" in timing:
                times += f" (logits loop {row['logits_sample_seconds']:.2f}s, same tokens {row['agree']:.2f})"
            if replica is not None:
                times += (f", sync {row['sync_seconds']:.2f}s {'full' if synced['full'] else 'adapter'} "
                          f"{synced['bytes'] / 1e6:.1f} MB, |logp replica - trainer| {logp_diff:.1e}")
            print(f"step {row['step']:3d} reward {row['reward']:.3f} exact {row['exact']:.3f} "
                  f"kl {row['kl']:.4f} clip_frac {row['clip_frac']:.3f} entropy {row['entropy']:.3f} "
                  f"loss {row['loss']:+.4f} ({row['seconds']:.0f}s, {times})  e.g. {prompts[0]!r} -> {texts[0]!r}",
                  flush=True)
        for k in ("reward", "kl", "clip_frac", "entropy", "loss"):
            if not math.isfinite(row[k]):
                raise RuntimeError(f"{k} became {row[k]} at step {step + 1}")
    if isinstance(replica, RemoteReplica):
        replica.close()
    shutdown()
    if rank == 0:
        if args.log_json:
            with open(args.log_json, "w") as f:
                json.dump({"args": vars(args), "history": history}, f, indent=1)
        if args.plot:
            plot(history, args.plot, f"GRPO, tiny Qwen3{'-MoE' if args.moe else ''}, tp={args.tp} dp={dps}, {args.prompts}x{args.group}, "
                                     f"{args.sampler} sampler")
    return history


def plot(history, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [h["reward"] for h in history], marker="o", label="mean reward")
    ax.plot(steps, [h["exact"] for h in history], marker=".", label="exact answers")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("fraction")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
