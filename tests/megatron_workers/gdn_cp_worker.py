"""One rank of tests/megatron/test_gdn_context_parallel.py: each run in spec['runs'] trains a hybrid
(Gated DeltaNet) model for ``spec["steps"]`` steps under its mesh, with the local or the twinkle
layer spec and maybe a LoRA adapter, and records the losses, the grad norms, forward_only's
log-probs after training, the GDN module classes and (in ``$TWINKLE_TEST_OUT/weights_<run>_<rank>.pt``) every parameter at the end.
:func:`train` is also the single-process reference the test runs in-process.

``"contiguous": True`` replaces the layer's zigzag segments by contiguous shards (rank r holding
tokens ``[r S/cp, (r + 1) S/cp)`` of each row, which is not what it holds): the run must then
differ from the single-process one, so the test can fail. ``"packings"`` runs :func:`attention_check` (the CP
attention alone on packed rows) instead of a model. ``"packing"`` (per row, its samples'
lengths) trains on packed rows (``position_ids`` restarting); ``"shift_boundary": i`` moves packed
boundary ``cu_seqlens[i]`` one token later in what the model sees (not in the loss's segments).
"""
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

import twinkle_megatron as tm  # noqa: E402
from tests.megatron_workers.serve import serve  # noqa: E402


def make_batch(step, b, s, vocab, packing=None):
    """``{"input_ids", "labels"}`` [b, s]; with ``packing`` (per row, the lengths of its samples,
    summing to s) also ``position_ids`` restarting at 0 at every sample."""
    g = torch.Generator().manual_seed(3000 + step)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    labels[-1, s // 2:] = -100
    out = {"input_ids": ids, "labels": labels}
    if packing is not None:
        assert len(packing) == b and all(sum(row) == s for row in packing), packing
        out["position_ids"] = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in packing])
    return out


def _batch(step, spec, run):
    packing = run.get("packing")
    seq = sum(packing[0]) if packing else spec["seq"]
    return make_batch(step, spec["batch"], seq, spec["vocab"], packing)


def build(run, spec, mesh):
    model = tm.MegatronModel(run["model_dir"], device_mesh=mesh, mixed_precision="fp32",
                             use_twinkle_kernels=run.get("twinkle", False), **run.get("model_kwargs", {}))
    if run.get("lora"):
        model.add_adapter_to_model("default", run["lora"])
    model.set_optimizer("AdamW", lr=1e-3, eps=spec.get("adam_eps", 1e-8))
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=10)
    return model


def train(model, spec, run=None):
    """``spec["steps"]`` forward_backward + clip_grad_and_step calls on the whole batch (CP splits
    the rows, not the batch; ``run["packing"]``: packed rows). Returns (losses, grad norms)."""
    losses, norms = [], []
    for step in range(spec["steps"]):
        out = model.forward_backward(inputs=_batch(step, spec, run or {}), micro_batch_size=spec.get("mbs"))
        norms.append(model.clip_grad_and_step(1.0))
        losses.append(out["loss"])
    return losses, norms


def logps(model, spec, run=None):
    """forward_only's ``[B, S]`` log-probs of the trained model on the first batch (a list), or None
    where this rank gets none."""
    out = model.forward_only(inputs=_batch(0, spec, run or {}), micro_batch_size=spec.get("mbs"))
    return out["logps"].tolist() if torch.is_tensor(out.get("logps")) else None


def topk(model, spec, run, k=3):
    """forward_only(return_topk=k) on the first batch: ``{"logps": [B, S, k], "ids": [B, S, k]}``
    lists (the GKD teacher's outputs), or None where this rank gets none."""
    out = model.forward_only(inputs=_batch(0, spec, run), micro_batch_size=spec.get("mbs"), return_topk=k)
    if not torch.is_tensor(out.get("topk_logps")):
        return None
    return {"logps": out["topk_logps"].tolist(), "ids": out["topk_indices"].tolist()}


def gkd_step(model, spec, run, k=3):
    """One GKD forward_backward (beta 0.5) on the first batch against a fixed made-up teacher top-k
    (distinct ids per token, log-softmax of random values): ``[loss, grad norm]``; the grads are
    then dropped. The student's logits at the teacher's ids follow the model's layout."""
    batch = _batch(0, spec, run)
    b, s = batch["input_ids"].shape
    g = torch.Generator().manual_seed(77)
    ids = torch.stack([torch.randperm(spec["vocab"], generator=g)[:k] for _ in range(b * s)]).reshape(b, s, k)
    lps = torch.randn(b, s, k, generator=g).log_softmax(-1)
    model.set_loss("gkd", beta=0.5, temperature=1.0)
    out = model.forward_backward(inputs=batch, micro_batch_size=spec.get("mbs"), teacher_topk_logps=lps,
                                 teacher_topk_indices=ids)
    norm = model.clip_grad_norm(0)
    model.zero_grad()
    return [out["loss"], norm]


def weights(model):
    return {f"{i}.{n}": p.detach().clone() for i, chunk in enumerate(model.unwrapped_chunks())
            for n, p in chunk.named_parameters()}


def gdn_kinds(model):
    return sorted({type(m).__name__ for chunk in model.unwrapped_chunks() for m in chunk.modules()
                   if "GatedDeltaNet" in type(m).__name__})


