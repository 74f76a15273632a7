"""Weight-sync throughput on CPU: a live MegatronModel's weights into a transformers replica,
in-process and over gloo to a sampler process, against the machine's copy bandwidth measured in
the same processes.

    python -m benchmarks.scripts.weight_sync_cpu --out benchmarks/results/weight_sync_cpu_<date>.md

Two processes (the project's launcher, one thread each): rank 0 is a one-rank megatron trainer (a world of its
own), rank 1 a sampler holding a transformers model; a sync group joins them
(``weight_sync.connect``). Per model (the tiny test model; Qwen3-0.6B's widths with 4 layers,
fp32) the rows are, each the best of ``--reps`` rounds (the wide model: reps // 3, at least 3)
that run every row once in turn, so a burst of load on a shared machine hits them alike (wall
clock; GB/s = the model's bytes over the time; ratios against ``copy_`` into an existing buffer
of the same total size, best of 5 (100 below 64 MB), in the same process):

- ``export``: iterating ``get_hf_state_dict()`` alone;
- ``in-process``: ``load_hf_weights(replica, get_hf_state_dict())`` in the trainer process;
- ``gloo send``: ``WeightSender.send(get_hf_state_dict())`` until the receiver acknowledged the
  whole version (export, packing, transfer, the receiver's staging);
- ``gloo send, stream ready``: the same with the tensors listed beforehand (packing and transfer);
- ``raw gloo p2p``: the group's own send of the same bytes between buffers allocated beforehand;
- ``sampler apply``: on the sampler, ``WeightVersion.apply(replica)`` of a received version.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

from benchmarks.harness.env import ROOT, child_env, cpu_model, versions

TINY = {"model_type": "qwen3", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 128, "tie_word_embeddings": False}
# Qwen3-0.6B's widths (hidden 1024, MLP 3072, 16 query / 8 KV heads of 128, vocab 151936, tied
# embeddings), 4 layers instead of 28
WIDE = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
        "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 4096, "tie_word_embeddings": True}
MODELS = {"tiny (4 layers, h64)": TINY, "Qwen3-0.6B widths, 4 layers": WIDE}


def _copy_gbps(nbytes: int) -> float:
    """Best of 5 (100 below 64 MB) ``copy_`` into an existing buffer of ``nbytes`` (read + write counted once, as
    the sync rows count the model's bytes once)."""
    import torch
    src = torch.ones(max(nbytes // 4, 1))
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5 if nbytes > 64 << 20 else 100):   # small copies: more tries against preemption
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return src.numel() * 4 / best / 1e9


def _hf(config):
    import torch
    import transformers
    cfg = transformers.Qwen3Config(**{k: v for k, v in config.items() if k != "model_type"})
    return transformers.Qwen3ForCausalLM(cfg).to(torch.float32).eval()


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _raw_gloo(group, peer, nbytes, sending, bufs={}):
    """The group's own point-to-point time for one ``nbytes`` message between buffers allocated
    (and touched) beforehand, then an 8-byte reply (seconds, sender side)."""
    import torch
    if bufs.get("n") != nbytes:
        bufs.update(n=nbytes, buf=torch.ones(nbytes, dtype=torch.uint8), word=torch.zeros(1, dtype=torch.int64))
    buf, word = bufs["buf"], bufs["word"]
    start = time.perf_counter()
    if sending:
        group.send([buf], peer, 7).wait()
        group.recv([word], peer, 7).wait()
    else:
        group.recv([buf], peer, 7).wait()
        group.send([word], peer, 7).wait()
    return time.perf_counter() - start


def _rounds(config, reps):
    return reps if config is TINY else max(3, reps // 3)


def trainer(store, reps, bucket_bytes):
    import torch.distributed as dist
    import twinkle_megatron as tm
    from twinkle_megatron import weight_sync as ws
    dist.init_process_group("gloo", store=dist.PrefixStore("trainer", store), rank=0, world_size=1)
    sender = ws.WeightSender(ws.connect(0, 2, store=store, prefix="sync"), dst=1, bucket_bytes=bucket_bytes,
                             timeout=600)
    rows = []
    for label, config in MODELS.items():
        model = tm.MegatronModel(config, device_mesh=tm.DeviceMesh.from_sizes(world_size=1), mixed_precision="fp32")
        nbytes = sum(t.numel() * t.element_size() for _, t in model.get_hf_state_dict())
        replica = _hf(config)
        ready = list(model.get_hf_state_dict())   # views of the parameters: no copy

        def export():
            for _ in model.get_hf_state_dict():
                pass

        buckets = []

        def send(stream):   # once the sampler has applied the last version and waits for this one
            store.wait([f"ready{sender.version}"])
            stats = sender.send(stream)
            buckets[:] = [stats.buckets]
            return stats.seconds
        send(model.get_hf_state_dict())   # warms the sampler's allocations up
        times = {k: [] for k in ("export", "in_process", "gloo_send", "gloo_ready", "gloo_raw")}
        for _ in range(_rounds(config, reps)):   # interleaved: a burst of load hits every row alike
            times["export"].append(_timed(export))
            times["in_process"].append(_timed(lambda: ws.load_hf_weights(replica, model.get_hf_state_dict())))
            times["gloo_send"].append(send(model.get_hf_state_dict()))
            times["gloo_ready"].append(send(ready))
            times["gloo_raw"].append(_raw_gloo(sender._ch.group, 1, nbytes, sending=True))
        row = {"model": label, "bytes": nbytes, "copy_gbps": _copy_gbps(nbytes), "tensors": len(ready),
               "buckets": buckets[0]}
        row.update({k + "_s": min(v) for k, v in times.items()})
        rows.append(row)
        del model, replica, ready
    sender.close()
    return rows


def sampler(store, reps):
    from twinkle_megatron import weight_sync as ws
    receiver = ws.WeightReceiver(ws.connect(1, 2, store=store, prefix="sync"), src=0, timeout=1800)
    rows = []
    for label, config in MODELS.items():
        replica = _hf(config)

        def take():
            store.set(f"ready{receiver.version}", "1")
            v = receiver.receive()
            return v, _timed(lambda: v.apply(replica))
        v, _ = take()
        times = []
        for _ in range(_rounds(config, reps)):
            for _ in range(2):   # the live and the ready stream's versions
                v, apply_s = take()
                times.append(apply_s)
            _raw_gloo(receiver._ch.group, 0, v.nbytes, sending=False)
        rows.append({"model": label, "apply_s": min(times), "copy_gbps": _copy_gbps(v.nbytes), "bytes": v.nbytes})
        del replica, v
    assert receiver.receive() is None
    return rows


def worker(reps, bucket_bytes):
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 2, rank == 0,
                          timeout=datetime.timedelta(seconds=600))
    rows = trainer(store, reps, bucket_bytes) if rank == 0 else sampler(store, reps)
    print("ROWS " + json.dumps(rows), flush=True)


def _table(trainer_rows, sampler_rows):
    lines = ["| model | MB | tensors | buckets | copy_ GB/s | export GB/s | in-process load GB/s (x copy) | "
             "gloo send GB/s (x copy) | gloo send, stream ready GB/s (x copy) | raw gloo p2p GB/s (x copy) | "
             "sampler apply GB/s (x copy) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for t, s in zip(trainer_rows, sampler_rows):
        gb = t["bytes"] / 1e9

        def rate(sec, copy):
            return f"{gb / sec:.2f} ({gb / sec / copy:.2f}x)"
        lines.append(f"| {t['model']} | {t['bytes'] / 2**20:.1f} | {t['tensors']} | {t['buckets']} | "
                     f"{t['copy_gbps']:.1f} | {gb / t['export_s']:.2f} | {rate(t['in_process_s'], t['copy_gbps'])} | "
                     f"{rate(t['gloo_send_s'], t['copy_gbps'])} | {rate(t['gloo_ready_s'], t['copy_gbps'])} | "
                     f"{rate(t['gloo_raw_s'], t['copy_gbps'])} | "
                     f"{rate(s['apply_s'], s['copy_gbps'])} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="markdown file to write (default: print only)")
    p.add_argument("--reps", type=int, default=10, help="rounds for the tiny model (the wide one: reps // 3, >= 3)")
    p.add_argument("--bucket-mb", type=int, default=512, help="WeightSender bucket size (default 512)")
    p.add_argument("--note", default="", help="a line for the report (e.g. the machine's load)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.reps, args.bucket_mb << 20)
        return 0
    from twinkle_megatron.parallel.launch import run_ranks
    load = os.getloadavg()
    start = time.time()
    ranks = run_ranks(["-m", "benchmarks.scripts.weight_sync_cpu", "--worker", "--reps", str(args.reps),
                       "--bucket-mb", str(args.bucket_mb)], 2, timeout=3000, cwd=ROOT,
                      env=child_env({"TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}))
    rows = []
    for r in ranks:
        found = [line for line in r.output.splitlines() if line.startswith("ROWS ")]
        if r.returncode or not found:
            sys.exit(f"benchmark failed:\n--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-4000:]}")
        rows.append(json.loads(found[-1][5:]))
    table = _table(*rows)
    v = versions()
    text = "\n".join([
        "# Weight sync throughput, CPU (gloo)", "",
        f"`python -m benchmarks.scripts.weight_sync_cpu {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
        f"{datetime.date.today()}, {cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {v.get('torch')}, megatron-core {v.get('megatron-core')}, transformers {v.get('transformers')}; "
        f"bucket {args.bucket_mb} MB; one thread per process; {time.time() - start:.0f} s. Load average at the start "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) on {os.cpu_count()} cores: the "
        "machine was shared with other jobs, so absolute figures are low and noisy; the ratios to the copy "
        "bandwidth measured in the same process are the comparable figures.",
        *(["", args.note] if args.note else []), "",
        table, "",
        "GB/s: the model's fp32 bytes (HF tensors) over the best wall time of one sync, of rounds that "
        "run every row in turn. `copy_`: best of 5 "
        "`dst.copy_(src)` of the same total size into an existing buffer, in the same process. `export`: "
        "iterating `get_hf_state_dict()` (one rank: the tensors are the parameters' views, so this is the "
        "walk and the HF splits). `in-process load`: `load_hf_weights(replica, get_hf_state_dict())`. "
        "`gloo send`: `WeightSender.send(get_hf_state_dict())` until the sampler acknowledged the whole "
        "version (export, bucket packing, the transfer over loopback TCP, the sampler's staging); "
        "`stream ready`: the same with the HF tensors listed beforehand (no export: packing and transfer). "
        "`raw gloo p2p`: the sync group's own send of one message of the same size between buffers "
        "allocated beforehand, plus an 8-byte reply (the bound the transport works against). "
        "`sampler apply`: `WeightVersion.apply(replica)` on the sampler (checks, then one copy per tensor).",
        ""])
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
