"""Model steps: a tiny Hugging Face model's training step unpatched vs patched by
``twinkle_patches``, and the Megatron training step of ``twinkle_megatron``.

HF step = forward with labels + ``loss.backward()`` (no optimizer), random weights from a
config (no hub). The patched step must give the same loss as the unpatched one (relative
difference within 10x the dtype's tolerance) or it is marked wrong. Megatron runs in a child
process (it initialises torch.distributed with gloo, world size 1) and times
``forward_backward`` + ``clip_grad_and_step``.

The sides of each comparison are timed in interleaved rounds (unpatched, patched,
unpatched, ...; local, twinkle, local, twinkle) and each side's runs are pooled: on a shared
machine, load that comes and goes then falls on both sides alike. Timed one after the other,
the same tiny HF MoE step read 0.72x, 0.92x and 1.42x in three runs.

Adding a row (each is one table entry; the loop, the loss check and the rows are shared):

- an HF variant: an entry of :data:`HF_VARIANTS`, a context manager factory
  ``variant(model, cfg)`` that changes the model on entry (yielding a note for the row, e.g. what
  was swapped), restores it on exit, and raises :class:`Missing` when it cannot run here. Its
  loss is checked against the unpatched one before it is timed. A variant named in
  :data:`HF_BASELINES` is also compared with another variant of the same run (``vs_baseline``).
- a Megatron variant: an entry of :data:`MEGATRON_VARIANTS`, ``build(hf_config, mesh)`` ->
  a ``MegatronModel`` with its optimizer set, run in the child process. The first variant
  is the baseline of the others' ``vs_eager``.
- the LM-head comparison: :data:`FUSED_CE_VARIANTS` (``megatron-fused-ce``: with and without
  ``fused_linear_ce`` at a large vocabulary, peak memory next to time).
- another kind of model step: a function ``cfg -> rows`` in :data:`MODEL_STEPS` (selected
  with ``--model-steps``).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from typing import Callable, ContextManager, Dict, List, Optional, Sequence

import torch

from twinkle_megatron.parallel.launch import free_port

from . import timing
from .env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HF_ROUNDS = 4        # unpatched / patched alternations of the HF step
MEGATRON_ROUNDS = 3  # local / twinkle child-process alternations of the Megatron step


def step_timing_kw(cfg) -> dict:
    """Model steps are few and their ratios are what is read: a longer budget than the ops'."""
    kw = cfg.timing_kw()
    if cfg.quick:
        kw = dict(kw, warmup=2, min_reps=12, max_reps=60, budget_s=1.2)
    return kw


