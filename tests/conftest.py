"""Shared test set-up.

- Without a CUDA device, Triton kernels run in the interpreter (``TRITON_INTERPRET=1``);
  this must be set before any Triton kernel is defined, so it happens here, first.
- Every fast-path output is NaN-poisoned (see ``twinkle_kernels.testing.poison_outputs``).
- From a plain checkout (no install), the folder ``patches/`` is importable as
  ``twinkle_patches``, the import name the build config gives it.
- Large CPU tensors live on transparent huge pages (``THP_MEM_ALLOC_ENABLE``, set before torch
  is imported).
- Once the test modules are imported, their objects are frozen out of the cyclic garbage
  collector's reach (``gc.freeze``; see ``pytest_collection_finish``).
"""
import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
from typing import Tuple

import pytest

# torch's CPU allocator backs allocations of 2 MB and more with transparent huge pages (the kernel's
# THP mode is madvise on the CI machines): the multi-GB models of the published-widths test spent
# more system time in page faults than user time in compute (173 of 281 CPU s; with huge pages
# 135 s, 19 s less wall time). torch reads this once, at its first allocation, so it is set before
# torch is imported; the worker processes inherit it.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if importlib.util.find_spec("twinkle_patches") is None and os.path.isdir(os.path.join(ROOT, "patches")):
    spec = importlib.util.spec_from_file_location(
        "twinkle_patches", os.path.join(ROOT, "patches", "__init__.py"),
        submodule_search_locations=[os.path.join(ROOT, "patches")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["twinkle_patches"] = module
    spec.loader.exec_module(module)

from twinkle_kernels import testing  # noqa: E402
from twinkle_megatron.parallel.launch import free_port  # noqa: E402,F401  (the tests' one free-port helper)
# opt-in: --triton-launches=FILE records the session's Triton launches for the compile lane
from twinkle_kernels._triton_aot import pytest_plugin as _triton_launches  # noqa: E402
from twinkle_kernels._triton_aot.pytest_plugin import (  # noqa: E402,F401
    pytest_configure, pytest_runtest_call, pytest_unconfigure)


def pytest_addoption(parser):
    _triton_launches.pytest_addoption(parser)
    # the CI lanes that re-run kernel tests under other conditions (.ci/sanitize: only the C++
    # backend is instrumented; .ci/min_versions: only Triton and transformers differ) run only the
    # backends whose result those conditions can change
    # .ci/mcore_latest: the published-widths launch (two ranks building models at published
    # widths) for the entries whose code paths differ between megatron-core releases
    parser.addoption("--published-entries", default=None, metavar="LIST",
                     help="comma list of tests/published_configs.py entries: test_published_widths "
                          "builds and checks only these (default: every entry)")
    parser.addoption("--backends", default=None, metavar="LIST",
                     help="comma list (reference,cpu,triton,...): of the tests parametrized by `backend`, "
                          "run only these backends' cases; tests without that parameter, or with "
                          "backend=None (the automatic choice), all run")


def published_entries(config):
    """The entries of tests/published_configs.py that ``--published-entries`` selects (all: None)."""
    chosen = config.getoption("--published-entries")
    if chosen is None:
        return None
    chosen = [e.strip() for e in chosen.split(",") if e.strip()]
    from tests import published_configs
    unknown = sorted(set(chosen) - set(published_configs.PUBLISHED))
    if not chosen or unknown:
        raise pytest.UsageError(f"--published-entries: unknown or no entries {unknown}; "
                                f"known: {sorted(published_configs.PUBLISHED)}")
    return chosen


def _deselect_published(config, items):
    chosen = published_entries(config)
    if chosen is None:
        return
    selected, deselected = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        module = getattr(getattr(item, "module", None), "__name__", "")
        other = module.endswith("test_published_widths") and params.get("name", chosen[0]) not in chosen
        (deselected if other else selected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


def pytest_collection_modifyitems(config, items):
    _deselect_published(config, items)
    keep = config.getoption("--backends")
    if not keep:
        return
    keep = {b.strip() for b in keep.split(",") if b.strip()}
    if not keep:
        raise pytest.UsageError("--backends: give at least one backend name")
    selected, deselected = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        backend = params.get("backend")
        # None is the automatic choice: it runs whatever the machine's dispatch picks, so it stays
        (deselected if isinstance(backend, str) and backend not in keep else selected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


# Hypothesis example budgets (tests/kernels/test_fuzz.py and every @given without its own max_examples):
# "ci" is the default, fixed and derandomized so CI time is bounded and runs repeat;
# `pytest --hypothesis-profile=long` draws 20x as many fresh examples.
from hypothesis import settings as _hyp_settings  # noqa: E402

_hyp_settings.register_profile("ci", max_examples=25, derandomize=True, deadline=None, print_blob=True)
_hyp_settings.register_profile("long", max_examples=500, derandomize=False, deadline=None, print_blob=True)
_hyp_settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _poison_outputs():
    with testing.poison_outputs(True):
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def run_in_own_group(argv, *, env, timeout: float, what: str, cwd: str = ROOT) -> Tuple[int, str]:
    """Runs ``argv`` in a new process session, stdout and stderr together. On timeout the whole
    group (torchrun's workers too) is killed and the test fails with the output's tail, so a
    hung child never hangs CI. Returns (exit code, output)."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{what} timed out after {timeout} s:\n" + out[-3000:])
    return proc.returncode, out


@contextlib.contextmanager
def exclusive_memory():
    """Holds the file lock ``TWINKLE_TEST_MEMORY_LOCK`` names, if any, for the block. CI runs a second
    pytest session beside the README's (.ci/lanes); the tests that need most of the 24 GB machine
    (test_published_widths: two ranks of up to 6 GB and transformers' references) take turns
    through it. Without the variable the block just runs."""
    path = os.environ.get("TWINKLE_TEST_MEMORY_LOCK")
    if not path:
        yield
        return
    import fcntl
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)   # released when f closes, or when this process dies
        yield


def cpu_backend_available() -> bool:
    from twinkle_kernels import _cpu_ext
    return _cpu_ext.unavailable_reason() is None


def triton_available() -> bool:
    from twinkle_kernels import _dispatch
    return _dispatch.backend_status("triton") is None


def available_backends():
    """Backends that can run on this machine's default test device."""
    out = ["reference"]
    if cpu_backend_available():
        out.append("cpu")
    if triton_available():
        out.append("triton")
    return out


@contextlib.contextmanager
def megatron_one_rank():
    """``twinkle_megatron`` initialised as a one-rank gloo job on a free port (yields the package);
    shut down, and the rendezvous environment restored, on exit. For module-scoped fixtures."""
    import twinkle_megatron as tm
    keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    tm.initialize(tm.DeviceMesh.from_sizes(world_size=1))
    try:
        yield tm
    finally:
        tm.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def tm():
    """``twinkle_megatron`` as a one-rank gloo job (:func:`megatron_one_rank`), once per test
    module: the megatron test files that train in their own process request it by this name."""
    with megatron_one_rank() as tm:
        yield tm


TINY_MOE_VOCAB = 256


@pytest.fixture(scope="session")
def tiny_moe_checkpoint(tmp_path_factory):
    """A random-weight Qwen3-MoE checkpoint folder (2 layers, 4 experts of 32, top 2, hidden 64,
    vocabulary ``TINY_MOE_VOCAB``, untied head), written by transformers once per session."""
    import transformers
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("tiny_moe")
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=TINY_MOE_VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        norm_topk_prob=True, tie_word_embeddings=False)).save_pretrained(str(root))
    return str(root)


def pytest_collection_finish(session):
    """Every test module is imported (torch, transformers, megatron-core with them): their objects
    live as long as the session, so they are moved out of the cyclic garbage collector's reach
    (``gc.freeze``), and its full collections during the tests stop walking them."""
    import gc
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session, exitstatus):
    """Back in the collector's reach for the interpreter's shutdown (nanobind, Triton's bindings,
    reports the objects still alive at exit as leaks)."""
    import gc
    gc.unfreeze()
