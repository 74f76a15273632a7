"""The lane's report: one line per launch and arch, a per-kernel summary, and a markdown table."""
from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from dataclasses import asdict
from typing import Dict, List, Tuple

from .record import Launch, pointer_dtypes, tile

Compiled = List[Tuple[Launch, list]]   # [(launch, [Result per arch])]


def _dtype_of(launch: Launch) -> str:
    """The call dtype: from the table's tags (``model/dtype/op``), else the first pointer type."""
    tags = {t.split("/")[1] for t in launch.tags if t.count("/") == 2}
    if tags:
        return ",".join(sorted(tags))
    return pointer_dtypes(launch).split(",")[0]


def _shared(r) -> str:
    return f"{r.shared:,}/{r.limit:,} ({100 * r.shared / r.limit:.0f}%)"


def launch_line(launch: Launch, r) -> str:
    """``ok   sm_90 kernel [dtypes] TILE w8 s2: REG n STACK n shared used/limit (%) (compile s)``."""
    head = f"sm_{r.arch} {launch.name} [{pointer_dtypes(launch)}] {tile(launch)}"
    if r.error:
        return f"FAIL {head}: {r.error}"
    status = "OVER" if r.overflow else "ok  "
    return (f"{status} {head} w{r.num_warps} s{r.num_stages}: REG {r.regs} STACK {r.stack} "
            f"shared {_shared(r)} ({r.seconds:.1f} s CPU)")


def failures(compiled: Compiled, max_stack=None) -> List[str]:
    """What fails the lane: compile errors, shared memory over the limit, stack over ``max_stack``."""
    out = []
    for launch, results in compiled:
        for r in results:
            where = f"{launch.name} sm_{r.arch} [{pointer_dtypes(launch)}] {tile(launch)}"
            if r.error:
                out.append(f"compile error: {where}: {r.error}")
            elif r.overflow:
                out.append(f"shared memory {r.shared:,} B > {r.limit:,} B: {where}")
            elif max_stack is not None and r.stack > max_stack:
                out.append(f"stack {r.stack} B > {max_stack} B: {where}")
    return out


def summary(compiled: Compiled) -> Dict[Tuple[str, int, str], dict]:
    """Per (kernel, arch, dtype): launches, max registers, max stack, launches with stack,
    max shared memory, failures."""
    out: Dict[Tuple[str, int, str], dict] = OrderedDict()
    for launch, results in sorted(compiled, key=lambda lr: lr[0].name):
        for r in results:
            for dt in _dtype_of(launch).split(","):
                s = out.setdefault((launch.name, r.arch, dt), dict(launches=0, regs=0, stack=0, spilling=0,
                                                                   shared=0, failed=0, limit=r.limit))
                s["launches"] += 1
                if r.error:
                    s["failed"] += 1
                    continue
                s["regs"] = max(s["regs"], r.regs)
                s["stack"] = max(s["stack"], r.stack)
                s["spilling"] += r.stack > 0
                s["shared"] = max(s["shared"], r.shared)
    return OrderedDict(sorted(out.items(), key=lambda kv: _order(kv[0])))


def _order(key):
    name, arch, dt = key
    return name, {"bf16": 0, "fp16": 1, "fp32": 2}.get(dt, 3), dt, arch


def summary_lines(compiled: Compiled) -> List[str]:
    lines = [f"{'kernel':28s} {'arch':5s} {'dtype':5s} {'n':>3s} {'REG':>4s} {'STACK':>6s} {'spill':>5s} "
             f"{'shared max':>22s}"]
    for (name, arch, dt), s in summary(compiled).items():
        fail = f"  {s['failed']} FAILED" if s["failed"] else ""
        lines.append(f"{name:28s} sm_{arch:<2d} {dt:5s} {s['launches']:3d} {s['regs']:4d} {s['stack']:6d} "
                     f"{s['spilling']:5d} {s['shared']:>12,}/{s['limit']:,}{fail}")
    return lines


