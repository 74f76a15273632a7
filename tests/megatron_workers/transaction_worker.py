"""One rank of tests/megatron/test_facade_inputs.py::test_two_ranks_agree_and_roll_back: 2 gloo ranks of
one data-parallel replica (spec['mesh']: CP2 or TP2), tiny Qwen3 (and a tiny Qwen3-MoE for
``routed_experts``), fp32.

Records per rank, in $TWINKLE_TEST_OUT/result<rank>.json:
- for each of advantages / old_logps / teacher_topk_logps / routed_experts given differently on
  rank 1: the error raised ({type, error});
- 'nan_on_rank1': advantages NaN at a loss position on rank 1 only: the error each rank raised;
- 'same_arguments': 'ok' when the same arguments on both ranks train;
- a call whose user metric raises on micro-batch 2 (on both ranks; with spec['fail_rank'], on that
  rank only, and spec['rollback_only'] skips the argument checks: a DP2 mesh): the error, whether the state
  (grad buffers, counters, meters, params) is identical to the snapshot taken before it, and the
  largest difference of the next step's loss and weights from a twin model's that never saw it.
"""
import copy
import json
import os
import sys
import traceback

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import twinkle_megatron as tm  # noqa: E402

OUT = os.environ.get("TWINKLE_TEST_OUT", ".")
VOCAB, B, S, K = 64, 4, 8, 3
DENSE = {"model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
         "max_position_embeddings": 64, "tie_word_embeddings": False, "rms_norm_eps": 1e-6}
MOE = dict(model_type="qwen3_moe", hidden_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
           max_position_embeddings=64, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
           num_experts_per_tok=2, num_hidden_layers=2, head_dim=8, norm_topk_prob=True, tie_word_embeddings=False,
           rms_norm_eps=1e-6, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = ids.clone()
    labels[:, :2] = -100
    return {"input_ids": ids, "labels": labels}


def attempt(rec, name, fn):
    try:
        fn()
        rec[name] = "ok"
    except Exception as e:  # recorded; the test asserts on it
        rec[name] = {"type": type(e).__name__, "error": str(e)}


def state_of(model):
    s = model.train_state()
    return {"grads": [b.grad_data.clone() for m in s.model for b in m.buffers],
            "params": [p.detach().clone() for c in model.unwrapped_chunks() for p in c.parameters()],
            "counters": [s.cur_step, s.consumed_train_samples, s.accumulated_calls, s.has_grads, s.grads_ready,
                         None if s.pending_tokens is None else int(s.pending_tokens)],
            "meter": copy.deepcopy(vars(s.metric))}


def identical(a, b):
    same = all(torch.equal(x, y) for x, y in zip(a["grads"] + a["params"], b["grads"] + b["params"]))
    return same and a["counters"] == b["counters"] and a["meter"] == b["meter"]


def run(spec, rank):
    mesh = tm.DeviceMesh.from_sizes(world_size=2, **spec["mesh"])
    tm.initialize(mesh)
    rec = {}
    b = batch()
    g = torch.Generator().manual_seed(5)
    if not spec.get("rollback_only"):
        arguments_differ(mesh, rank, rec, b, g)
    roll_back(spec, mesh, rank, rec, b)
    return rec


def arguments_differ(mesh, rank, rec, b, g):

    # ---- arguments that differ between the ranks of a replica --------------------------------
    checker = tm.MegatronModel(dict(DENSE), device_mesh=mesh, mixed_precision="fp32", seed=3)
    checker.set_optimizer("AdamW", lr=1e-3)
    adv = torch.randn(B, generator=g)
    old = -torch.rand(B, S, generator=g)
    checker.set_loss("grpo")
    attempt(rec, "advantages", lambda: checker.forward_backward(inputs=b, advantages=adv + rank))
    bumped = old.clone()
    bumped[2, 5] -= 0.5 * rank
    attempt(rec, "old_logps", lambda: checker.forward_backward(inputs=b, advantages=adv, old_logps=bumped))
    nan_on_1 = adv.clone()
    if rank == 1:
        nan_on_1[1] = float("nan")
    attempt(rec, "nan_on_rank1", lambda: checker.forward_backward(inputs=b, advantages=nan_on_1))
    attempt(rec, "same_arguments", lambda: checker.forward_backward(inputs=b, advantages=adv, old_logps=old))
    checker.zero_grad()
    checker.set_loss("gkd")
    ids = torch.rand(B, S, VOCAB, generator=g).argsort(-1)[..., :K]
    lp = torch.log_softmax(torch.randn(B, S, K, generator=g), -1) - 0.1 * rank
    attempt(rec, "teacher_topk_logps",
            lambda: checker.forward_backward(inputs=b, teacher_topk_logps=lp, teacher_topk_indices=ids))
    moe = tm.MegatronModel(dict(MOE), device_mesh=mesh, mixed_precision="fp32", seed=3)
    moe.set_optimizer("AdamW", lr=1e-3)
    routed = torch.rand(B, S, 2, 4, generator=g).argsort(-1)[..., :2]
    if rank == 1:
        routed[1, 3, 0] = routed[1, 3, 0].flip(0)      # the same experts, in another order
    attempt(rec, "routed_experts", lambda: moe.forward_backward(inputs=b, routed_experts=routed))
    del checker, moe


def roll_back(spec, mesh, rank, rec, b):
    """A call failing in micro-batch 2 (see the module docstring)."""
    model = tm.MegatronModel(dict(DENSE), device_mesh=mesh, mixed_precision="fp32", seed=7)
    twin = tm.MegatronModel(dict(DENSE), device_mesh=mesh, mixed_precision="fp32", seed=7)
    for m in (model, twin):
        m.set_optimizer("AdamW", lr=1e-2)
        m.forward_backward(inputs=batch(1), micro_batch_size=2)     # grads accumulating: restored, not zeroed
    before = state_of(model)
    calls = []

    fails_here = spec.get("fail_rank", rank) == rank

    def boom(x):
        calls.append(1)
        if len(calls) == 2 and fails_here:
            raise RuntimeError("metric failed on micro-batch 2")
        return x.logps.detach().sum(), x.loss_mask.sum()

    model.add_metric("boom", boom)
    try:
        model.forward_backward(inputs=b, micro_batch_size=2)
        rec["failed_call"] = "ok"
    except RuntimeError as e:
        rec["failed_call"] = {"type": type(e).__name__, "error": str(e)}
    del model.train_state().user_metrics["boom"]
    rec["state_after_failure"] = "identical" if identical(state_of(model), before) else "changed"
    losses = []
    for m in (model, twin):
        losses.append(m.forward_backward(inputs=b, micro_batch_size=2)["loss"])
        m.clip_grad_and_step()
    rec["twin_loss_diff"] = abs(losses[0] - losses[1])
    rec["twin_param_diff"] = max(float((p - q).abs().max()) for p, q in
                                 zip(state_of(model)["params"], state_of(twin)["params"]))


def main():
    spec = json.load(open(sys.argv[1]))
    rank = int(os.environ["RANK"])
    try:
        rec = run(spec, rank)
    except Exception:
        rec = {"crashed": traceback.format_exc()}
        traceback.print_exc()
    with open(os.path.join(OUT, f"result{rank}.json"), "w") as f:
        json.dump(rec, f)
    if dist.is_initialized():
        tm.shutdown()


if __name__ == "__main__":
    main()
