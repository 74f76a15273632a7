"""Opt-in pytest hooks: record every Triton launch a test session makes, for the compile lane.

``pytest --triton-launches=FILE`` (or ``TWINKLE_TRITON_LAUNCHES=FILE``, read when the session
starts) records the session's distinct launches of ``twinkle_kernels``' kernels, each tagged with the first tests that made it,
and writes them as JSON lines when the session ends; ``python -m twinkle_kernels._triton_aot
--launches FILE`` compiles them. Kernels still run: recording only observes. Off by default.
"""
from __future__ import annotations

import os

import pytest

_STATE = {}


def pytest_addoption(parser):
    parser.addoption("--triton-launches", default=None, metavar="JSONL",
                     help="record the session's Triton launches to JSONL for python -m twinkle_kernels._triton_aot "
                          "(also: TWINKLE_TRITON_LAUNCHES)")


def pytest_configure(config):
    path = config.getoption("--triton-launches", default=None) or os.environ.get("TWINKLE_TRITON_LAUNCHES")
    if not path:
        return
    from .record import recording
    # the ops' kernels only: a kernel defined in a test module is not importable by the lane
    ctx = recording(execute=True, packages=("twinkle_kernels",))
    _STATE.update(ctx=ctx, rec=ctx.__enter__(), path=os.path.abspath(path))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    rec = _STATE.get("rec")
    if rec is None:
        yield
        return
    with rec.tagged(item.nodeid):
        yield


def pytest_unconfigure(config):
    if "ctx" not in _STATE:
        return
    from .record import write_jsonl
    rec, path = _STATE["rec"], _STATE["path"]
    _STATE.pop("ctx").__exit__(None, None, None)
    n = write_jsonl(path, rec.launches)
    _STATE.clear()
    print(f"\nrecorded {n} distinct Triton launches to {path}")