def markdown(compiled: Compiled) -> str:
    """Per kernel, arch and dtype: launches, max REG, max STACK (launches with stack), max shared."""
    rows = ["| kernel | arch | dtype | launches | REG max | STACK max (launches > 0) | shared max / limit |",
            "|---|---|---|---:|---:|---:|---:|"]
    for (name, arch, dt), s in summary(compiled).items():
        fail = f", {s['failed']} failed" if s["failed"] else ""
        rows.append(f"| {name} | sm_{arch} | {dt} | {s['launches']}{fail} | {s['regs']} | {s['stack']} "
                    f"({s['spilling']}) | {s['shared']:,} / {s['limit']:,} |")
    return "\n".join(rows) + "\n"


def to_json(compiled: Compiled, triton_version: str) -> dict:
    return dict(triton=triton_version,
                launches=[dict(launch.to_json(), results=[asdict(r) for r in results]) for launch, results in compiled])


def from_json(data: dict) -> Compiled:
    from .compile import Result
    out = []
    for d in data["launches"]:
        out.append((Launch.from_json(d), [Result(**r) for r in d["results"]]))
    return out


def _cell(b, a, key, fmt="{:,}"):
    bv = "-" if b is None else fmt.format(b[key])
    av = "-" if a is None else fmt.format(a[key])
    return bv if bv == av else f"{bv} -> {av}"


def compare_markdown(before: Compiled, after: Compiled) -> str:
    """Per kernel, arch and dtype, before -> after: launches, max REG, max STACK (launches with
    stack), max shared memory. ``-``: no such launch on that side."""
    sb, sa = summary(before), summary(after)
    rows = ["| kernel | arch | dtype | launches | REG max | STACK max | launches with stack | shared max (B) |",
            "|---|---|---|---:|---:|---:|---:|---:|"]
    for key in sorted(set(sb) | set(sa), key=_order):
        b, a = sb.get(key), sa.get(key)
        name, arch, dt = key
        fails = sum(s["failed"] for s in (b, a) if s)
        rows.append(f"| {name} | sm_{arch} | {dt} | {_cell(b, a, 'launches')} | {_cell(b, a, 'regs')} | "
                    f"{_cell(b, a, 'stack')} | {_cell(b, a, 'spilling')} | {_cell(b, a, 'shared')} |"
                    + (f" {fails} FAILED |" if fails else ""))
    return "\n".join(rows) + "\n"


def _pair(b, a) -> str:
    return f"{b}" if b == a else f"{b} -> {a}"


def stack_overview(before: Compiled, after: Compiled) -> str:
    """Per arch and dtype, before -> after: compiles, compiles with stack, kernels with stack."""
    def count(compiled):
        out = {}
        for (name, arch, dt), s in summary(compiled).items():
            c = out.setdefault((arch, dt), [0, 0, set()])
            c[0] += s["launches"]
            c[1] += s["spilling"]
            if s["spilling"]:
                c[2].add(name)
        return out
    cb, ca = count(before), count(after)
    rows = ["| arch | dtype | compiles | with stack | kernels with stack (after) |", "|---|---|---:|---:|---|"]
    for key in sorted(set(cb) | set(ca), key=lambda k: (k[0], {"bf16": 0, "fp16": 1, "fp32": 2}.get(k[1], 3))):
        b, a = cb.get(key, [0, 0, set()]), ca.get(key, [0, 0, set()])
        rows.append(f"| sm_{key[0]} | {key[1]} | {_pair(b[0], a[0])} | {_pair(b[1], a[1])} | "
                    f"{', '.join(sorted(a[2])) or '-'} |")
    return "\n".join(rows) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m twinkle_kernels._triton_aot.report",
                                 description="compare two --json outputs of the compile lane as markdown")
    ap.add_argument("before")
    ap.add_argument("after")
    args = ap.parse_args(argv)
    with open(args.before) as f:
        before = from_json(json.load(f))
    with open(args.after) as f:
        after = from_json(json.load(f))
    sys.stdout.write(stack_overview(before, after) + "\n" + compare_markdown(before, after))
    return 0


if __name__ == "__main__":
    sys.exit(main())
