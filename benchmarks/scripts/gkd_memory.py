"""Peak memory of GKD from a teacher's top-k or full-vocabulary logits: the fused LM-head paths
against the unfused ones.

Student side (``forward_backward`` with ``set_loss("gkd")``): the loss and its backward from the
final hidden states [N, H] and the output weight [V, H], either through the full ``[N, V]`` logits
(unfused: the logits, gathered at the teacher's k ids) or through
:func:`twinkle_megatron.layers.lm_head.fused_topk_logits` (only the k head rows per token, in
chunks of tokens). Teacher side (``forward_only(return_topk=k)``): the top k of the log-softmax,
through the full logits or :func:`~twinkle_megatron.layers.lm_head.fused_topk_logps` (vocabulary
chunks, running top-k and log-sum-exp). Full-vocabulary teacher (``forward_backward`` with
``teacher_logits``): the generalized JSD over the whole vocabulary and its backward, through the
``[N, V]`` student logits and plain torch autograd (unfused, the formula as TRL writes it:
:func:`twinkle_kernels.linear_ce.jsd.linear_jsd_reference`) or through
:func:`twinkle_kernels.linear_ce.jsd.fused_linear_jsd` (token x vocabulary blocks, two passes with
online log-sum-exps, the backward recomputing the blocks). Every side also checks that the fused
and unfused results agree, so a fast wrong path cannot pass.

Peak = bytes of live tensors allocated by the call above what existed before it
(:func:`benchmarks.harness.timing.peak_memory`: on CPU, live-tensor tracking; on CUDA, the caching
allocator's peak). The hidden states and the weight (leaves) exist before the call and are not
counted; their gradients are (the weight's, [V, H], is a quarter of the fused student's peak; in
megatron's DDP it lands in a grad buffer that exists before the step). The teacher's ``[N, V]``
logits of the full-vocabulary case are the caller's input: they exist before the call and are not
counted either (the fused path reads them a block at a time and copies none of them whole).

    python -m benchmarks.scripts.gkd_memory                       # N=4096, H=1024, V=151936, k=8/64
    python -m benchmarks.scripts.gkd_memory --tokens 256 --vocab 4096 --hidden 128   # a quick run
"""
from __future__ import annotations

import argparse
import resource
import time

import torch

from benchmarks.harness import timing
from twinkle_kernels.linear_ce.jsd import fused_linear_jsd, linear_jsd_reference
from twinkle_megatron.layers.lm_head import fused_topk_logits, fused_topk_logps
from twinkle_megatron.training.losses import GKDLoss, LossInputs


