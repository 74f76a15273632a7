"""One training step at published widths: transformers against the facade (issue 48).

    python -m benchmarks.scripts.train_step [--models qwen3_0_6b,qwen3_30b_a3b,qwen3_5_dense] [--layers N]
        [--seq 512] [--batch 1] [--dtypes fp32,bf16] [--variants hf_eager,hf_autocast,hf_patched,facade_local,facade_twinkle]
        [--lora] [--steps 3] [--device cpu|cuda] [--out benchmarks/results/train_step_<date>.md]

Models (random weights, written out below as their ``config.json`` values; tests/ checks them
against ``tests/published_configs.py``): Qwen3-0.6B (full depth, 28 layers, by default), a
Qwen3-30B-A3B-shaped MoE (full width, 128 experts of 768, top-8; always reduced depth, 2 layers by
default) and Qwen3.5 dense (transformers' ``Qwen3_5TextConfig()``: hidden 4096, 3 Gated DeltaNet
layers per attention layer; 4 layers by default). ``--layers N`` sets every model's depth (the
MoE at most its published 48; the hybrid keeps the published 3:1 pattern, with at least 2 layers
and one of them attention, which transformers' Qwen3.5 needs). Memory at the default depths
(weights, grads and AdamW state, about 16 bytes per parameter in fp32, for the one variant
running): Qwen3-0.6B 0.60 B parameters (~9 GiB), the MoE 1.87 B (~28 GiB), Qwen3.5 dense 2.90 B
(~43 GiB; its untied 248,320-token embedding and head are 2.0 B of them). ``--tiny`` shrinks
every width (hidden 64, vocab 512, 8 experts): the test mode, which measures nothing.

Variants, each in one dtype (``--dtypes``), each also with LoRA r=8 (alpha 16) on all linear
layers with ``--lora`` (peft on transformers, ``add_adapter_to_model`` on the facade):

- ``hf_eager``: transformers unchanged (its default sdpa attention; the MoE with
  ``experts_implementation="grouped_mm"``: ``torch.nn.functional.grouped_mm``, or
  ``torch._grouped_mm`` on an older torch, where transformers admits it, its own fallback
  elsewhere; under autocast it runs in the fp32 weights' dtype, as transformers casts the input
  to the weight), parameters in the dtype (bf16: pure-bf16 AdamW);
- ``hf_autocast`` (bf16 only): fp32 parameters under ``torch.autocast(bfloat16)``, what HF
  Trainer's ``bf16=True`` runs;
- ``hf_patched``: ``hf_eager`` after ``twinkle_patches.apply(model)`` (reverted afterwards);
- ``facade_local``: ``MegatronModel(mixed_precision=dtype)``, megatron's local layer spec;
- ``facade_twinkle``: the same with ``use_twinkle_kernels=True``;
- ``hf_perturbed`` (not in the default set): ``hf_eager`` with its LM head's weight times 10,
  a deliberately wrong model: the loss guard's own check (its row must be refused).

A step is what a user runs: transformers ``loss = model(**batch).loss; loss.backward();
clip_grad_norm_(1.0); AdamW.step(); zero_grad()`` (torch's fused AdamW where it serves the
dtype and device, else foreach; the row says which), the facade ``forward_backward`` then
``clip_grad_and_step(1.0)`` (megatron's AdamW; bf16 keeps fp32 main parameters and grads).

The loss guard: each variant's first-step loss must agree with transformers eager fp32 on the
same weights and batch (a no-grad forward in its own run) within 1e-4 relative in fp32, 2e-2 in
bf16 (bf16 rounds the weights themselves; LoRA starts at B = 0, so the same loss). A variant
outside it is not timed: its row says why. A variant that cannot run (a package missing, an
error) says why as well.

Timing: one warm-up step (the first, whose loss is checked), then ``--steps`` timed steps; the
median. On CPU, process CPU seconds (all threads; the machine may be shared, so ratios come from
one run); on CUDA, CUDA-event wall time. Each variant runs in its own process on CPU, so its peak
RSS (``ru_maxrss``) is its own (``--in-process`` runs them in this one, without the RSS); on
CUDA in this process, the peak being ``torch.cuda.max_memory_allocated`` since the variant began.

Phases (``--phase-steps`` further steps, median, after the timed ones, instrumented by hooks so
that the timed steps carry none of it):

- forward: from the call to the final norm's forward pre-hook (the facade's includes its input
  checks and batching);
- LM head + loss: final norm, output layer and loss, forward (pre-hook on the final norm to the
  start of backward: for the facade, the entry of megatron's ``backward_step``) plus backward (to
  the tensor hook on the final norm's input, where the gradient reaches the body);
- backward: the rest of backward (less, for the facade, the main-grad accumulation);
- main-grad accumulation (facade): the summed time of megatron DDP's per-parameter backward
  hooks (``main_grad.add_(grad)``, on CPU ``cpu_compat``'s sliced add; they run inside backward;
  on CPU the word embedding's rows go into ``main_grad`` in its own backward instead, counted
  there);
- grad finalisation (facade): ``finalize_model_grads`` (DP / embedding reductions, the 1 / tokens
  scaling; with the one-pass step, the reductions only) at the start of ``clip_grad_and_step``;
- norm + clip: transformers ``clip_grad_norm_``; the facade the rest of ``clip_grad_and_step``
  (megatron's ``prepare_grads`` (main-grad copies), grad norm, clipping (folded into the
  optimizer's pass with the one-pass step), LR scheduler);
- optimizer: ``AdamW.step`` / the facade's optimizer step (megatron's, or the one-pass
  ``twinkle_kernels.adamw_step`` of ``training/fused_adam.py``: scale, clip, AdamW and the copy
  into the bf16 parameters); zero grads: ``zero_grad``;
- other: the facade's ``forward_backward`` after backward (results reduced over ranks).

On CPU the report also gives each row's system time and minor page faults per timed step
(``getrusage``, medians): the kernel's share of the CPU time, mostly first-touch faults on fresh
tensors (the header names torch's ``THP_MEM_ALLOC_ENABLE``, which changes them).

``--top-ops N`` adds, per variant, one more step under ``torch.profiler`` and its N ops by self
time (what ``benchmarks/scripts/profile_step_cpu.py`` prints for four bf16 variants).
``--gemm-floor`` adds, per transformers variant, one more step with its matrix products recorded
and each replayed alone (:mod:`benchmarks.harness.gemm_floor`): the time those products take at
this GEMM library's rate, so the most any implementation of the same model, its products in the
same dtypes, can gain over that row.
``benchmarks/scripts/published_widths_cpu.py`` runs this benchmark for its step table.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
import traceback

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The published configs (benchmarks import nothing from tests/; tests/ checks these are its entries).
QWEN3_0_6B = dict(
    model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024,
    intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6,
    rope_theta=1000000.0, rope_scaling=None, attention_bias=False, tie_word_embeddings=True,
    use_sliding_window=False, sliding_window=None, max_window_layers=28)
QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, hidden_act="silu",
    max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
    attention_bias=False, tie_word_embeddings=False, router_aux_loss_coef=0.001,
    output_router_logits=False, use_sliding_window=False, sliding_window=None, max_window_layers=48)
QWEN3_5_TEXT = dict(
    model_type="qwen3_5_text", vocab_size=248320, hidden_size=4096, intermediate_size=12288,
    num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
    hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
    attention_bias=False, tie_word_embeddings=False, linear_conv_kernel_dim=4,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=32, full_attention_interval=4)

#: name -> (published config, default depth, description)
MODELS = {
    "qwen3_0_6b": (QWEN3_0_6B, 28, "Qwen3-0.6B"),
    "qwen3_30b_a3b": (QWEN3_30B_A3B, 2, "Qwen3-30B-A3B-shaped MoE"),
    "qwen3_5_dense": (QWEN3_5_TEXT, 4, "Qwen3.5 dense (hybrid GDN)"),
}
# --tiny: every width cut (the test mode; nothing it prints is a measurement)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16)
TINY_EXTRA = {
    "qwen3_30b_a3b": dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2),
    "qwen3_5_dense": dict(head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                          linear_num_value_heads=4),
}

VARIANTS = ("hf_eager", "hf_autocast", "hf_patched", "facade_local", "facade_twinkle")
LABELS = {"hf_eager": "transformers eager", "hf_autocast": "transformers, fp32 params + autocast bf16",
          "hf_patched": "transformers + twinkle_patches", "facade_local": "facade, local spec",
          "facade_twinkle": "facade, twinkle kernels", "hf_perturbed": "transformers, LM head x10 (guard check)"}
LOSS_RTOL = {"fp32": 1e-4, "bf16": 2e-2}
PHASES = ("forward", "backward", "lm_head_loss", "main_grad", "grad_finalise", "norm_clip", "optimizer", "zero_grad",
          "other")
PHASE_TITLES = {"forward": "forward", "backward": "backward", "lm_head_loss": "LM head + loss",
                "main_grad": "main-grad accumulation", "grad_finalise": "grad finalisation",
                "norm_clip": "norm + clip", "optimizer": "optimizer", "zero_grad": "zero grads", "other": "other"}
GEMM_FLOOR_ROWS = 8   # the products listed per variant, most time first
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")


def model_config(name: str, layers=None, tiny: bool = False, vocab=None) -> dict:
    """The HF config dict of ``name`` at ``layers`` depth (None: the default), widths cut with ``tiny``,
    the vocabulary cut to ``vocab`` rows when given (the published widths' MoE and Qwen3.5 layers then
    fit a 24 GB machine with fp32 AdamW state: a full-vocabulary embedding and head are 0.6 / 1.0 B
    parameters more; the report states the vocabulary)."""
    if name not in MODELS:
        raise ValueError(f"--models: unknown model {name!r}; known: {', '.join(MODELS)}")
    published, default, _ = MODELS[name]
    cfg = copy.deepcopy(published)
    n = default if layers is None else int(layers)
    if n < 1:
        raise ValueError(f"--layers must be >= 1, got {n}")
    n = min(n, published["num_hidden_layers"])
    cfg["num_hidden_layers"] = n
    if "max_window_layers" in cfg:
        cfg["max_window_layers"] = n
    if "full_attention_interval" in cfg:
        # at least one GDN and one attention layer (transformers' Qwen3.5 refuses a model without
        # an attention layer); the report lists each model's depth
        n = max(n, 2)
        cfg["num_hidden_layers"] = n
        k = cfg.pop("full_attention_interval")
        types = ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(n)]
        if "full_attention" not in types:
            types[-1] = "full_attention"
        cfg["layer_types"] = types
    if tiny:
        cfg.update(TINY)
        cfg.update(TINY_EXTRA.get(name, {}))
    if vocab is not None:
        if int(vocab) < 2:
            raise ValueError(f"--vocab must be >= 2, got {vocab}")
        cfg["vocab_size"] = min(int(vocab), cfg["vocab_size"])
    return cfg


# ---- clocks --------------------------------------------------------------------------------------

class Clock:
    """Marks and the seconds between them: process CPU time on CPU, CUDA events on CUDA."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def mark(self):
        import torch
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.process_time()

    def seconds(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def _batch(vocab: int, batch: int, seq: int):
    import torch
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def _dtype(name):
    import torch
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


# ---- a variant's run (in its own process on CPU) ------------------------------------------------

class _HeadProbe:
    """Marks the final norm's forward entry and the moment its input's gradient is computed."""

    def __init__(self, norm, clock):
        self.clock, self.on = clock, False
        self.head_fwd = self.head_bwd_end = None
        self.handle = norm.register_forward_pre_hook(self._pre)

    def _pre(self, module, args):
        if not self.on:
            return
        self.head_fwd = self.clock.mark()
        x = args[0] if args else None
        if x is not None and getattr(x, "requires_grad", False):
            x.register_hook(self._grad)

    def _grad(self, grad):
        self.head_bwd_end = self.clock.mark()

    def remove(self):
        self.handle.remove()


def _hf_final_norm(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.norm


def _hf_optimizer(params):
    import torch
    try:
        opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
        return opt, "torch AdamW (fused)"
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, lr=1e-5, foreach=True), "torch AdamW (foreach)"


def _run_hf(spec, clock, batch, check):
    import torch
    import transformers
    device, variant = spec["device"], spec["variant"]
    dtype = torch.float32 if variant == "hf_autocast" else _dtype(spec["dtype"])
    kw = {}
    if spec["moe"]:
        kw["experts_implementation"] = "grouped_mm"
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["path"], dtype=dtype, **kw).to(device)
    model.train()
    notes, report = [], None
    if spec["moe"]:
        fn = "torch.nn.functional.grouped_mm" if hasattr(torch.nn.functional, "grouped_mm") else "torch._grouped_mm"
        notes.append(f"experts_implementation={model.config._experts_implementation} ({fn})")
    notes.append(f"attention={model.config._attn_implementation}")
    if variant == "hf_perturbed":
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(10.0)
    try:
        if variant == "hf_patched":
            import twinkle_patches as tp
            report = tp.apply(model)
            notes.append(f"{len(report.swapped)} patches swapped")
        if spec["lora"]:
            import peft
            model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
        params = [p for p in model.parameters() if p.requires_grad]
        opt, opt_name = _hf_optimizer(params)
        notes.append(opt_name)
        autocast = variant == "hf_autocast"
        batch = {k: v.to(device) for k, v in batch.items()}
        probe = _HeadProbe(_hf_final_norm(model), clock)
        marks = {}

        def step(instrument=False):
            probe.on = instrument
            m = marks
            m["t0"] = clock.mark() if instrument else None
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                loss = model(**batch).loss
            if instrument:
                m["t1"] = clock.mark()
            loss.backward()
            if instrument:
                m["t2"] = clock.mark()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            if instrument:
                m["t3"] = clock.mark()
            opt.step()
            if instrument:
                m["t4"] = clock.mark()
            opt.zero_grad(set_to_none=True)
            if instrument:
                m["t5"] = clock.mark()
            probe.on = False
            return float(loss.detach())

        def phases():
            s, h0, hb = clock.seconds, probe.head_fwd, probe.head_bwd_end
            m = marks
            return {"forward": s(m["t0"], h0), "lm_head_loss": s(h0, m["t1"]) + s(m["t1"], hb),
                    "backward": s(hb, m["t2"]), "norm_clip": s(m["t2"], m["t3"]), "optimizer": s(m["t3"], m["t4"]),
                    "zero_grad": s(m["t4"], m["t5"])}

        trainable = sum(p.numel() for p in params)
        return _measure(spec, clock, step, phases, check, trainable, notes)
    finally:
        if report is not None:
            import twinkle_patches as tp
            tp.revert(report)


