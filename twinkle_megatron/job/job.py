"""The training job: a tiny Qwen3-style model trained with megatron-core through the facade.

    python -m twinkle_megatron.job                      # 2 local processes, TP2, CPU or GPU
    python -m twinkle_megatron.job --hybrid --packed    # the Qwen3.5 hybrid, samples packed
    python -m twinkle_megatron.job --lora-rank 8        # a LoRA adapter on a frozen base
    torchrun --nproc_per_node 4 -m twinkle_megatron.job --tp 2 --pp 2
    python -m twinkle_megatron.job --model-dir my_hf_model --data my.jsonl --device cuda

Without torchrun (no ``RANK`` in the environment) the job starts its own local processes, one
per rank of the mesh, and watches them: if one fails, the others are stopped. The default data
set is generated on the spot (:mod:`.data`: addition, sorting, bracket completion; byte-level
tokens), so nothing is downloaded. At the end rank 0 saves a Hugging Face checkpoint, loads it
back with transformers and prints a greedy sample, so a newcomer sees what was learned. With
``--lora-rank`` only a LoRA adapter trains (the base stays frozen): the job saves the base
weights first and the adapter (PEFT format) at the end, and samples through transformers with
the adapter loaded by peft.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import re
import sys
import time
import warnings
from typing import Dict, Iterator, List, Optional

import torch

from ..models import MODEL_TYPES
from ..parallel.launch import free_port, supervise
from . import data as train_data
from .configs import tiny_qwen3_5_config, tiny_qwen3_config

def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m twinkle_megatron.job",
                                description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    p.add_argument("--etp", type=int, default=None,
                   help="expert tensor-parallel size (default 1)")
    p.add_argument("--dp", type=int, default=None,
                   help="data-parallel size (default: what the world size leaves)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="megatron sequence parallelism (switched on anyway for MoE with --tp > 1)")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes to start when run without torchrun (default dp*tp*pp*cp, dp=1)")
    p.add_argument("--device", choices=["cpu", "cuda", "npu"], default=None,
                   help="default: cuda or npu when present, else cpu")
    p.add_argument("--model-dir", default=None,
                   help="a Hugging Face model directory (config.json, optional safetensors weights "
                        "and tokenizer) of a model_type in: " + ", ".join(MODEL_TYPES)
                        + "; default: the embedded tiny Qwen3 config, random init")
    p.add_argument("--hybrid", action="store_true",
                   help="train the embedded tiny Qwen3.5 hybrid (Gated DeltaNet + gated attention) "
                        "instead of the tiny Qwen3")
    p.add_argument("--packed", action="store_true",
                   help="pack samples: position_ids restart at every BOS token, so each sample attends "
                        "only to itself (megatron PackedSeqParams / THD)")
    p.add_argument("--data", default=None, help="a .jsonl ({'text': ...} per line) or text file; "
                                                "default: the embedded procedural tasks")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16, help="global batch size (rows)")
    p.add_argument("--micro-batch-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=None, help="default 3e-3 (with --lora-rank: 1e-2)")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default steps//10)")
    p.add_argument("--mixed-precision", choices=["bf16", "fp32"], default=None,
                   help="default: fp32 on CPU, bf16 on accelerators")
    p.add_argument("--no-twinkle-kernels", action="store_true",
                   help="build the model with megatron-core's local layer spec instead of ours")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="train a LoRA adapter of this rank on the frozen base (0: full training)")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default 2 * rank)")
    p.add_argument("--lora-targets", default="all-linear",
                   help="comma-separated HF module names (q_proj,v_proj), a regex, or all-linear")
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--recompute", choices=["none", "selective", "full"], default="none",
                   help="activation recompute granularity (megatron's recompute_granularity)")
    p.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="full recompute: uniform groups or the first layers of each stage (default uniform)")
    p.add_argument("--recompute-num-layers", type=int, default=None,
                   help="full recompute: layers per group (uniform) or per stage (block); default 1")
    p.add_argument("--recompute-modules", default=None,
                   help="selective recompute: comma-separated modules (default core_attn)")
    p.add_argument("--overlap-grad-reduce", action="store_true",
                   help="start each grad bucket's all-reduce / reduce-scatter during the backward")
    p.add_argument("--overlap-param-gather", action="store_true",
                   help="with --distributed-optimizer: all-gather updated params ahead of the next forward")
    p.add_argument("--bucket-size", type=int, default=None, help="parameters per DDP bucket")
    p.add_argument("--distributed-optimizer", action="store_true",
                   help="shard the optimizer state over the data-parallel ranks (megatron's)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="output/train")
    p.add_argument("--sample-prompt", default=None,
                   help="prompt for the sample printed at the end (default: an addition task)")
    p.add_argument("--no-sample", action="store_true", help="skip the transformers sample")
    args = p.parse_args(argv)
    for name in ("tp", "pp", "cp", "ep", "steps", "seq_len", "batch_size"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.hybrid and args.model_dir:
        raise SystemExit("--hybrid selects the embedded Qwen3.5 config; with --model-dir the model "
                         "directory's config decides (drop one of them)")
    if args.lora_rank < 0:
        raise SystemExit(f"--lora-rank must be >= 0, got {args.lora_rank}")
    if args.lr is None:
        args.lr = 1e-2 if args.lora_rank else 3e-3
    for name in ("dp", "etp", "nproc"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be at least 1, got {getattr(args, name)}")
    return args


# ---- launching ------------------------------------------------------------------------------

def spawn(argv: List[str], nproc: int, device: Optional[str]) -> int:
    """Run this job on ``nproc`` local ranks; returns the first non-zero exit code (0 if all
    succeeded). A failing rank stops the others at once, so nothing hangs."""
    # megatron-core warns about every optional dependency it lacks, on every rank.
    env = dict(os.environ)
    env.setdefault("PYTHONWARNINGS", "ignore")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        # Each rank gets its share of the cores: oversubscribed OpenMP threads crawl.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return supervise(["-m", "twinkle_megatron.job", *argv], nproc, env=env, name="train")


# ---- data -----------------------------------------------------------------------------------

def load_tokenizer(model_dir: Optional[str]):
    """The model directory's own tokenizer when it has one, else the byte tokenizer."""
    if model_dir and any(os.path.exists(os.path.join(model_dir, f))
                         for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(model_dir)
    return train_data.ByteTokenizer()


def token_rows(args, tokenizer) -> torch.Tensor:
    texts = train_data.read_texts(args.data) if args.data else \
        train_data.synthetic_texts(max(2000, args.steps * args.batch_size * args.seq_len // 10), seed=args.seed)
    return train_data.pack(texts, args.seq_len, tokenizer)


def sample_positions(x: torch.Tensor, bos: int) -> torch.Tensor:
    """position_ids [B, S] for rows ``x`` [B, S] of concatenated samples: 0 at each row start and
    at every ``bos`` token, counting up in between (the packed-sample convention)."""
    b, s = x.shape
    idx = torch.arange(s).expand(b, -1)
    starts = (x == bos)
    starts[:, 0] = True
    last_start = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
    return idx - last_start


def rank_batches(rows: torch.Tensor, global_batch: int, dp_rank: int, dp_size: int,
                 seed: int, packed: bool = False, bos: int = train_data.BOS) -> Iterator[Dict[str, torch.Tensor]]:
    """This DP rank's share of each shuffled global batch: ``{'input_ids', 'labels'}`` [B/dp, S]
    (with ``packed``, also ``position_ids`` restarting at every ``bos``)."""
    if rows.shape[0] < global_batch:
        raise ValueError(f"the data holds {rows.shape[0]} rows, fewer than --batch-size={global_batch}")
    share = global_batch // dp_size
    g = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(rows.shape[0], generator=g)
        for i in range(0, rows.shape[0] - global_batch + 1, global_batch):
            x = rows[perm[i + dp_rank * share: i + (dp_rank + 1) * share]]
            batch = {"input_ids": x, "labels": x.clone()}
            if packed:
                batch["position_ids"] = sample_positions(x, bos)
            yield batch


# ---- the job --------------------------------------------------------------------------------

def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def setup(args):
    """This rank's model with its optimizer and LR schedule (with ``--lora-rank``, and its
    adapter): ``(model, mesh, base_path)``, ``base_path`` the HF weights the adapter goes on
    (None without an adapter)."""
    from ..model import MegatronModel
    from ..parallel.mesh import DeviceMesh

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.device in ("cuda", "npu"):
        ok = torch.cuda.is_available() if args.device == "cuda" else \
            getattr(torch, "npu", None) is not None and torch.npu.is_available()
        if not ok:
            raise SystemExit(f"--device {args.device}: no {args.device} device is available")
    if args.device == "cpu" and torch.cuda.is_available():
        raise SystemExit("--device cpu under torchrun on a GPU machine: set CUDA_VISIBLE_DEVICES= "
                         "(or launch without torchrun, which does it for you)")
    mesh = DeviceMesh.from_sizes(dp_size=args.dp, tp_size=args.tp, pp_size=args.pp, cp_size=args.cp,
                                 ep_size=args.ep, etp_size=args.etp, sequence_parallel=args.sequence_parallel or None,
                                 world_size=world)
    if args.batch_size % mesh.dp_size:
        raise SystemExit(f"--batch-size={args.batch_size} is not divisible by dp={mesh.dp_size}")
    on_cpu = not torch.cuda.is_available() and not (getattr(torch, "npu", None) is not None
                                                   and torch.npu.is_available())
    precision = args.mixed_precision or ("fp32" if on_cpu else "bf16")
    config = args.model_dir or (tiny_qwen3_5_config() if args.hybrid else tiny_qwen3_config())
    model = MegatronModel(config, device_mesh=mesh, mixed_precision=precision, seed=args.seed,
                          **_kernel_kwargs(args), **memory_kwargs(args))
    base_path = None
    if args.lora_rank:
        # peft loads the adapter onto HF base weights: the model directory's, or these.
        base_path = args.model_dir if args.model_dir and os.path.isfile(
            os.path.join(args.model_dir, "config.json")) and model_has_weights(args.model_dir) \
            else model.save("base", output_dir=args.output_dir)
        model.add_adapter_to_model("default", lora_config(args))
    model.set_optimizer("AdamW", lr=args.lr, weight_decay=0.01,
                        use_distributed_optimizer=args.distributed_optimizer)
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=min(warmup, args.steps),
                           num_training_steps=args.steps, min_lr=args.lr * 0.1)
    return model, mesh, base_path


@contextlib.contextmanager
def quiet_setup():
    """While the job imports megatron-core and builds the model (:func:`setup`), drop the notices
    a user of this job did not ask for and cannot act on, so that the job's header is the first
    thing it prints. Each is named here; any other warning still shows:

    - megatron-core's ``UserWarning``s, issued once per process as its modules are first imported,
      that optional packages are missing (TransformerEngine, apex, absl.logging; the job needs
      none: the facade builds local modules and torch optimizers) and, from 0.19, that its MIMO
      model config is experimental (``get_megatron_optimizer`` imports it; the job has no MIMO
      model). The local launcher's ranks run with ``PYTHONWARNINGS=ignore`` (:func:`spawn`);
      these are what a single in-process rank, or a torchrun rank, would print;
    - torch's ``No CUDA runtime is found, using CUDA_HOME=...`` (a CUDA build of torch on a
      machine without a GPU, logged on every rank when megatron imports
      ``torch.utils.cpp_extension``): it concerns compiling CUDA extensions, which the job never
      does, and the header names the device.

    Installed here, not when the job is imported, and removed on exit. megatron's own warnings
    at model build are dropped where the model is built (``spec.build_chunks``)."""
    def cuda_home(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No CUDA runtime is found")

    torch_log = logging.getLogger("torch.utils.cpp_extension")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module="megatron",
                                message=r"(Transformer Engine and Apex are|Apex is|absl\.logging is) not installed")
        warnings.filterwarnings("ignore", category=UserWarning, module="megatron",
                                message="MimoModelConfig is experimental")
        torch_log.addFilter(cuda_home)
        try:
            yield
        finally:
            torch_log.removeFilter(cuda_home)


def train(args) -> int:
    rank = int(os.environ.get("RANK", "0"))
    with quiet_setup():
        model, mesh, base_path = setup(args)
    from megatron.core import parallel_state as ps

    from ..parallel.mesh import shutdown
    tokenizer = load_tokenizer(args.model_dir)
    rows = token_rows(args, tokenizer)
    if rank == 0:
        print(model.get_train_configs(), flush=True)
        print(f"data: {rows.shape[0]} rows x {rows.shape[1]} tokens "
              f"({'file ' + args.data if args.data else 'embedded procedural tasks'}); "
              f"twinkle kernels: {_kernels_line(model) if not args.no_twinkle_kernels else 'off'}",
              flush=True)
    bos = getattr(tokenizer, "bos_token_id", None)
    if args.packed and bos is None:
        raise SystemExit("--packed needs a tokenizer with a BOS token (samples are split at BOS)")
    data = rank_batches(rows, args.batch_size, ps.get_data_parallel_rank(), mesh.dp_size, args.seed,
                        packed=args.packed, bos=bos if bos is not None else train_data.BOS)
    first = last = None
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        model.forward_backward(inputs=next(data), micro_batch_size=args.micro_batch_size)
        model.clip_grad_and_step(max_grad_norm=1.0)
        if step % args.log_every == 0 or step == 1 or step == args.steps:
            m = model.calculate_metric(is_training=True)
            first = m["loss"] if first is None else first
            last = m["loss"]
            if not math.isfinite(last):
                raise RuntimeError(f"loss became {last} at step {step}")
            if rank == 0:
                print(f"{_bar(step, args.steps)} step {step}/{args.steps} loss {m['loss']:.4f} "
                      f"grad_norm {m['grad_norm']:.3f} lr {m['lr']:.2e} "
                      f"tokens/s {m['tokens_per_s']:.0f}", flush=True)
    elapsed = time.perf_counter() - start
    path = model.save("final", output_dir=args.output_dir,
                      consumed_train_samples=args.steps * args.batch_size)
    shutdown()
    if rank == 0:
        what = f"LoRA adapter (PEFT) {path} on base {base_path}" if base_path else f"Hugging Face checkpoint {path}"
        print(f"done: {args.steps} steps in {elapsed:.1f}s, loss {first:.4f} -> {last:.4f}; saved {what}",
              flush=True)
        if not args.no_sample:
            if base_path:
                print_sample(base_path, tokenizer, args.sample_prompt, adapter=path)
            else:
                print_sample(path, tokenizer, args.sample_prompt)
    return 0


def _kernels_line(model) -> str:
    import twinkle_kernels as tk
    from .. import spec
    modules = spec.describe(model.unwrapped_chunks()[0]) or "none"
    backend = {"cuda": "triton", "npu": "npu"}.get(model.device.type, "cpu")
    why = tk.backend_status(backend)  # None when the backend is usable
    return f"{modules}; backend {backend}" + (f" unavailable ({why.split(' [')[0]}), reference used" if why else "")


def _kernel_kwargs(args) -> dict:
    """Layer-spec choice for MegatronModel (only passed when the facade supports it)."""
    import inspect
    from ..model import MegatronModel
    if "use_twinkle_kernels" in inspect.signature(MegatronModel.__init__).parameters:
        return {"use_twinkle_kernels": not args.no_twinkle_kernels}
    return {}


def memory_kwargs(args) -> dict:
    """MegatronModel's recompute and DDP-overlap arguments of the --recompute* / --overlap-* /
    --bucket-size flags (the model checks them)."""
    kw = {"overlap_grad_reduce": args.overlap_grad_reduce, "overlap_param_gather": args.overlap_param_gather,
          "bucket_size": args.bucket_size}
    if args.recompute == "full":
        kw.update(recompute_granularity="full", recompute_method=args.recompute_method or "uniform",
                  recompute_num_layers=args.recompute_num_layers or 1)
    elif args.recompute == "selective":
        kw["recompute_granularity"] = "selective"
        if args.recompute_modules:
            kw["recompute_modules"] = [m for m in args.recompute_modules.split(",") if m]
    for flag in ("recompute_method", "recompute_num_layers", "recompute_modules"):
        if getattr(args, flag) is not None and flag not in kw:
            raise SystemExit(f"--{flag.replace('_', '-')} does not apply to --recompute {args.recompute}")
    return kw


def lora_config(args):
    """The peft LoraConfig of the --lora-* flags."""
    from peft import LoraConfig
    targets = args.lora_targets
    if targets != "all-linear" and re.fullmatch(r"[\w.,]+", targets):
        targets = [t for t in targets.split(",") if t]
    return LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha or 2 * args.lora_rank,
                      lora_dropout=args.lora_dropout, target_modules=targets)


def model_has_weights(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in ("model.safetensors", "model.safetensors.index.json"))


def generate(path: str, tokenizer, prompt: str, max_new_tokens: int = 24, adapter: Optional[str] = None) -> str:
    """Greedy continuation of ``prompt`` by the checkpoint at ``path`` (with ``adapter``: that
    PEFT adapter loaded onto it by peft), through transformers."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel
        hf = PeftModel.from_pretrained(hf, adapter).eval()
    if isinstance(tokenizer, train_data.ByteTokenizer):
        ids = [train_data.BOS] + tokenizer.encode(prompt, add_special=False)
    else:
        ids = tokenizer.encode(prompt)
    x = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=getattr(tokenizer, "eos_token_id", None),
                          pad_token_id=getattr(tokenizer, "pad_token_id", None))
    return tokenizer.decode(out[0, x.shape[1]:].tolist())


def print_sample(path: str, tokenizer, prompt: Optional[str], adapter: Optional[str] = None) -> None:
    prompts = [prompt] if prompt else ["417+96=", "sort 5 1 4 2>", "([{<|"]
    how = "transformers + peft adapter" if adapter else "transformers"
    for p in prompts:
        print(f"sample ({how}, greedy): {p!r} -> {generate(path, tokenizer, p, adapter=adapter)!r}", flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    if "RANK" not in os.environ:
        nproc = args.nproc or (args.dp or 1) * args.tp * args.pp * args.cp
        if nproc > 1:
            return spawn(raw, nproc, args.device or ("cpu" if not torch.cuda.is_available() else None))
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    if (args.device == "cpu" or not torch.cuda.is_available()):
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    return train(args)

