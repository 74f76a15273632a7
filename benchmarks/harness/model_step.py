"""Model steps: a tiny Hugging Face model's training step unpatched vs patched by
``twinkle_patches``, and the Megatron training step of ``twinkle_megatron``.

HF step = forward with labels + ``loss.backward()`` (no optimizer), random weights from a
config (no hub). The patched step must give the same loss as the unpatched one (relative
difference within 10x the dtype's tolerance) or it is marked wrong. Megatron runs in a child
process (it initialises torch.distributed with gloo, world size 1) and times
``forward_backward`` + ``clip_grad_and_step``.

The two sides of each comparison are timed in interleaved rounds (unpatched, patched,
unpatched, ...; local, twinkle, local, twinkle) and each side's runs are pooled: on a shared
machine, load that comes and goes then falls on both sides alike. Timed one after the other,
the same tiny HF MoE step read 0.72x, 0.92x and 1.42x in three runs.
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
from typing import List, Optional

import torch

from . import timing

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


def hf_steps(cfg, families=("qwen3", "qwen3_moe", "qwen3_5")) -> List[dict]:
    from twinkle_kernels import testing
    dev = cfg.device
    rows: List[dict] = []
    tp = None
    tp_reason = None
    try:
        tp = import_twinkle_patches()
    except Exception as e:
        tp_reason = f"twinkle_patches failed to import ({type(e).__name__}: {e})"
    if tp is not None and not hasattr(tp, "apply"):
        tp_reason = "twinkle_patches has no apply() yet"
    elif tp is None and tp_reason is None:
        tp_reason = "twinkle_patches is not importable"
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

            def unpatched_row(t, loss):
                return dict(base, provider="unpatched", status="ok", median_ms=t.median_ms, p20_ms=t.p20_ms,
                            p80_ms=t.p80_ms, reps=t.reps, achieved=1e3 / t.median_ms, loss=loss)

            try:
                loss0 = float(step())
                if tp_reason:
                    rows.append(unpatched_row(timing.time_fn(step, dev, **step_timing_kw(cfg)), loss0))
                    rows.append(dict(base, provider="twinkle_patches", status="missing", reason=tp_reason))
                    continue
            except Exception as e:
                rows.append(dict(base, provider="unpatched", status="error", reason=str(e)[:300]))
                continue
            report = None
            try:
                report = tp.apply(model)
                loss1 = float(step())
                tp.revert(report)
                report = None
                atol, rtol = testing.tolerance(dt)
                rel = abs(loss1 - loss0) / max(abs(loss0), 1e-12)
                if rel > 10 * rtol:
                    rows.append(unpatched_row(timing.time_fn(step, dev, **step_timing_kw(cfg)), loss0))
                    rows.append(dict(base, provider="twinkle_patches", status="wrong", loss=loss1,
                                     reason=f"loss {loss1:.6g} vs unpatched {loss0:.6g} (rel {rel:.2e})"))
                    continue
                summary = []

                def patched(kw):
                    report = tp.apply(model)
                    try:
                        summary[:] = [f"swapped {len(getattr(report, 'swapped', []) or [])}, "
                                      f"skipped {len(getattr(report, 'skipped', []) or [])}"]
                        return timing.time_fn(step, dev, **kw).times
                    finally:
                        tp.revert(report)

                timings, errors = timing.interleaved(
                    {"unpatched": lambda kw: timing.time_fn(step, dev, **kw).times, "patched": patched},
                    step_timing_kw(cfg), HF_ROUNDS)
                if "unpatched" in errors:
                    raise errors["unpatched"]
                t0 = timings["unpatched"]
                rows.append(unpatched_row(t0, loss0))
                if "patched" in errors:
                    e = errors["patched"]
                    rows.append(dict(base, provider="twinkle_patches", status="error",
                                     reason=f"{type(e).__name__}: {e}"[:300]))
                    continue
                t1 = timings["patched"]
                rows.append(dict(base, provider="twinkle_patches", status="ok", median_ms=t1.median_ms,
                                 p20_ms=t1.p20_ms, p80_ms=t1.p80_ms, reps=t1.reps, achieved=1e3 / t1.median_ms,
                                 loss=loss1, vs_eager=t0.median_ms / t1.median_ms,
                                 reason=f"{summary[0]}; {HF_ROUNDS} interleaved rounds"))
            except Exception as e:
                if report is not None:
                    tp.revert(report)
                rows.append(unpatched_row(timing.time_fn(step, dev, **step_timing_kw(cfg)), loss0))
                rows.append(dict(base, provider="twinkle_patches", status="error",
                                 reason=f"{type(e).__name__}: {e}"[:300]))
    return rows


# --- Megatron (child process) -------------------------------------------------------------------
def _spec_switch(cls) -> Optional[str]:
    """The MegatronModel keyword that picks layer specs, if the facade has one."""
    params = inspect.signature(cls.__init__).parameters
    for name in params:
        if "spec" in name or name in ("kernels", "use_twinkle_kernels"):
            return name
    return None


def megatron_steps(cfg, families=("qwen3", "qwen3_moe", "qwen3_5")) -> List[dict]:
    """The megatron training step (one process) per model family, local vs twinkle layer specs."""
    return [row for family in families for row in _megatron_family_steps(cfg, family)]


def _megatron_family_steps(cfg, family: str) -> List[dict]:
    base = dict(kind="model_step", op=f"megatron-{family}", shape="batch 2x64" if cfg.quick else "batch 4x512",
                dtype="float32", mode="fwd+bwd+step", device=cfg.device.type, metric="steps/s")
    try:
        import twinkle_megatron as tm
    except Exception as e:
        return [dict(base, provider="twinkle_megatron", status="missing", reason=f"twinkle_megatron: {e}")]
    if not hasattr(tm, "MegatronModel"):
        return [dict(base, provider="twinkle_megatron", status="missing",
                     reason="twinkle_megatron has no MegatronModel yet")]
    switch = _spec_switch(tm.MegatronModel)
    variants = [("local", "local"), ("twinkle", "twinkle")] if switch else [("default specs", None)]
    rounds = MEGATRON_ROUNDS if len(variants) > 1 else 1
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def child(value):
        def one_round(kw):
            args = json.dumps(dict(quick=cfg.quick, switch=switch, value=value, timing=kw, family=family))
            proc = subprocess.run([sys.executable, "-m", "benchmarks.harness.model_step", args], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=900)
            last = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            if proc.returncode or not last:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
                raise RuntimeError(f"exit {proc.returncode}: {tail[0][:300]}")
            return json.loads(last[-1])["times"]
        return one_round

    timings, errors = timing.interleaved({label: child(value) for label, value in variants}, step_timing_kw(cfg),
                                         rounds)
    rows = []
    for label, _ in variants:
        provider = f"twinkle_megatron ({label})"
        if label in errors:
            rows.append(dict(base, provider=provider, status="error", reason=str(errors[label])[:300]))
            continue
        t = timings[label]
        rows.append(dict(base, provider=provider, status="ok", median_ms=t.median_ms, p20_ms=t.p20_ms,
                         p80_ms=t.p80_ms, reps=t.reps, achieved=1e3 / t.median_ms,
                         reason=f"{rounds} interleaved rounds" if rounds > 1 else ""))
    if not switch:
        rows.append(dict(base, provider="twinkle specs vs local specs", status="missing",
                         reason="MegatronModel has no layer-spec switch yet"))
    elif len(rows) == 2 and all(r["status"] == "ok" for r in rows):
        rows[1]["vs_eager"] = rows[0]["median_ms"] / rows[1]["median_ms"]   # twinkle vs local specs
    return rows


def _megatron_child(args: dict) -> dict:  # pragma: no cover - runs in a child process
    from twinkle_megatron.ports import free_port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import twinkle_megatron as tm
    mesh = tm.DeviceMesh.from_sizes(world_size=1)
    tm.initialize(mesh)
    cfg = tiny_config(args.get("family", "qwen3"), args["quick"]).to_dict()
    value = args["value"]
    if args["switch"] == "use_twinkle_kernels":  # a bool switch: the string "local" would be truthy
        value = value == "twinkle"
    kw = {args["switch"]: value} if args["switch"] else {}
    model = tm.MegatronModel(cfg, device_mesh=mesh, mixed_precision="fp32", **kw)
    model.set_optimizer("AdamW", lr=1e-4)
    ids, _ = _batch(args["quick"], torch.device("cpu"))
    batch = {"input_ids": ids, "labels": ids}

    def step():
        out = model.forward_backward(inputs=batch)
        model.clip_grad_and_step(max_grad_norm=1.0)
        return out

    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return dict(times=timing.time_fn(step, dev, **args["timing"]).times)


def run(cfg) -> List[dict]:
    return hf_steps(cfg) + megatron_steps(cfg)


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(_megatron_child(json.loads(sys.argv[1]))))