@contextlib.contextmanager
def _swapped(obj, name, wrapper):
    """``obj.name`` replaced by ``wrapper(original)`` inside the block (the benchmark's own probes)."""
    original = getattr(obj, name)
    setattr(obj, name, wrapper(original))
    try:
        yield
    finally:
        setattr(obj, name, original)


class _Span:
    """Wraps a callable: while ``on``, each call's (start, end) marks are kept."""

    def __init__(self, clock):
        self.clock, self.on, self.spans = clock, False, []

    def __call__(self, fn):
        def wrapped(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            a = self.clock.mark()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spans.append((a, self.clock.mark()))
        return wrapped

    def total(self):
        return sum(self.clock.seconds(a, b) for a, b in self.spans)

    def reset(self):
        self.spans = []


def _run_facade(spec, clock, batch, check):
    import torch
    import twinkle_megatron as tm
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.pipeline_parallel import schedules
    from twinkle_megatron.training import fused_adam, step as stepping
    precision, kernels = spec["dtype"], spec["variant"] == "facade_twinkle"
    main_grad = _Span(clock)
    notes = []
    # megatron DDP's per-parameter backward hooks (main_grad.add_(grad)) are made when the chunks
    # are wrapped (set_optimizer): the benchmark's probe wraps each hook as it is made
    hook_maker = getattr(DistributedDataParallel, "_make_backward_post_hook", None)
    probe_ctx = _swapped(DistributedDataParallel, "_make_backward_post_hook",
                         lambda make: lambda self, param: main_grad(make(self, param))) \
        if hook_maker is not None else contextlib.nullcontext()
    with probe_ctx:
        model = tm.MegatronModel(spec["path"], mixed_precision=precision, use_twinkle_kernels=kernels)
        if spec["lora"]:
            import peft
            model.add_adapter_to_model("default", peft.LoraConfig(**LORA))
        model.set_optimizer("AdamW", lr=1e-5)
    if hook_maker is None:
        notes.append("main-grad accumulation not separable (no DDP._make_backward_post_hook): in backward")
    chunk = model.engine.chunks[-1]
    probe = _HeadProbe(chunk.decoder.final_layernorm, clock)
    state = model.train_state()
    trainable = sum(p.numel() for c in model.engine.chunks for p in c.parameters() if p.requires_grad)
    notes.append(f"fused LM-head loss={'on' if model.fused_linear_ce else 'off'}")
    spans = {k: _Span(clock) for k in ("backward_step", "finalise", "optimizer", "fused_step", "zero_grad")}
    marks = {}

    def step(instrument=False):
        probe.on = instrument
        for s in list(spans.values()) + [main_grad]:
            s.on, s.spans = instrument, []
        m = marks
        m["t0"] = clock.mark() if instrument else None
        out = model.forward_backward(inputs=batch)
        if instrument:
            m["t1"] = clock.mark()
        model.clip_grad_and_step(1.0)
        if instrument:
            m["t2"] = clock.mark()
        probe.on = False
        for s in list(spans.values()) + [main_grad]:
            s.on = False
        return float(out["loss"])

    def phases():
        s, h0, hb = clock.seconds, probe.head_fwd, probe.head_bwd_end
        m = marks
        (b0, b1), = spans["backward_step"].spans
        # a hook that ran before the gradient reached the body (the output layer's) is taken out
        # of the LM head's backward, the others out of the body's
        mg_head = sum(s(a, b) for a, b in main_grad.spans if s(hb, a) < 0)
        mg = main_grad.total()
        # the optimizer: megatron's step, or the one-pass AdamW of clip_grad_and_step (fused_adam)
        fin, zero = spans["finalise"].total(), spans["zero_grad"].total()
        opt = spans["optimizer"].total() + spans["fused_step"].total()
        return {"forward": s(m["t0"], h0), "lm_head_loss": s(h0, b0) + s(b0, hb) - mg_head,
                "backward": s(hb, b1) - (mg - mg_head), "main_grad": mg, "other": s(b1, m["t1"]), "grad_finalise": fin,
                "norm_clip": s(m["t1"], m["t2"]) - fin - opt - zero, "optimizer": opt, "zero_grad": zero,
                "_main_grad_hooks": len(main_grad.spans)}

    with contextlib.ExitStack() as stack:
        # the probes: module globals and instance attributes looked up at call time
        stack.enter_context(_swapped(schedules, "backward_step", spans["backward_step"]))
        stack.enter_context(_swapped(model.engine, "finalize_model_grads", spans["finalise"]))
        stack.enter_context(_swapped(stepping, "step", spans["optimizer"]))
        stack.enter_context(_swapped(fused_adam, "step", spans["fused_step"]))
        stack.enter_context(_swapped(stepping, "zero_grad", spans["zero_grad"]))
        try:
            return _measure(spec, clock, step, phases, check, trainable, notes, state=state)
        finally:
            probe.remove()
            del model
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def _measure(spec, clock, step, phases, check, trainable, notes, state=None):
    """The first step (its loss checked against the reference), then the timed steps, then the
    instrumented ones."""
    first = step()
    result = {"first_loss": first, "trainable": trainable, "notes": notes}
    problem = check(first)
    if problem:
        result.update(status="wrong", reason=problem)
        return result
    times, system, faults = [], [], []
    for _ in range(spec["steps"]):
        a = clock.mark()
        r0 = resource.getrusage(resource.RUSAGE_SELF)   # inside the clock's span, so within its time
        step()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        times.append(clock.seconds(a, clock.mark()))
        system.append(r1.ru_stime - r0.ru_stime)
        faults.append(r1.ru_minflt - r0.ru_minflt)
    parts = []
    for _ in range(spec["phase_steps"]):
        step(instrument=True)
        parts.append(phases())
    # keys starting with "_" are counts (how many hook calls a phase summed), not times
    keys = [k for k in parts[0] if not k.startswith("_")] if parts else []
    # CPU: how much of the step the kernel took (page faults: each fresh large tensor is faulted in
    # and zeroed page by page), the same steps' medians
    if spec["device"] == "cpu":
        result.update(system_s=_median(system), minor_faults=_median(faults))
    result.update(status="ok", step_s=_median(times), times=times,
                  phases={k: _median([p[k] for p in parts]) for k in keys},
                  counts={k[1:]: parts[-1][k] for k in (parts[0] if parts else ()) if k.startswith("_")})
    if spec.get("top_ops"):
        result["top_ops"] = _top_ops(step, spec["top_ops"], spec["device"])
    if spec.get("gemm_floor") and not spec["variant"].startswith("facade"):
        result["gemm_floor"] = _gemm_floor(step, spec["device"])
    return result


def _gemm_floor(step, device):
    """One more step with its matrix products recorded, then each replayed alone
    (:mod:`benchmarks.harness.gemm_floor`): the floor under the same products at this library's rate."""
    from benchmarks.harness import gemm_floor
    _, rec = gemm_floor.record(step)
    out = gemm_floor.replay(rec, device)
    out["rows"] = out["rows"][:GEMM_FLOOR_ROWS]
    return out


def _top_ops(step, n, device):
    """One more step under torch.profiler: the ``n`` ops with the most self time (CPU, or the
    device's on CUDA), as ``[name, calls, self seconds, share of all ops' self time]``."""
    import torch
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        step()
    attr = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, attr), reverse=True)
    total = sum(getattr(e, attr) for e in events) or 1
    return [[e.key, e.count, getattr(e, attr) / 1e6, getattr(e, attr) / total] for e in events[:n]]