def import_twinkle_patches():
    """``twinkle_patches`` (installed, or the ``patches/`` folder of this checkout)."""
    if "twinkle_patches" in sys.modules:
        return sys.modules["twinkle_patches"]
    if importlib.util.find_spec("twinkle_patches") is None:
        init = os.path.join(ROOT, "patches", "__init__.py")
        if not os.path.exists(init):
            return None
        spec = importlib.util.spec_from_file_location("twinkle_patches", init,
                                                      submodule_search_locations=[os.path.dirname(init)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["twinkle_patches"] = mod
        spec.loader.exec_module(mod)
        return mod
    return importlib.import_module("twinkle_patches")


def tiny_config(family: str, quick: bool):
    """A small config of ``family`` ("qwen3", "qwen3_moe", "qwen3_5"); real head geometry ratios."""
    h, layers, inter = (128, 2, 256) if quick else (512, 4, 1024)
    common = dict(hidden_size=h, num_hidden_layers=layers, intermediate_size=inter, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=h // 4, vocab_size=512, max_position_embeddings=4096)
    if family == "qwen3":
        from transformers import Qwen3Config
        return Qwen3Config(**common)
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        return Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=inter // 4,
                              decoder_sparse_step=1, mlp_only_layers=[])
    if family == "qwen3_5":
        from transformers import Qwen3_5TextConfig
        return Qwen3_5TextConfig(**common, linear_num_key_heads=2, linear_num_value_heads=4,
                                 linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
                                 layer_types=["linear_attention", "full_attention"] * (layers // 2))
    raise ValueError(f"unknown family {family!r}")


def _build(family: str, quick: bool, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, quick)).to(device=device, dtype=dtype)
    return model


def _batch(quick: bool, device):
    b, s = (2, 64) if quick else (4, 512)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (b, s), generator=gen).to(device)
    return ids, f"batch {b}x{s}"


class Missing(Exception):
    """A variant that cannot run here; the message is the row's reason."""


@contextlib.contextmanager
def _twinkle_patches(model, cfg=None, **apply_kw):
    try:
        tp = import_twinkle_patches()
    except Exception as e:
        raise Missing(f"twinkle_patches failed to import ({type(e).__name__}: {e})")
    if tp is None:
        raise Missing("twinkle_patches is not importable")
    if not hasattr(tp, "apply"):
        raise Missing("twinkle_patches has no apply() yet")
    report = tp.apply(model, **apply_kw)
    try:
        yield (f"swapped {len(getattr(report, 'swapped', []) or [])}, "
               f"skipped {len(getattr(report, 'skipped', []) or [])}")
    finally:
        tp.revert(report)


def _compiled(patched: bool, under_compile: Optional[str] = None):
    """``torch.compile`` of the model (``nn.Module.compile``, backend ``cfg.compile_backend``), after
    ``twinkle_patches.apply`` when ``patched`` (with ``under_compile=`` when given, else apply's default)."""
    @contextlib.contextmanager
    def variant(model, cfg=None):
        if os.environ.get("TORCHDYNAMO_DISABLE", "") not in ("", "0"):
            raise Missing("TORCHDYNAMO_DISABLE is set: torch.compile would run eager")
        backend = getattr(cfg, "compile_backend", None) or "inductor"
        with contextlib.ExitStack() as stack:
            kw = {} if under_compile is None else {"under_compile": under_compile}
            note = stack.enter_context(_twinkle_patches(model, cfg, **kw)) + "; " if patched else ""
            if under_compile is not None:
                note += f"under_compile={under_compile!r}; "
            # apply swaps in the same patched classes every round (no recompile); room for the graphs
            # of each side (unpatched, and one per under_compile choice) in the shared code caches
            stack.enter_context(torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=1024))
            model.compile(backend=backend)
            stack.callback(setattr, model, "_compiled_call_impl", None)
            yield note + f"torch.compile(backend={backend!r})"
    return variant


# provider name -> variant(model, cfg): a context manager (see the module docstring)
HF_VARIANTS: Dict[str, Callable[..., ContextManager[str]]] = {
    "twinkle_patches": _twinkle_patches,
    "torch.compile": _compiled(patched=False),
    "torch.compile + twinkle_patches": _compiled(patched=True),
    # apply's other under_compile choices, run when asked for (--hf-variants)
    "torch.compile + twinkle_patches (kernels)": _compiled(patched=True, under_compile="kernels"),
    "torch.compile + twinkle_patches (decompose_rowwise)": _compiled(patched=True, under_compile="decompose_rowwise"),
    "torch.compile + twinkle_patches (decompose_all)": _compiled(patched=True, under_compile="decompose_all"),
}
# variants run only when named (cfg.hf_variants, --hf-variants); every other one runs by default
HF_OPT_IN_VARIANTS = tuple(n for n in HF_VARIANTS if n.startswith("torch.compile + twinkle_patches ("))
# variant -> the variant it is also compared with (row fields ``baseline`` and ``vs_baseline`` =
# baseline median / this median): the bar of a compiled patched model is the compiled unpatched one
HF_BASELINES: Dict[str, str] = {name: "torch.compile" for name in HF_VARIANTS
                                if name.startswith("torch.compile + twinkle_patches")}


def _row(base: dict, provider: str, t: timing.Timing, **extra) -> dict:
    if t.cpu is not None:  # the process CPU time per step: steadier than wall time on a shared machine
        extra = dict(extra, cpu_median_ms=t.cpu.median_ms)
    return dict(base, provider=provider, status="ok", median_ms=t.median_ms, p20_ms=t.p20_ms, p80_ms=t.p80_ms,
                min_ms=t.min_ms, reps=t.reps, achieved=1e3 / t.median_ms, **extra)


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:300]


