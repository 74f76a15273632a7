"""Where and with what a run happened: machine, versions, git commit (stored with every row); the
environment of the benchmarks' child processes."""
from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
from typing import Dict, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PACKAGES = ("torch", "triton", "transformers", "megatron-core", "liger-kernel", "flash-linear-attention",
             "transformer-engine", "torch-npu", "numpy", "matplotlib")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def child_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment of a child benchmark process (or rank): this checkout first on
    ``PYTHONPATH``, so ``benchmarks`` and the project's packages import from a checkout that is not
    installed; ``extra`` on top."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra or {})
    return env


def _git(*args: str) -> Optional[str]:
    root = ROOT
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except Exception:
        return None


def versions() -> Dict[str, str]:
    out = {"python": platform.python_version()}
    for p in _PACKAGES:
        try:
            out[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        import twinkle_kernels
        out["twinkle_kernels"] = twinkle_kernels.__version__
    except Exception:
        pass
    return out


def describe(device: torch.device) -> dict:
    if device.type == "cuda":
        accel = torch.cuda.get_device_name(device)
    elif device.type == "npu":  # pragma: no cover
        accel = "npu"
    else:
        accel = "none"
    try:
        from twinkle_kernels import registry
        isa = registry.cpu_isa()
    except Exception as e:
        isa = f"unknown ({type(e).__name__})"
    commit = _git("rev-parse", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "machine": platform.node(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "accelerator": accel,
        "device": str(device),
        "twinkle_cpu_isa": isa,
        "versions": versions(),
        "git_commit": (commit or "unknown") + ("-dirty" if dirty else ""),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
