"""vocab_parallel_fused_linear_cross_entropy on 2 gloo processes equals the single-process op on the
full weight (outputs and the gradients of hidden, weight shard and bias shard), also under sequence
parallelism."""
import os

import pytest

from tests.megatron_workers.protocol import ROOT, launch

WORKER = os.path.join(ROOT, "tests", "megatron_workers", "linear_ce_worker.py")

CASES = {
    "mean": {},
    "none_all": dict(reduction="none", label_smoothing=0.2, return_logps=True, return_entropy=True),
    "sum_capped": dict(reduction="sum", logit_softcap=3.0, temperature=0.8, return_logps=True),
}


def test_vocab_parallel_matches_single_process(tmp_path):
    results, rcs, logs, _ = launch(2, {"cases": CASES}, str(tmp_path), timeout=180, script=WORKER)
    assert rcs == [0, 0], "\n".join(t[-2000:] for t in logs)
    for rank, res in enumerate(results):
        assert set(res) == {c + s for c in CASES for s in ("", "_sp")}
        for case, errs in res.items():
            for k, e in errs.items():
                assert e < 2e-5, f"rank {rank} {case} {k}: {e}"


def test_vocab_parallel_needs_negative_ignore_index():
    import torch
    from twinkle_kernels.linear_ce.vocab_parallel import vocab_parallel_fused_linear_cross_entropy
    with pytest.raises(ValueError, match="ignore_index"):
        vocab_parallel_fused_linear_cross_entropy(torch.randn(2, 4), torch.randn(3, 4), torch.zeros(2, dtype=torch.long),
                                                  ignore_index=0)