def hf_steps(cfg, families=("qwen3", "qwen3_moe", "qwen3_5"), variants: Optional[Sequence[str]] = None) -> List[dict]:
    """The HF training step per family and dtype: unpatched, and each of :data:`HF_VARIANTS`
    (``variants``, else ``cfg.hf_variants``, else all but :data:`HF_OPT_IN_VARIANTS`) whose loss matches the
    unpatched one, timed in :data:`HF_ROUNDS` interleaved rounds."""
    from twinkle_kernels import testing
    dev = cfg.device
    rows: List[dict] = []
    if variants is None:
        variants = getattr(cfg, "hf_variants", None) or [n for n in HF_VARIANTS if n not in HF_OPT_IN_VARIANTS]
    names = list(variants)
    ids, batch_label = _batch(cfg.quick, dev)
    # --quick steps only the first dtype: a tiny model step costs seconds on a loaded CPU
    dtypes = cfg.dtypes[:1] if cfg.quick else cfg.dtypes
    for family in families:
        for dt in dtypes:
            dname = str(dt).replace("torch.", "")
            base = dict(kind="model_step", op=f"hf-{family}", shape=batch_label, dtype=dname, mode="fwd+bwd",
                        device=dev.type, metric="steps/s")
            try:
                model = _build(family, cfg.quick, dt, dev)
            except Exception as e:
                rows.append(dict(base, provider="unpatched", status="error", reason=f"build: {e}"[:300]))
                continue

            def step():
                model.zero_grad(set_to_none=True)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                return loss.detach()

            try:
                loss0 = float(step())
            except Exception as e:
                rows.append(dict(base, provider="unpatched", status="error", reason=str(e)[:300]))
                continue
            cpu: Dict[str, List[float]] = {}  # side -> process CPU time of each run (CPU devices)

            def timed(name, kw):
                t = timing.time_fn(step, dev, **kw)
                cpu.setdefault(name, []).extend(t.cpu_times)
                return t.times
            sides = {"unpatched": lambda kw: timed("unpatched", kw)}
            checked: Dict[str, dict] = {}   # variant -> loss and note of the untimed check
            others: List[dict] = []         # rows of variants that are not timed
            for name in names:
                try:
                    with HF_VARIANTS[name](model, cfg) as note:
                        loss1 = float(step())
                except Missing as e:
                    others.append(dict(base, provider=name, status="missing", reason=str(e)))
                    continue
                except Exception as e:
                    others.append(dict(base, provider=name, status="error", reason=_error(e)))
                    continue
                atol, rtol = testing.tolerance(dt)
                rel = abs(loss1 - loss0) / max(abs(loss0), 1e-12)
                if rel > 10 * rtol:
                    others.append(dict(base, provider=name, status="wrong", loss=loss1,
                                       reason=f"loss {loss1:.6g} vs unpatched {loss0:.6g} (rel {rel:.2e})"))
                    continue
                checked[name] = dict(loss=loss1, note=note)

                def variant_round(kw, name=name):
                    with HF_VARIANTS[name](model, cfg):
                        return timed(name, kw)
                sides[name] = variant_round
            timings, errors = timing.interleaved(sides, step_timing_kw(cfg), HF_ROUNDS if len(sides) > 1 else 1)
            for name, t in timings.items():
                t.cpu_times = cpu.get(name, [])
            if "unpatched" in errors:
                rows.append(dict(base, provider="unpatched", status="error", reason=_error(errors["unpatched"])))
                rows.extend(others)
                continue
            t0 = timings["unpatched"]
            rows.append(_row(base, "unpatched", t0, loss=loss0))
            for name, info in checked.items():
                if name in errors:
                    rows.append(dict(base, provider=name, status="error", reason=_error(errors[name])))
                    continue
                t1 = timings[name]
                extra, vs = {}, ""
                ref = HF_BASELINES.get(name)
                if ref in timings:
                    extra = dict(baseline=ref, vs_baseline=timings[ref].median_ms / t1.median_ms)
                    vs = f"{extra['vs_baseline']:.2f}x vs {ref}"
                    if timings[ref].cpu is not None and t1.cpu is not None:
                        extra["vs_baseline_cpu"] = timings[ref].cpu.median_ms / t1.cpu.median_ms
                        vs += f" ({extra['vs_baseline_cpu']:.2f}x in CPU time)"
                note = "; ".join(x for x in (vs, info["note"], f"{HF_ROUNDS} interleaved rounds") if x)
                rows.append(_row(base, name, t1, loss=info["loss"], vs_eager=t0.median_ms / t1.median_ms,
                                 reason=note, **extra))
            rows.extend(others)
    return rows


