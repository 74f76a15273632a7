"""Outputs of a run: results.json, results.csv, summary.md, PNG plots, the console table, and
the comparison of two runs.

results.json: ``{"meta": {...machine, versions, git commit...}, "rows": [...]}``.
results.csv: the same rows, one per measurement, with the machine, torch version and git commit
repeated on each row so a CSV file stands alone.
"""
from __future__ import annotations

import csv
import json
import math
import os
from typing import Dict, List

COLUMNS = ["kind", "op", "shape", "dims", "dtype", "mode", "provider", "family", "status", "rank", "median_ms",
           "p20_ms", "p80_ms", "min_ms", "reps", "metric", "achieved", "roofline_fraction", "vs_eager", "bytes", "flops",
           "peak_mem_bytes", "fwd_max_err", "grad_max_err", "loss", "device", "reason"]
META_COLUMNS = ["machine", "accelerator", "torch", "git_commit"]


def _clean(v):
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None
    return v


def write_json(result: dict, path: str) -> None:
    rows = [{k: _clean(v) for k, v in r.items()} for r in result["rows"]]
    with open(path, "w") as f:
        json.dump({"meta": result["meta"], "rows": rows}, f, indent=1, sort_keys=False)


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def write_csv(result: dict, path: str) -> None:
    meta = result["meta"]
    metavals = {"machine": meta.get("machine"), "accelerator": meta.get("accelerator"),
                "torch": meta.get("versions", {}).get("torch"), "git_commit": meta.get("git_commit")}
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS + META_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in result["rows"]:
            w.writerow({**{k: _clean(r.get(k)) for k in COLUMNS}, **metavals})


# --- formatting -------------------------------------------------------------------------------
def _f(v, fmt="{:.3g}", empty="-"):
    return empty if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def _mem(v):
    if v is None:
        return "-"
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if v >= div:
            return f"{v / div:.1f} {unit}"
    return f"{v} B"


def op_rows(result: dict) -> List[dict]:
    return [r for r in result["rows"] if r.get("kind") == "op"]


def console_table(result: dict, file=None) -> str:
    lines = []
    hdr = f"{'op':22s} {'dtype':8s} {'mode':7s} {'provider':24s} {'status':7s} {'median ms':>10s} " \
          f"{'p20-p80':>17s} {'achieved':>14s} {'%roof':>6s} {'x eager':>7s} {'peak mem':>10s}"
    lines.append(hdr)
    lines.append("-" * len(hdr))
    last_shape = None
    for r in op_rows(result):
        key = (r["op"], r["shape"])
        if key != last_shape:
            lines.append(f"[{r['op']}] {r['shape']}")
            last_shape = key
        if r["status"] == "ok":
            ach = f"{_f(r.get('achieved'))} {r.get('metric', '')}"
            roof = _f(100 * r["roofline_fraction"] if r.get("roofline_fraction") is not None else None, "{:.1f}")
            lines.append(f"{r['op']:22s} {r['dtype']:8s} {r['mode']:7s} {r['provider']:24s} {r['status']:7s} "
                         f"{_f(r.get('median_ms'), '{:.4f}'):>10s} "
                         f"{_f(r.get('p20_ms'), '{:.4f}') + '-' + _f(r.get('p80_ms'), '{:.4f}'):>17s} "
                         f"{ach:>14s} {roof:>6s} {_f(r.get('vs_eager'), '{:.2f}'):>7s} "
                         f"{_mem(r.get('peak_mem_bytes')):>10s}")
        elif r["mode"] == "fwd" or r["status"] == "error":
            lines.append(f"{r['op']:22s} {r['dtype']:8s} {r['mode'] if r['status'] == 'error' else 'all':7s} "
                         f"{r['provider']:24s} {r['status']:7s} {str(r.get('reason', ''))[:90]}")
    lines.append("")
    lines.append("rooflines / model steps:")
    for r in result["rows"]:
        if r.get("kind") in ("roofline", "model_step"):
            lines.append(f"  {r['op']:24s} {r.get('dtype', ''):8s} {r['provider']:30s} {r['status']:7s} "
                         f"{_f(r.get('median_ms'), '{:.3f}'):>9s} ms  {_f(r.get('achieved'))} {r.get('metric', '')}"
                         + (f"  x{r['vs_eager']:.2f} vs {'full training' if r['op'].endswith('-lora') else 'local specs' if 'megatron' in r['op'] else 'unpatched'}"
                            if r.get("vs_eager") else "")
                         + (f"  {r.get('reason')}" if r.get("reason") else ""))
    text = "\n".join(lines)
    print(text, file=file)
    return text


