"""The README's two commands stay true (its examples run in tests/repo/test_docs.py)."""
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

README = open(os.path.join(ROOT, "README.md")).read()


def _commands():
    return [line.strip() for line in README.splitlines() if re.match(r"^    python3 -m venv \.venv ", line)]


def test_readme_gives_exactly_two_setup_to_result_commands():
    cmds = _commands()
    assert len(cmds) == 2, cmds
    main, tests = cmds
    assert main.endswith(".venv/bin/python -m twinkle_kernels") or "twinkle_megatron.job" in main
    assert "pytest" in tests


def test_ci_runs_the_readme_test_command():
    script = open(os.path.join(ROOT, ".ci", "run")).read()
    sed = re.search(r"sed -n '([^']+)' README.md", script).group(1)
    out = subprocess.run(["sed", "-n", sed, "README.md"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[0].strip() == _commands()[1]


# The README's python blocks (and the docs pages') run in tests/repo/test_docs.py.


@pytest.mark.slow
def test_main_job_self_check_passes():
    """The last step of the README's main command (set-up is what .ci/run already did)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)  # the main job sets it itself for its Triton child process
    out = subprocess.run([sys.executable, "-m", "twinkle_kernels", "--reps", "1"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert re.search(r"(\d+)/\1 checks passed", out.stdout)
    for b in ("reference", "cpu", "triton"):
        assert re.search(rf"^  {b}\s", out.stdout, re.M)