# --- Megatron (child process) -------------------------------------------------------------------
def _megatron_model(use_twinkle_kernels: bool):
    def build(hf_cfg: dict, mesh):
        import twinkle_megatron as tm
        model = tm.MegatronModel(hf_cfg, device_mesh=mesh, mixed_precision="fp32",
                                 use_twinkle_kernels=use_twinkle_kernels)
        model.set_optimizer("AdamW", lr=1e-4)
        return model
    return build


# label -> build(hf_config dict, mesh) -> MegatronModel with its optimizer set (run in the child);
# the first entry is the baseline of the others' vs_eager
MEGATRON_VARIANTS: Dict[str, Callable] = {
    "local": _megatron_model(False),
    "twinkle": _megatron_model(True),
}


def _megatron_lora(targets):
    def build(hf_cfg: dict, mesh):
        import twinkle_megatron as tm
        model = tm.MegatronModel(hf_cfg, device_mesh=mesh, mixed_precision="fp32", use_twinkle_kernels=True)
        model.add_adapter_to_model("default", {"r": 8, "lora_alpha": 16, "target_modules": targets})
        model.set_optimizer("AdamW", lr=1e-4)
        return model
    return build


def _megatron_fused_ce(fused: bool):
    def build(hf_cfg: dict, mesh):
        import twinkle_megatron as tm
        model = tm.MegatronModel(hf_cfg, device_mesh=mesh, mixed_precision="fp32", use_twinkle_kernels=True,
                                 fused_linear_ce=fused)
        model.set_optimizer("AdamW", lr=1e-4)
        return model
    return build


# the LM-head comparison (megatron_fused_ce_steps): output_layer + vocab-parallel log-softmax vs
# the fused linear cross-entropy, both on the twinkle spec, at a large vocabulary
FUSED_CE_VARIANTS: Dict[str, Callable] = {"unfused": _megatron_fused_ce(False),
                                          "fused_linear_ce": _megatron_fused_ce(True)}


def fused_ce_shape(quick: bool) -> dict:
    """A tiny model with a large vocabulary, where the logits dominate the step's memory."""
    return dict(vocab=32768, batch=(4, 512)) if quick else dict(vocab=151936, batch=(4, 512))


