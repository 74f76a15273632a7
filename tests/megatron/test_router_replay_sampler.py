"""HFSampler.generate(return_routed_experts=True): the routing of every prompt and completion token
(R3's sampler side, issue 38), checked against uncached transformers forwards of each row alone."""
from __future__ import annotations

import pytest
import torch

import twinkle_patches as tp
from tests.patches.test_patches_models import build
from twinkle_megatron.weight_sync import HFSampler

PROMPTS = [[5, 9, 14, 3, 22, 7, 1], [40, 2, 33]]


def _sampler(family="qwen3_moe"):
    hf = build(family)
    sampler = HFSampler(hf)
    sampler.refresh(iter(list(hf.state_dict().items())))
    return sampler


def _row_logps(model, row):
    with torch.no_grad():
        logits = model(torch.tensor([row])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(row[1:])[:, None])[:, 0]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_generate_returns_each_tokens_routing_and_replaying_it_gives_the_sampled_logps(family):
    sampler = _sampler(family)
    model = sampler.model
    plain = sampler.generate(PROMPTS, max_new_tokens=6, temperature=1.0, generator=torch.Generator().manual_seed(3))
    out, logps, routed = sampler.generate(PROMPTS, max_new_tokens=6, temperature=1.0,
                                          generator=torch.Generator().manual_seed(3), return_routed_experts=True)
    assert (out, logps) == plain  # recording changes nothing
    n_moe = sum(1 for m in model.modules() if type(getattr(m, "gate", None)).__name__.endswith("TopKRouter"))
    for p, c, lp, r in zip(PROMPTS, out, logps, routed):
        row = p + c
        assert r.dtype == torch.int64 and tuple(r.shape) == (len(row), n_moe, 2)
        # the routing an uncached forward of the row alone (no padding, no cache) chooses
        with torch.no_grad(), tp.record_routing(model) as rec:
            model(torch.tensor([row]))
        assert torch.equal(rec.routed_experts[0], r)
        # replaying it gives the sampler's own log-probs of the completion
        with tp.replay_routing(model, r[None]):
            got = _row_logps(model, row)[len(p) - 1:]
        assert (got - torch.tensor(lp, dtype=torch.float64)).abs().max().item() < 1e-5
        # the last token's routing (fed only for it) cannot change any log-prob of the row: only
        # rounding (the experts' grouped matmuls batch the tokens by expert), while the last
        # position's own logits move
        other = r.clone()
        other[-1] = (r[-1] + 1) % 4
        with torch.no_grad(), tp.replay_routing(model, other[None]):
            moved = model(torch.tensor([row])).logits[0]
        with torch.no_grad(), tp.replay_routing(model, r[None]):
            kept = model(torch.tensor([row])).logits[0]
        assert (moved[:-1] - kept[:-1]).abs().max().item() < 1e-6
        assert (moved[-1] - kept[-1]).abs().max().item() > 1e-3


def test_routing_of_rows_that_stop_early_and_dense_replicas():
    sampler = _sampler()
    first = sampler.generate(PROMPTS, max_new_tokens=4, temperature=0.0)[0]
    eos = first[1][1]  # row 1 stops after its second token, row 0 runs on (unless it draws eos too)
    out, _, routed = sampler.generate(PROMPTS, max_new_tokens=4, temperature=0.0, eos_token_id=eos,
                                      return_routed_experts=True)
    assert len(out[1]) == 2
    assert [r.shape[0] for r in routed] == [len(p) + len(c) for p, c in zip(PROMPTS, out)]
    dense = HFSampler(build("qwen3"))
    dense.refresh(iter(list(dense.model.state_dict().items())))
    with pytest.raises(ValueError, match="model"):
        dense.generate(PROMPTS, max_new_tokens=2, return_routed_experts=True)
    assert not any(m._forward_hooks for m in sampler.model.modules())  # the sessions were reverted