def write_markdown(result: dict, path: str, note: str = "") -> None:
    meta = result["meta"]
    v = meta.get("versions", {})
    out = ["# Benchmark summary", ""]
    note = note or meta.get("note", "")
    if note:
        out += [note, ""]
    if meta.get("argv") is not None:
        argv = list(meta["argv"])
        if "--note" in argv[:-1]:  # the note is printed above
            i = argv.index("--note")
            argv[i + 1] = '"…"'
        out += [f"Command: `python -m benchmarks {' '.join(argv)}` ({meta.get('wall_s', '?')} s)", ""]
    out += [f"- machine: `{meta.get('machine')}` — {meta.get('cpu')} ({meta.get('cpu_count')} CPUs, "
            f"{meta.get('torch_threads')} torch threads), accelerator: {meta.get('accelerator')}, "
            f"device: {meta.get('device')}",
            f"- versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
            f"- git commit: `{meta.get('git_commit')}`; started {meta.get('started')}; shape set "
            f"`{meta.get('shape_set')}`; twinkle C++ ISA: {meta.get('twinkle_cpu_isa')}",
            f"- timing: median of repeated runs with p20–p80 ({meta.get('timing')}); peak memory: "
            f"{meta.get('memory_method')}",
            "- `x eager` = eager median / this median (>1 is faster than the reference in the input dtype); "
            "`% roof` = achieved GB/s over the preallocated copy's GB/s (memory-bound ops) or achieved "
            "TFLOP/s over the same-dtype matmul's (matmul-bound ops), both measured in this run.",
            "- every provider was checked against the float64 reference (twinkle_kernels.testing tolerances) "
            "before timing; `wrong` rows were not timed and are not ranked.", "",
            "## Rooflines (same run)", "", "| what | dtype | shape | median ms | achieved |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        if r.get("kind") == "roofline":
            out.append(f"| {r['op']} | {r['dtype']} | {r['shape']} | {_f(r['median_ms'], '{:.3f}')} | "
                       f"{_f(r['achieved'])} {r['metric']} |")
    ops = []
    for r in op_rows(result):
        if r["op"] not in ops:
            ops.append(r["op"])
    for op in ops:
        rows = [r for r in op_rows(result) if r["op"] == op]
        out += ["", f"## {op}", ""]
        ok = [r for r in rows if r["status"] == "ok"]
        if ok:
            out += ["| shape | dtype | mode | provider | rank | median ms (p20–p80) | min ms | achieved | % roof | "
                    "x eager | peak mem |", "|---|---|---|---|---|---|---|---|---|---|---|"]
            for r in sorted(ok, key=lambda r: (r["shape"], r["dtype"], r["mode"], r.get("rank") or 99)):
                roof = _f(100 * r["roofline_fraction"], "{:.1f}") if r.get("roofline_fraction") is not None else "-"
                out.append(f"| {r['shape']} | {r['dtype']} | {r['mode']} | {r['provider']} | {r.get('rank', '-')} | "
                           f"{_f(r['median_ms'], '{:.4f}')} ({_f(r['p20_ms'], '{:.4f}')}–{_f(r['p80_ms'], '{:.4f}')})"
                           f" | {_f(r.get('min_ms'), '{:.4f}')} | {_f(r['achieved'])} {r['metric']} | {roof} | {_f(r.get('vs_eager'), '{:.2f}')} | "
                           f"{_mem(r.get('peak_mem_bytes'))} |")
        others = {}
        for r in rows:
            if r["status"] != "ok":
                others.setdefault((r["provider"], r["status"], str(r.get("reason", ""))), set()).add(r["dtype"])
        if others:
            out += ["", "Not timed:", ""]
            for (prov, status, reason), dts in sorted(others.items()):
                out.append(f"- **{prov}** — {status} ({', '.join(sorted(dts))}): {reason}")
    steps = [r for r in result["rows"] if r.get("kind") == "model_step"]
    if steps:
        out += ["", "## Model steps", "", "| model | dtype | shape | provider | status | median ms | speed-up vs unpatched / local spec | "
                "note |", "|---|---|---|---|---|---|---|---|"]
        for r in steps:
            out.append(f"| {r['op']} | {r['dtype']} | {r['shape']} | {r['provider']} | {r['status']} | "
                       f"{_f(r.get('median_ms'), '{:.2f}')} | {_f(r.get('vs_eager'), '{:.2f}')} | "
                       f"{str(r.get('reason', '') or '')[:160]} |")
    pngs = sorted(p for p in os.listdir(os.path.dirname(path) or ".") if p.endswith(".png"))
    if pngs:
        out += ["", "## Plots", ""] + [f"![{p}]({p})" for p in pngs]
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def write_plots(result: dict, out_dir: str) -> List[str]:
    """One PNG per op: median time (p20–p80 bars) and fraction of roofline, per provider."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    ops = []
    for r in op_rows(result):
        if r["op"] not in ops:
            ops.append(r["op"])
    for op in ops:
        ok = [r for r in op_rows(result) if r["op"] == op and r["status"] == "ok"]
        if not ok:
            continue
        cases = []
        for r in ok:
            c = (r["shape"], r["dtype"], r["mode"])
            if c not in cases:
                cases.append(c)
        provs = []
        for r in ok:
            if r["provider"] not in provs:
                provs.append(r["provider"])
        fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.2 * len(cases) + 4) * 1.6, 4.8))
        width = 0.8 / max(len(provs), 1)
        for k, prov in enumerate(provs):
            xs, ts, lo, hi, fr = [], [], [], [], []
            for i, c in enumerate(cases):
                r = next((r for r in ok if (r["shape"], r["dtype"], r["mode"]) == c and r["provider"] == prov), None)
                if r is None:
                    continue
                xs.append(i + k * width)
                ts.append(r["median_ms"])
                lo.append(r["median_ms"] - r["p20_ms"])
                hi.append(r["p80_ms"] - r["median_ms"])
                fr.append(r.get("roofline_fraction") or 0.0)
            axes[0].bar(xs, ts, width, yerr=[lo, hi], label=prov, capsize=2)
            axes[1].bar(xs, fr, width, label=prov)
        labels = [f"{m}\n{d}\n{s[:28]}" for s, d, m in cases]
        for ax, title in ((axes[0], "median time, ms (p20–p80)"),
                          (axes[1], "fraction of roofline (copy GB/s or matmul TFLOP/s)")):
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
            ax.set_xticklabels(labels, fontsize=6)
            ax.set_title(title, fontsize=9)
        axes[0].set_yscale("log")
        axes[1].legend(fontsize=7)
        fig.suptitle(f"{op} — {result['meta'].get('device')} ({result['meta'].get('cpu') if result['meta'].get('accelerator') == 'none' else result['meta'].get('accelerator')})", fontsize=10)
        fig.tight_layout()
        p = os.path.join(out_dir, f"{op}.png")
        fig.savefig(p, dpi=90)
        plt.close(fig)
        paths.append(p)
    return paths


def write_all(result: dict, out_dir: str, note: str = "") -> Dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "results.json"), "csv": os.path.join(out_dir, "results.csv"),
             "md": os.path.join(out_dir, "summary.md")}
    write_json(result, paths["json"])
    write_csv(result, paths["csv"])
    pngs = write_plots(result, out_dir)
    write_markdown(result, paths["md"], note)
    paths["png"] = pngs
    return paths


# --- comparison ------------------------------------------------------------------------------
def _key(r: dict):
    return (r.get("kind"), r.get("op"), r.get("shape"), r.get("dtype"), r.get("mode"), r.get("provider"))


def compare(a: dict, b: dict, file=None) -> List[dict]:
    """Rows present and ok in both runs, with ``ratio`` = A median / B median (>1: B is faster)."""
    ra = {_key(r): r for r in a["rows"] if r.get("status") == "ok" and r.get("median_ms")}
    out = []
    for r in b["rows"]:
        k = _key(r)
        if r.get("status") == "ok" and r.get("median_ms") and k in ra:
            out.append(dict(kind=k[0], op=k[1], shape=k[2], dtype=k[3], mode=k[4], provider=k[5],
                            a_ms=ra[k]["median_ms"], b_ms=r["median_ms"], ratio=ra[k]["median_ms"] / r["median_ms"]))
    ma, mb = a["meta"], b["meta"]
    print(f"A: {ma.get('git_commit')} on {ma.get('machine')} ({ma.get('started')})", file=file)
    print(f"B: {mb.get('git_commit')} on {mb.get('machine')} ({mb.get('started')})", file=file)
    print(f"{'kind':10s} {'op':22s} {'dtype':8s} {'mode':12s} {'provider':26s} {'A ms':>10s} {'B ms':>10s} "
          f"{'A/B':>7s}", file=file)
    for c in out:
        print(f"{c['kind']:10s} {c['op']:22s} {c['dtype']:8s} {c['mode']:12s} {c['provider']:26s} "
              f"{c['a_ms']:10.4f} {c['b_ms']:10.4f} {c['ratio']:7.2f}", file=file)
    only = len(a["rows"]) + len(b["rows"]) - 2 * len(out)
    print(f"{len(out)} measurements in both runs (A/B > 1: B is faster); {only} rows in only one run or "
          f"not ok in one", file=file)
    return out