def megatron_fused_ce_steps(cfg, family: str = "qwen3") -> List[dict]:
    """The megatron step (twinkle spec, one process) with and without ``fused_linear_ce`` at a
    large vocabulary (:func:`fused_ce_shape`), each round a fresh child process per side
    (:data:`FUSED_CE_VARIANTS`, interleaved). Memory: the step's peak resident set over the one
    before it (Linux VmHWM after resetting it, over VmRSS, once the optimizer state exists), the
    largest over the rounds, in ``peak_mem_bytes``; the fused row's ``vs_eager`` is its speed-up and its
    reason the memory ratio and the largest loss difference of the first three steps."""
    shape = fused_ce_shape(cfg.quick)
    (b, s), vocab = shape["batch"], shape["vocab"]
    base = dict(kind="model_step", op=f"megatron-{family}-lm-head", shape=f"batch {b}x{s} vocab {vocab}",
                dtype="float32", mode="fwd+bwd+step", device=cfg.device.type, metric="steps/s")
    env = child_env({"TORCHDYNAMO_DISABLE": "1"})
    peaks: Dict[str, List[int]] = {}
    losses: Dict[str, List[float]] = {}

    def child(name):
        def one_round(kw):
            out = _run_megatron_child(env, quick=cfg.quick, variant=name, timing=kw, family=family, vocab_size=vocab,
                                  batch=[b, s], record_steps=3)
            peaks.setdefault(name, []).append(out["step_peak_bytes"])
            losses[name] = out["losses"]
            return out["times"]
        return one_round

    names = list(FUSED_CE_VARIANTS)
    timings, errors = timing.interleaved({n: child(n) for n in names}, step_timing_kw(cfg), MEGATRON_ROUNDS)
    rows = []
    ref = names[0]
    for name in names:
        provider = f"twinkle_megatron ({name})"
        if name in errors:
            rows.append(dict(base, provider=provider, status="error", reason=str(errors[name])[:300]))
            continue
        peak = None if None in peaks[name] else max(peaks[name])
        note = "step peak RSS not measured here" if peak is None else f"step peak RSS +{peak / 2**20:.0f} MiB"
        extra = {}
        if name != ref and ref in timings:
            diff = max(abs(x - y) for x, y in zip(losses[name], losses[ref]))
            extra["vs_eager"] = timings[ref].median_ms / timings[name].median_ms
            if peak is not None and None not in peaks[ref]:
                # a step can stay within the memory the process already peaked at: +0 MiB, no ratio
                ref_peak = max(peaks[ref])
                note += f" = {peak / ref_peak:.2f}x unfused" if ref_peak > 0 else " (unfused: +0 MiB)"
            note += f"; 3-step losses within {diff:.0e} of unfused"
            if diff > 1e-5 * max(1.0, abs(losses[ref][0])):
                rows.append(dict(base, provider=provider, status="wrong", loss=losses[name][0],
                                 reason=f"losses {losses[name]} vs unfused {losses[ref]}"))
                continue
        note += f"; {MEGATRON_ROUNDS} interleaved fresh-process rounds"
        rows.append(_row(base, provider, timings[name], peak_mem_bytes=peak, loss=losses[name][0], reason=note,
                         **extra))
    return rows


# the LoRA comparison (megatron_lora_steps): full-parameter training vs r=8 adapters on every
# linear and on peft's default Qwen targets (q_proj, v_proj)
LORA_VARIANTS: Dict[str, Callable] = {"full": _megatron_model(True),
                                      "lora r=8 all-linear": _megatron_lora("all-linear"),
                                      "lora r=8 q,v": _megatron_lora(["q_proj", "v_proj"])}