def _reference_loss(spec):
    """transformers eager fp32, no grad: the first-step loss every variant must give."""
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["path"], dtype=torch.float32)
    batch = _batch(spec["vocab"], spec["batch"], spec["seq"])
    with torch.no_grad():
        loss = float(model(**batch).loss)
    del model
    gc.collect()
    return {"status": "ok", "loss": loss}


_INITIALIZED = []


def _initialize_facade():
    if _INITIALIZED:
        return
    import twinkle_megatron as tm
    from twinkle_megatron.parallel.launch import free_port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    tm.initialize(tm.DeviceMesh.from_sizes(world_size=1))
    _INITIALIZED.append(True)


def run_variant(spec: dict) -> dict:
    """One variant of one model in this process: ``spec`` as :func:`main` builds it. Returns
    ``{'status': 'ok' | 'wrong' | 'unavailable' | 'error', 'reason', 'first_loss', 'step_s',
    'times', 'phases', 'trainable', 'notes', 'peak_mb'}``."""
    import torch
    if spec["variant"] == "reference":
        try:
            return _reference_loss(spec)
        except Exception as e:   # every row of the model then says why
            return {"status": "error", "reason": f"{type(e).__name__}: {str(e)[:300]}"}
    clock = Clock(spec["device"])
    ref, rtol = spec["ref_loss"], LOSS_RTOL[spec["dtype"]]

    def check(loss):
        if not math.isfinite(loss):
            return f"first-step loss {loss} is not finite"
        rel = abs(loss - ref) / abs(ref)
        if rel > rtol:
            return (f"first-step loss {loss:.6f} differs from transformers eager fp32's {ref:.6f} by {rel:.2e} "
                    f"relative (> {rtol:g} for {spec['dtype']}): not timed")
        return None

    cuda = spec["device"] == "cuda"
    if cuda:   # the previous variant's memory given back first, so the peak is this one's
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    batch = _batch(spec["vocab"], spec["batch"], spec["seq"])
    facade = spec["variant"].startswith("facade")
    if spec["lora"]:   # LoRA on either side is peft's LoraConfig
        try:
            import peft  # noqa: F401
        except ImportError as e:
            return {"status": "unavailable", "reason": f"peft does not import here ({e})"}
    try:
        if facade:
            try:
                import megatron.core  # noqa: F401
            except ImportError as e:
                return {"status": "unavailable", "reason": f"megatron-core does not import here ({e})"}
            _initialize_facade()
            out = _run_facade(spec, clock, batch, check)
        else:
            out = _run_hf(spec, clock, batch, check)
    except Exception as e:   # the row reports it; the other variants still run
        return {"status": "error", "reason": f"{type(e).__name__}: {str(e)[:300]}",
                "traceback": traceback.format_exc()[-3000:]}
    if cuda:
        out["peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    elif spec.get("own_process"):
        out["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def _run_child(spec: dict, timeout: float) -> dict:
    """:func:`run_variant` in a fresh Python process (its peak RSS its own)."""
    with tempfile.TemporaryDirectory() as d:
        inp, outp = os.path.join(d, "spec.json"), os.path.join(d, "result.json")
        with open(inp, "w") as f:
            json.dump(dict(spec, own_process=True), f)
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        try:
            proc = subprocess.run([sys.executable, "-m", "benchmarks.scripts.train_step", "--child", inp, outp],
                                  cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"status": "error", "reason": f"timed out after {timeout:.0f} s"}
        if proc.returncode != 0 or not os.path.exists(outp):
            return {"status": "error", "reason": f"the variant's process exited with {proc.returncode}: "
                                                 f"{(proc.stderr or proc.stdout)[-400:]}"}
        with open(outp) as f:
            return json.load(f)


# ---- the report ------------------------------------------------------------------------------------

def _fmt(x, spec="{:.3f}"):
    return "—" if x is None else spec.format(x)


def _ratio(base, mine):
    return None if base is None or mine is None or mine <= 0 else base / mine


def render(meta: dict, rows: list) -> str:
    """The markdown report: the step table, then the phase table."""
    unit = "CUDA-event s" if meta["device"] == "cuda" else "CPU s"
    mem = "peak GPU memory (GB)" if meta["device"] == "cuda" else "peak RSS (GB)"
    lines = [f"# One training step, transformers against the facade ({meta['date']}, {meta['device']})", "",
             f"- machine: {meta['machine']}; torch {meta['torch']}, transformers {meta['transformers']}, "
             f"megatron-core {meta['megatron']}; load average at the start {meta['load_start']}, at the end "
             f"{meta['load_end']}",
             f"- {meta['batch']} x {meta['seq']} tokens, random weights; median {unit} per step of {meta['steps']} "
             f"after one warm-up step (the loss-checked first step); phases: median of {meta['phase_steps']} "
             "further instrumented steps; ratios from this one run",
             "- ratios: the same model, dtype and LoRA setting; `LoRA vs full`: the same variant's full step "
             "over its LoRA step", ""]
    for m in meta["models"]:
        lines.append(f"- {m['name']}: {m['desc']}, {m['layers']} layers, hidden {m['hidden']}, vocab {m['vocab']}"
                     f"{', tiny widths (the test mode: not a measurement)' if meta['tiny'] else ''}")
    lines += ["", f"| model | dtype | variant | LoRA | trainable params | first loss | {unit} / step | "
                  f"vs transformers eager | vs transformers autocast | LoRA vs full | {mem} | notes |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    index = {(r["model"], r["dtype"], r["variant"], r["lora"]): r for r in rows}
    for r in rows:
        eager = index.get((r["model"], r["dtype"], "hf_eager", r["lora"]), {})
        auto = index.get((r["model"], r["dtype"], "hf_autocast", r["lora"]), {})
        full = index.get((r["model"], r["dtype"], r["variant"], False), {}) if r["lora"] else {}
        t = r.get("step_s") if r["status"] == "ok" else None
        notes = "; ".join(r.get("notes", [])) if r["status"] == "ok" else f"**{r['status']}**: {r.get('reason')}"
        peak = r.get("peak_mb")
        lines.append(
            f"| {r['model']} | {r['dtype']} | {LABELS[r['variant']]} | {'r=8' if r['lora'] else 'no'} | "
            f"{_fmt(r.get('trainable'), '{:,}')} | {_fmt(r.get('first_loss'), '{:.5f}')} | {_fmt(t)} | "
            f"{_fmt(_ratio(eager.get('step_s'), t), '{:.2f}x')} | {_fmt(_ratio(auto.get('step_s'), t), '{:.2f}x')} | "
            f"{_fmt(_ratio(full.get('step_s'), t), '{:.2f}x')} | "
            f"{_fmt(None if peak is None else peak / 1024, '{:.2f}')} | {notes} |")
    lines += ["", f"## Phases ({unit} per step; see the script's docstring for how each is taken)", "",
              "| model | dtype | variant | LoRA | " + " | ".join(PHASE_TITLES[p] for p in PHASES) + " | sum |",
              "|---|---|---|---|" + "---|" * (len(PHASES) + 1)]
    for r in rows:
        ph = r.get("phases") or {}
        if r["status"] != "ok" or not ph:
            continue
        lines.append(f"| {r['model']} | {r['dtype']} | {LABELS[r['variant']]} | {'r=8' if r['lora'] else 'no'} | "
                     + " | ".join(_fmt(ph.get(p)) for p in PHASES) + f" | {_fmt(sum(ph.values()))} |")
    for r in rows:
        if r.get("top_ops"):
            lines += ["", f"## {r['model']} {r['dtype']}, {LABELS[r['variant']]}{', LoRA r=8' if r['lora'] else ''}: "
                          f"top ops by self {'device' if meta['device'] == 'cuda' else 'CPU'} time (one step under "
                          "torch.profiler)", "", "| op | calls | self s | share |", "|---|---|---|---|"]
            lines += [f"| `{k}` | {c} | {t:.3f} | {sh:.1%} |" for k, c, t, sh in r["top_ops"]]
    lines += _render_system(meta, rows)
    lines += _render_gemm_floor(rows, index, unit)
    lines += ["", f"Produced by `python -m benchmarks.scripts.train_step {meta['argv']}`."]
    return "\n".join(lines) + "\n"


def _render_system(meta, rows):
    """CPU: each row's system time and minor page faults per timed step (``getrusage``)."""
    rows = [r for r in rows if r["status"] == "ok" and r.get("system_s") is not None]
    if not rows:
        return []
    lines = ["", "## System time and page faults (CPU; `getrusage` over each timed step, medians)", "",
             "The kernel's share of the CPU time per step: mostly first-touch page faults, each fresh "
             "tensor past the allocator's cache being mapped and zeroed page by page. torch's "
             f"`THP_MEM_ALLOC_ENABLE` (2 MiB pages for large tensors): {meta.get('thp_alloc', 'unset')}.",
             "", "| model | dtype | variant | LoRA | CPU s / step | of which system | minor page faults / step |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['dtype']} | {LABELS[r['variant']]} | {'r=8' if r['lora'] else 'no'} | "
                     f"{r['step_s']:.3f} | {r['system_s']:.3f} | {r['minor_faults']:,} |")
    return lines


def _render_gemm_floor(rows, index, unit):
    """The GEMM floor section: per transformers row, its step's products replayed alone, and the
    most any implementation of the same products at this library's rate can gain over that row."""
    floors = [r for r in rows if r["status"] == "ok" and r.get("gemm_floor")]
    if not floors:
        return []
    lines = ["", f"## GEMM floor ({unit}; `benchmarks/harness/gemm_floor.py`)", "",
             "One more step of each transformers row with its matrix products recorded (ATen `mm`, `addmm`, "
             "`bmm`, `baddbmm`, `addbmm`, `_grouped_mm`, forward and backward, in the dtypes they ran in), each "
             "distinct product then replayed alone on fresh operands (median of 3) and summed by count. A lower "
             "bound: warm operands, no attention kernels, no elementwise work. `ceiling` is the row's step over "
             "that sum: no implementation doing the same products in the same dtypes with this library can be "
             "faster than that over the row.", "",
             "| model | dtype | variant | LoRA | products (distinct) | TFLOP | GEMM s | GFLOP/s | step | GEMM share "
             "| ceiling | facade, twinkle kernels | facade vs this |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in floors:
        g, t = r["gemm_floor"], r["step_s"]
        facade = index.get((r["model"], r["dtype"], "facade_twinkle", r["lora"]), {})
        ft = facade.get("step_s") if facade.get("status") == "ok" else None
        lines.append(
            f"| {r['model']} | {r['dtype']} | {LABELS[r['variant']]} | {'r=8' if r['lora'] else 'no'} | "
            f"{g['calls']} ({g['distinct']}) | {g['flops'] / 1e12:.3f} | {g['seconds']:.3f} | "
            f"{_fmt(g['flops'] / g['seconds'] / 1e9 if g['seconds'] > 0 else None, '{:.0f}')} | {t:.3f} | "
            f"{_fmt(g['seconds'] / t if t else None, '{:.0%}')} | {_fmt(_ratio(t, g['seconds']), '{:.2f}x')} | "
            f"{_fmt(ft)} | {_fmt(_ratio(t, ft), '{:.2f}x')} |")
    for r in floors:
        lines += ["", f"{r['model']} {r['dtype']}, {LABELS[r['variant']]}{', LoRA r=8' if r['lora'] else ''}: "
                      "the products with the most time", "",
                  "| op | shapes | dtype | calls | s / call | GFLOP / call |", "|---|---|---|---|---|---|"]
        lines += [f"| `{op}` | {' x '.join(str(s) for s in shapes)} | {dt} | {n} | {s:.4f} | {f / 1e9:.2f} |"
                  for op, shapes, dt, n, s, f in r["gemm_floor"]["rows"]]
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--layers", type=int, default=None, help="depth of every model (default: per model)")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=None,
                   help="cut every model's vocabulary to this many rows (default: the published one)")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--lora", action="store_true", help="also each variant with LoRA r=8 on all linear layers")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--phase-steps", type=int, default=1)
    p.add_argument("--top-ops", type=int, default=0,
                   help="also one step under torch.profiler per variant: its N ops with the most self time")
    p.add_argument("--gemm-floor", action="store_true",
                   help="also, per transformers variant, one step's matrix products replayed alone: the floor "
                        "under any implementation of the same products with this GEMM library")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--in-process", action="store_true", help="run every variant in this process (no peak RSS)")
    p.add_argument("--tiny", action="store_true", help="tiny widths: the test mode, measures nothing")
    p.add_argument("--child-timeout", type=float, default=3600.0)
    p.add_argument("--workdir", default=None, help="where the random checkpoints go (default: a temporary folder)")
    p.add_argument("--out", default=None, help="markdown report; the rows also go to the same name with .json")
    p.add_argument("--strict", action="store_true",
                   help="exit with 1 when a row ended in an error (a missing package or a refused loss does not)")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        with open(a.child[0]) as f:
            spec = json.load(f)
        result = run_variant(spec)
        with open(a.child[1], "w") as f:
            json.dump(result, f)
        return result

    import torch
    import transformers
    models = [m for m in a.models.split(",") if m]
    dtypes = [d for d in a.dtypes.split(",") if d]
    variants = [v for v in a.variants.split(",") if v]
    for d in dtypes:
        if d not in LOSS_RTOL:
            raise ValueError(f"--dtypes: unknown dtype {d!r}; known: fp32, bf16")
    for v in variants:
        if v not in LABELS:
            raise ValueError(f"--variants: unknown variant {v!r}; known: {', '.join(LABELS)}")
    for name in models:
        model_config(name, a.layers, a.tiny, a.vocab)   # refuses an unknown name
    if a.steps < 1 or a.phase_steps < 0:
        raise ValueError(f"--steps must be >= 1 and --phase-steps >= 0, got {a.steps}, {a.phase_steps}")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here")
    in_process = a.in_process or a.device == "cuda"
    try:
        import megatron.core
        mcore = megatron.core.__version__
    except ImportError:
        mcore = "not installed"
    from benchmarks.harness.env import cpu_model
    meta = dict(date=str(datetime.date.today()), device=a.device,
                machine=f"{cpu_model()}, {os.cpu_count()} cores"
                        + (f", {torch.cuda.get_device_name(0)}" if a.device == "cuda" else ""),
                torch=torch.__version__, transformers=transformers.__version__, megatron=mcore,
                load_start=f"{os.getloadavg()[0]:.1f}", batch=a.batch, seq=a.seq, steps=a.steps,
                phase_steps=a.phase_steps, tiny=a.tiny,
                thp_alloc=os.environ.get("THP_MEM_ALLOC_ENABLE", "unset"), argv=" ".join(sys.argv[1:] if argv is None else argv),
                models=[])
    rows = []
    run = (lambda spec: run_variant(spec)) if in_process else (lambda spec: _run_child(spec, a.child_timeout))
    with tempfile.TemporaryDirectory(dir=a.workdir) as root:
        for name in models:
            cfg = model_config(name, a.layers, a.tiny, a.vocab)
            meta["models"].append(dict(name=name, desc=MODELS[name][2], layers=cfg["num_hidden_layers"],
                                       hidden=cfg["hidden_size"], vocab=cfg["vocab_size"]))
            path = os.path.join(root, name)
            torch.manual_seed(0)
            hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg),
                                                               dtype=torch.float32)
            hf.save_pretrained(path)
            del hf
            gc.collect()
            base = dict(model=name, path=path, vocab=cfg["vocab_size"], moe=bool(cfg.get("num_experts")),
                        seq=a.seq, batch=a.batch, steps=a.steps, phase_steps=a.phase_steps, device=a.device,
                        top_ops=a.top_ops, gemm_floor=a.gemm_floor)
            ref = run(dict(base, variant="reference", dtype="fp32", lora=False, ref_loss=None))
            print(f"{name}: reference loss {ref.get('loss')}", flush=True)
            for dtype in dtypes:
                for lora in ((False, True) if a.lora else (False,)):
                    for v in variants:
                        row = dict(model=name, dtype=dtype, variant=v, lora=lora)
                        if v == "hf_autocast" and dtype != "bf16":
                            continue   # autocast bf16 over fp32 parameters: a bf16 variant
                        if ref.get("status") != "ok":
                            row.update(status="error", reason=f"no reference loss: {ref.get('reason')}")
                        else:
                            row.update(run(dict(base, variant=v, dtype=dtype, lora=lora, ref_loss=ref["loss"])))
                        rows.append(row)
                        print({k: row.get(k) for k in ("model", "dtype", "variant", "lora", "status", "step_s",
                                                       "first_loss", "reason")}, flush=True)
    meta["load_end"] = f"{os.getloadavg()[0]:.1f}"
    if _INITIALIZED:
        import twinkle_megatron as tm
        tm.shutdown()
    text = render(meta, rows)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
        with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return {"meta": meta, "rows": rows, "text": text}


if __name__ == "__main__":
    out = main()
    if "--strict" in sys.argv and "rows" in out and any(r["status"] == "error" for r in out["rows"]):
        sys.exit(1)