def _contiguous(row_len, cp, rows=1):
    local = row_len // cp
    return [[(b * row_len + r * local, local) for b in range(rows)] for r in range(cp)]


def _shifted(real, index):
    """``packing.packed_seq_params`` with boundary ``cu_seqlens[index]`` one token later: the
    model sees that sample boundary misplaced by one token, the loss does not."""
    def params(cu, device):
        cu = cu.clone()
        cu[index] += 1
        return real(cu, device)
    return params


def _sample_attention(q, k, v, cu, window, scale):
    """Reference: causal softmax attention of each sample of boundaries ``cu`` on its own (and
    within ``window``), float64; q / k / v [T, H, D] (k / v GQA groups repeated) -> [T, H, D]."""
    out = torch.zeros_like(q, dtype=torch.float64)
    rep = q.shape[1] // k.shape[1]
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (t[a:b].double().transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        i = torch.arange(b - a)
        keep = (i[:, None] >= i[None, :]) & ((i[:, None] - i[None, :] < window) if window else True)
        scores = (qs @ ks.transpose(1, 2) * scale).masked_fill(~keep, float("-inf"))
        out[a:b] = (scores.softmax(-1) @ vs).transpose(0, 1)
    return out


def attention_check(run, rank):
    """``ContextParallelAttention`` on packed THD rows against :func:`_sample_attention` on the
    whole row: each rank's output at its positions, and the gradients of its q, k and v (k / v
    reach every rank through the all-gather; their gradients come back reduce-scattered). One
    record per (packing, window): max abs errors of output and grads, relative to the largest."""
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType
    from twinkle_megatron.layers.attention import ContextParallelAttention, cp_positions
    cp = ps.get_context_parallel_world_size()
    heads, groups, dim = 4, 2, 8
    out = {}
    for window in (None, 5):
        config = TransformerConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads,
                                   num_query_groups=groups, kv_channels=dim, attention_dropout=0.0,
                                   context_parallel_size=cp, use_cpu_initialization=True,
                                   window_size=None if window is None else (window - 1, 0))
        attn = ContextParallelAttention(config, 1, AttnMaskType.causal, "self")
        for name, lengths in run["packings"].items():
            total = sum(lengths)
            g = torch.Generator().manual_seed(total)
            q, k, v = (torch.randn(total, h, dim, generator=g) for h in (heads, groups, groups))
            w = torch.randn(total, heads, dim, generator=g)
            cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
            ref_q, ref_k, ref_v = (t.double().requires_grad_() for t in (q, k, v))
            ref = _sample_attention(ref_q, ref_k, ref_v, cu, window, dim ** -0.5)
            (ref * w).sum().backward()
            keep = cp_positions(total // cp, ps.get_context_parallel_rank(), cp)
            mine = [t[keep].clone().requires_grad_() for t in (q, k, v)]
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                     max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
            got = attn(*mine, None, packed_seq_params=params)
            (got.reshape(-1, heads, dim) * w[keep]).sum().backward()

            want = [r.grad[keep] for r in (ref_q, ref_k, ref_v)]
            # (grads relative to the largest of the three: with one-token samples q and k get none)
            grad_err = max(float((m.grad.double() - r).abs().max()) for m, r in zip(mine, want))
            ref_out = ref[keep].detach()
            out[f"{name}_w{window}"] = {
                "out": float((got.reshape(-1, heads, dim).double() - ref_out).abs().max() / ref_out.abs().max()),
                "grads": grad_err / max(float(r.abs().max()) for r in want)}
    return out


def run_one(run, spec, rank):
    from twinkle_megatron import packing
    if run.get("packings"):   # attention alone
        tm.initialize(tm.DeviceMesh.from_sizes(**run["mesh"]))
        try:
            return {"ok": True, "attention": attention_check(run, rank)}
        finally:
            tm.shutdown()
    from twinkle_megatron.layers import gated_delta_net as gdn
    mesh = tm.DeviceMesh.from_sizes(**run["mesh"])
    tm.initialize(mesh)
    real, real_params = gdn.zigzag_segments, packing.packed_seq_params
    if run.get("contiguous"):
        gdn.zigzag_segments = _contiguous
    if run.get("shift_boundary") is not None:
        packing.packed_seq_params = _shifted(real_params, run["shift_boundary"])
    rec = {}
    try:
        model = build(run, spec, mesh)
        rec["kinds"] = gdn_kinds(model)
        rec["losses"], rec["norms"] = train(model, spec, run)
        rec["logps"] = logps(model, spec, run)
        if run.get("packing"):
            rec["topk"] = topk(model, spec, run)
            rec["gkd"] = gkd_step(model, spec, run)
        if run.get("weights", True):   # (not under TP / PP: each rank holds a part)
            torch.save(weights(model), os.path.join(os.environ["TWINKLE_TEST_OUT"],
                                                    f"weights_{run['name']}_{rank}.pt"))
        rec["ok"] = True
    finally:
        gdn.zigzag_segments, packing.packed_seq_params = real, real_params
        tm.shutdown()
    return rec


if __name__ == "__main__":
    serve(run_one, rank=True)