def megatron_lora_steps(cfg, family: str = "qwen3") -> List[dict]:
    """The megatron step (twinkle spec, one process) of full-parameter training vs LoRA adapters
    (:data:`LORA_VARIANTS`) on the same model, interleaved; ``bytes`` is the optimizer state after the
    timed steps (Adam moments and any fp32 main copies), the LoRA row's reason its share of the
    full state and ``vs_eager`` its speed-up over the full step; on the CPU ``cpu_median_ms`` is
    the process CPU time of a step (less sensitive than wall time to other load on the machine)."""
    base = dict(kind="model_step", op=f"megatron-{family}-lora", shape="batch 2x64" if cfg.quick else "batch 4x512",
                dtype="float32", mode="fwd+bwd+step", device=cfg.device.type, metric="steps/s")
    env = child_env({"TORCHDYNAMO_DISABLE": "1"})
    state_bytes: Dict[str, int] = {}
    cpu_times: Dict[str, List[float]] = {n: [] for n in LORA_VARIANTS}

    def child(name):
        def one_round(kw):
            out = _run_megatron_child(env, quick=cfg.quick, variant=name, timing=kw, family=family)
            state_bytes[name] = out["optimizer_state_bytes"]
            cpu_times[name] += out.get("cpu_times", [])
            return out["times"]
        return one_round

    names = list(LORA_VARIANTS)
    timings, errors = timing.interleaved({n: child(n) for n in names}, step_timing_kw(cfg), MEGATRON_ROUNDS)
    rows = []
    for name in names:
        provider = f"twinkle_megatron ({name})"
        if name in errors:
            rows.append(dict(base, provider=provider, status="error", reason=str(errors[name])[:300]))
            continue
        extra, note = {}, f"{MEGATRON_ROUNDS} interleaved rounds; optimizer state {state_bytes[name]} bytes"
        if name != names[0] and names[0] in timings:
            extra["vs_eager"] = timings[names[0]].median_ms / timings[name].median_ms
            note += f" ({100 * state_bytes[name] / state_bytes[names[0]]:.2f}% of full training's)"
        if cpu_times[name]:
            extra["cpu_median_ms"] = timing.summarize(cpu_times[name]).median_ms
            note += f"; CPU time {extra['cpu_median_ms']:.2f} ms/step"
            if name != names[0] and cpu_times[names[0]]:
                note += f" ({timing.summarize(cpu_times[names[0]]).median_ms / extra['cpu_median_ms']:.2f}x full's)"
        rows.append(_row(base, provider, timings[name], bytes=state_bytes[name], reason=note, **extra))
    return rows


def _optimizer_state_bytes(model) -> int:
    """Bytes of the optimizer's tensors: Adam's moments (and fp32 main params where the optimizer
    keeps copies of bf16 weights)."""
    total = 0
    for o in getattr(model.optimizer, "chained_optimizers", [model.optimizer]):
        for state in o.optimizer.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t) and t.dim())
        for group in getattr(o, "fp32_from_float16_groups", []) or []:
            total += sum(p.numel() * p.element_size() for p in group)
    return total


def megatron_steps(cfg, families=("qwen3", "qwen3_moe", "qwen3_5"),
                   variants: Optional[Sequence[str]] = None) -> List[dict]:
    """The megatron training step (one process) per model family, one row per variant of
    :data:`MEGATRON_VARIANTS` (default all: local vs twinkle layer specs)."""
    names = list(MEGATRON_VARIANTS) if variants is None else list(variants)
    return [row for family in families for row in _megatron_family_steps(cfg, family, names)]


def _megatron_family_steps(cfg, family: str, names: Sequence[str]) -> List[dict]:
    base = dict(kind="model_step", op=f"megatron-{family}", shape="batch 2x64" if cfg.quick else "batch 4x512",
                dtype="float32", mode="fwd+bwd+step", device=cfg.device.type, metric="steps/s")
    try:
        import twinkle_megatron as tm
    except Exception as e:
        return [dict(base, provider="twinkle_megatron", status="missing", reason=f"twinkle_megatron: {e}")]
    if not hasattr(tm, "MegatronModel"):
        return [dict(base, provider="twinkle_megatron", status="missing",
                     reason="twinkle_megatron has no MegatronModel yet")]
    rounds = MEGATRON_ROUNDS if len(names) > 1 else 1
    env = child_env({"TORCHDYNAMO_DISABLE": "1"})

    def child(name):
        def one_round(kw):
            return _run_megatron_child(env, quick=cfg.quick, variant=name, timing=kw, family=family)["times"]
        return one_round

    timings, errors = timing.interleaved({name: child(name) for name in names}, step_timing_kw(cfg), rounds)
    rows = []
    baseline = timings.get(names[0]) if names else None
    for i, name in enumerate(names):
        provider = f"twinkle_megatron ({name})"
        if name in errors:
            rows.append(dict(base, provider=provider, status="error", reason=str(errors[name])[:300]))
            continue
        t = timings[name]
        extra = {"vs_eager": baseline.median_ms / t.median_ms} if i > 0 and baseline is not None else {}
        rows.append(_row(base, provider, t, reason=f"{rounds} interleaved rounds" if rounds > 1 else "", **extra))
    return rows


