"""The main loop every gloo test worker shares: one process group, the runs of a spec, a result file.

A worker script defines ``run_one(run, spec[, data][, rank]) -> dict`` and ends with
``serve(run_one, ...)``. Each run's record (or, if it raised, ``{"ok": False, "error", "traceback"}``)
goes to ``$TWINKLE_TEST_OUT/result<rank>.json``, rewritten after every run so a run that kills
its process still leaves the earlier results for the test to read.
"""
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist


def serve(run_one, *, data: bool = False, rank: bool = False) -> None:
    """Run every entry of ``spec["runs"]`` (spec: the JSON file named by ``sys.argv[1]``).
    ``data``: also pass ``torch.load(spec["data"])`` (the batch the test wrote); ``rank``: also
    pass this process's rank. A run with ``"expect_error"`` does not print its traceback."""
    spec = json.load(open(sys.argv[1]))
    extra = (torch.load(spec["data"]),) if data else ()
    dist.init_process_group("gloo")
    me = dist.get_rank()
    extra += (me,) if rank else ()
    results = {}
    for run in spec["runs"]:
        try:
            results[run["name"]] = run_one(run, spec, *extra)
        except Exception as e:  # recorded per run; the test asserts on it
            results[run["name"]] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                    "traceback": traceback.format_exc()}
            if not run.get("expect_error"):
                traceback.print_exc()
        with open(os.path.join(os.environ["TWINKLE_TEST_OUT"], f"result{me}.json"), "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