def _inputs(n, h, v, k, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) / h ** 0.5).to(device)
    weight = torch.randn(v, h, generator=g).to(device)
    teacher_ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(min(n, 64))])
    teacher_ids = teacher_ids.repeat((n + 63) // 64, 1)[:n].to(device)
    teacher_logps = torch.log_softmax(torch.randn(n, k, generator=g), -1).sub(1.0).to(device)
    return hidden, weight, teacher_ids, teacher_logps


def _loss(logits_k, teacher_logps, beta, temperature):
    n, k = logits_k.shape
    mask = torch.ones(1, n, dtype=torch.bool, device=logits_k.device)
    x = LossInputs(logps=logits_k.new_zeros(1, n), loss_mask=mask,
                   segment_ids=torch.zeros(1, n, dtype=torch.long, device=logits_k.device), num_segments=1,
                   extras={"teacher_topk_logps": teacher_logps[None]}, student_topk_logits=logits_k[None])
    loss_sum, count, _ = GKDLoss(beta=beta, temperature=temperature)(x)
    return loss_sum / count


def student_unfused(h, w, ids, teacher_logps, beta, temperature):
    h.grad = w.grad = None
    logits = h @ w.T                                   # [N, V]
    loss = _loss(logits.gather(1, ids), teacher_logps, beta, temperature)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def student_fused(h, w, ids, teacher_logps, beta, temperature):
    h.grad = w.grad = None
    z = fused_topk_logits(h[:, None, :], w, ids[None])[0]     # [N, k], no [N, V]
    loss = _loss(z, teacher_logps, beta, temperature)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@torch.no_grad()
def teacher_unfused(hidden, weight, k, temperature):
    logps = torch.log_softmax((hidden.detach() @ weight.detach().T) / temperature, -1)
    return torch.topk(logps, k, dim=-1)


@torch.no_grad()
def teacher_fused(hidden, weight, k, temperature):
    v, i = fused_topk_logps(hidden.detach()[:, None, :], weight.detach(), k, temperature=temperature)
    return v[0], i[0]


def full_unfused(h, w, teacher_logits, beta, temperature):
    h.grad = w.grad = None
    loss = linear_jsd_reference(h, w, teacher_logits, beta=beta, temperature=temperature).mean()   # [N, V]
    loss.backward()
    return loss.detach(), h.grad, w.grad


def full_fused(h, w, teacher_logits, beta, temperature):
    h.grad = w.grad = None
    loss = fused_linear_jsd(h, w, teacher_logits, beta=beta, temperature=temperature).mean()
    loss.backward()
    return loss.detach(), h.grad, w.grad


def run_full(n, h, v, beta, temperature, device, fused_only=False):
    """The full-vocabulary row: (side, 'V', peaks, CPU seconds, check); ``fused_only``: the unfused
    side is not run (its peak is None: at N=4096 it needs about 27 GiB beyond the 2.3 GiB
    teacher logits, more than a 23 GiB machine has) and the check is a finite loss."""
    hidden, weight, _, _ = _inputs(n, h, v, 1, device=device)
    g = torch.Generator().manual_seed(1)
    teacher_logits = (2.0 * torch.randn(n, v, generator=g)).to(device)     # the input, held by the caller
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    res, peaks, secs = {}, {}, {}
    for name, fn in (("unfused", full_unfused), ("fused", full_fused)):
        if fused_only and name == "unfused":
            peaks[name] = secs[name] = None
            continue
        start = time.process_time()
        res[name] = fn(hidden, weight, teacher_logits, beta, temperature)
        secs[name] = time.process_time() - start
        res[name] = tuple(t.clone() for t in res[name])
        peaks[name] = timing.peak_memory(lambda: fn(hidden, weight, teacher_logits, beta, temperature),
                                         torch.device(device))
    if fused_only:
        check = f"unfused not run; fused loss {float(res['fused'][0]):.6f}"
        assert all(bool(torch.isfinite(t).all()) for t in res["fused"]), check
    else:
        errs = [_rel(a, b) for a, b in zip(res["fused"], res["unfused"])]
        check = f"loss {errs[0]:.1e}, dh {errs[1]:.1e}, dW {errs[2]:.1e}"
        assert max(errs) < 1e-4, check
    return ("student, full-vocabulary teacher_logits (forward_backward)", "V", peaks["unfused"], peaks["fused"],
            secs["unfused"], secs["fused"], check)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def run(n, h, v, ks, beta, temperature, device):
    rows = []
    for k in ks:
        hidden, weight, ids, t_logps = _inputs(n, h, v, k, device=device)
        # the leaves exist before the measured calls (as a model's hidden states and weight do)
        hidden.requires_grad_(True)
        weight.requires_grad_(True)
        for side, unfused, fused, args in (
                ("student (forward_backward)", student_unfused, student_fused, (ids, t_logps, beta, temperature)),
                ("teacher (forward_only return_topk)", teacher_unfused, teacher_fused, (k, temperature))):
            res, peaks, secs = {}, {}, {}
            for name, fn in (("unfused", unfused), ("fused", fused)):
                start = time.process_time()
                res[name] = fn(hidden, weight, *args)
                secs[name] = time.process_time() - start
                peaks[name] = timing.peak_memory(lambda: fn(hidden, weight, *args), torch.device(device))
            if side.startswith("student"):
                errs = [_rel(a, b) for a, b in zip(res["fused"], res["unfused"])]
                check = f"loss {errs[0]:.1e}, dh {errs[1]:.1e}, dW {errs[2]:.1e}"
                assert max(errs) < 1e-4, check
            else:
                (fv, fi), (uv, ui) = res["fused"], res["unfused"]
                err = _rel(fv, uv)
                # an id may differ only where both paths give that rank the same value within 1e-5:
                # two vocabulary entries tied (the paths sum the logits in another order), also
                # with the k+1-th entry at the last rank
                tied = (fv - uv).abs() < 1e-5
                differ = fi != ui
                check = (f"top-k logps {err:.1e}, ids equal at {int((~differ).sum())} of {differ.numel()} "
                         f"positions, the others tied within 1e-5")
                assert err < 1e-4 and not (differ & ~tied).any(), check
            rows.append((side, k, peaks["unfused"], peaks["fused"], secs["unfused"], secs["fused"], check))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--k", type=int, nargs="+", default=[8, 64])
    p.add_argument("--beta", type=float, default=0.5)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-topk", action="store_true", help="only the full-vocabulary row")
    p.add_argument("--no-full-vocab", action="store_true", help="only the top-k rows")
    p.add_argument("--full-fused-only", action="store_true",
                   help="the full-vocabulary row without its unfused side (too large for the machine)")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    rows = [] if a.no_topk else run(a.tokens, a.hidden, a.vocab, a.k, a.beta, a.temperature, a.device)
    if not a.no_full_vocab:
        rows.append(run_full(a.tokens, a.hidden, a.vocab, a.beta, a.temperature, a.device, a.full_fused_only))
    gib = 1 << 30
    print(f"GKD peak memory, N={a.tokens} tokens, hidden {a.hidden}, vocabulary {a.vocab}, fp32, "
          f"beta {a.beta}, T {a.temperature}, {a.device} ({timing.memory_method(torch.device(a.device))}); "
          f"[N, V] fp32 logits = {a.tokens * a.vocab * 4 / gib:.2f} GiB")
    print("| side | k | unfused peak GiB | fused peak GiB | fused / unfused | CPU s unfused | CPU s fused | "
          "fused vs unfused |")
    print("|---|---|---|---|---|---|---|---|")
    for side, k, pu, pf, su, sf, check in rows:
        if pu is None:
            print(f"| {side} | {k} | not run | {pf / gib:.3f} | - | - | {sf:.1f} | {check} |")
            continue
        print(f"| {side} | {k} | {pu / gib:.3f} | {pf / gib:.3f} | {pf / pu:.3f} | {su:.1f} | {sf:.1f} | {check} |")
    print(f"process max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20):.2f} GiB")
    return rows


if __name__ == "__main__":
    main()