def _megatron_child(args: dict) -> dict:  # pragma: no cover - runs in a child process
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    import twinkle_megatron as tm
    mesh = tm.DeviceMesh.from_sizes(world_size=1)
    tm.initialize(mesh)
    variants = {**MEGATRON_VARIANTS, **LORA_VARIANTS, **FUSED_CE_VARIANTS}
    hf_cfg = tiny_config(args.get("family", "qwen3"), args["quick"]).to_dict()
    if args.get("vocab_size"):
        hf_cfg["vocab_size"] = args["vocab_size"]
    model = variants[args["variant"]](hf_cfg, mesh)
    if args.get("batch"):
        b, s = args["batch"]
        ids = torch.randint(0, hf_cfg["vocab_size"], (b, s), generator=torch.Generator().manual_seed(0))
    else:
        ids, _ = _batch(args["quick"], torch.device("cpu"))
    batch = {"input_ids": ids, "labels": ids}

    def step():
        out = model.forward_backward(inputs=batch)
        model.clip_grad_and_step(max_grad_norm=1.0)
        return out

    # the first steps' losses (the comparison's check), which also allocate the optimizer state
    losses = [step()["loss"] for _ in range(args.get("record_steps", 0))]
    rss0 = _reset_peak_rss()
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    t = timing.time_fn(step, dev, **args["timing"])
    peak = _peak_rss()
    return dict(times=t.times, cpu_times=t.cpu_times, optimizer_state_bytes=_optimizer_state_bytes(model),
                losses=losses, step_peak_bytes=_step_peak(rss0, peak))


def _step_peak(rss0: Optional[int], peak: Optional[int]) -> Optional[int]:
    """The step's peak resident set over the one before it (bytes; None if not measured). The
    kernel's RSS counters are batched per CPU, so a step that allocates nothing new can read a
    few hundred KiB below its start: that is 0, not a negative peak."""
    return None if rss0 is None or peak is None else max(peak - rss0, 0)


def _run_megatron_child(env: Dict[str, str], **args) -> dict:
    """One megatron step measurement in a fresh process (this module's ``__main__``, which runs
    :func:`_megatron_child` on ``args`` as JSON); returns the JSON record it prints last. A child
    that fails or prints no record raises with its last output line."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.harness.model_step", json.dumps(args)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    last = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not last:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"exit {proc.returncode}: {tail[0][:300]}")
    return json.loads(last[-1])


def _proc_status(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak_rss() -> Optional[int]:
    """Resets the process's peak resident set (Linux: ``5`` to /proc/self/clear_refs) and returns
    the current one (bytes); None where that cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _proc_status("VmRSS")


def _peak_rss() -> Optional[int]:
    return _proc_status("VmHWM")


# name -> cfg -> rows; ``--model-steps`` selects among them (default all)
MODEL_STEPS: Dict[str, Callable[..., List[dict]]] = {
    "hf": hf_steps,
    "megatron": megatron_steps,
    "megatron-lora": megatron_lora_steps,
    "megatron-fused-ce": megatron_fused_ce_steps,
}


def run(cfg) -> List[dict]:
    names = getattr(cfg, "model_steps", None) or list(MODEL_STEPS)
    return [row for name in names for row in MODEL_STEPS[name](cfg)]


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(_megatron_child(json.loads(sys.argv[1]))))
