"""The Ascend cookbook scripts (examples/npu/) are not dead code: each runs here with
``--device cpu`` on 2 gloo processes and must end with its own assertion (loss finite and
decreasing over 10 steps) passing. This runs the scripts' logic on CPU only; nothing ran on an NPU.
"""
import os
import re
import subprocess
import sys

import pytest

from conftest import free_port, run_in_own_group

pytest.importorskip("megatron.core")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# 2-process layouts of each script's parallelism (the .sh launchers use 8 NPUs)
CASES = {
    "tp_npu.py": ["--tp-size", "2", "--pp-size", "1"],
    "tp_npu.py-pp": ["--tp-size", "1", "--pp-size", "2"],
    "tp_moe_npu.py": ["--tp-size", "2", "--ep-size", "2"],
    "tp_moe_cp_npu.py": ["--tp-size", "1", "--cp-size", "2", "--ep-size", "2"],
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", sorted(CASES))
def test_cookbook_script_trains_on_cpu_gloo(case):
    script = os.path.join(ROOT, "examples", "npu", case.split("-")[0])
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
            str(free_port()), script, "--device", "cpu"] + CASES[case]
    env = dict(os.environ, PYTHONPATH=ROOT, TORCHDYNAMO_DISABLE="1", CUDA_VISIBLE_DEVICES="")
    rc, out = run_in_own_group(argv, cwd=ROOT, env=env, timeout=240, what=f"cookbook script {case}")
    assert rc == 0, out[-3000:]
    losses = [float(x) for x in re.findall(r"'loss': ([0-9.]+)", out)]
    assert len(losses) == 10 and losses[-1] < losses[0], losses
    assert "OK: loss finite and decreasing" in out


def test_cookbook_script_on_npu_here_exits_with_the_reason():
    script = os.path.join(ROOT, "examples", "npu", "tp_npu.py")
    out = subprocess.run([sys.executable, script, "--device", "npu"], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert out.returncode != 0 and "--device npu: torch_npu is not installed" in out.stderr


def test_launchers_pass_the_layout_and_extra_args():
    for name in ("tp_npu", "tp_moe_npu", "tp_moe_cp_npu"):
        sh = open(os.path.join(ROOT, "examples", "npu", name + ".sh")).read()
        assert f"examples/npu/{name}.py" in sh and '"$@"' in sh and "torchrun --nproc_per_node" in sh
        assert subprocess.run(["bash", "-n", os.path.join(ROOT, "examples", "npu", name + ".sh")]).returncode == 0


def test_the_pass_criterion_rejects_flat_and_non_finite_losses():
    sys.path.insert(0, os.path.join(ROOT, "examples", "npu"))
    try:
        import _common
    finally:
        sys.path.pop(0)
    _common.check_losses([3.0, 2.5, 2.9, 2.0])
    for bad in ([3.0, 3.0], [3.0, float("nan"), 2.0], [3.0, float("inf")], [2.0, 3.0], []):
        with pytest.raises(AssertionError):
            _common.check_losses(bad)
