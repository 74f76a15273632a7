"""Context parallelism for the Gated DeltaNet ops: the chunked gated delta rule and the causal
conv1d over a token stream split between the ranks of a group, exact (the same outputs and
gradients as the unsplit op on the whole stream, up to rounding).

Layout. The global stream is one packed row (B == 1) of ``T`` tokens with offsets ``cu_seqlens``
(plain rows are packing too: ``cu_seqlens = [0, S, 2S, ...]``). ``segments[r]`` lists rank r's
pieces of it as ``(start, length)`` global token ranges; its local tensors hold those pieces
concatenated in the listed order. The segments of all ranks must tile ``[0, T)``. Megatron's
load-balanced split of a row into ``2 * cp`` chunks, rank r holding chunks r and ``2cp - 1 - r``,
is :func:`zigzag_segments`: every rank holds two non-adjacent pieces, so the state has to travel
r -> r + 1 -> ... -> cp - 1 -> cp - 1 -> ... -> 0 along the stream, not rank by rank.

Method (state passing). Per value head the delta rule's state update
``S <- (I - beta k k^T) exp(g) S + beta k v^T`` is affine in S, so a segment that a sequence runs
through maps the state entering it to the state leaving it as ``S_out = M S_in + S_ext`` with
``M [HV, K, K]`` (the product of the per-token factors) and ``S_ext [HV, K, V]`` (the state it
leaves from a zero start). Each rank:

1. runs the tokens that do not depend on an earlier segment (sequences that start in the segment)
   at once, and, for a segment that one sequence runs through from end to end, one extra
   forward-only call of the op with the state widened to ``[K, K + V]``: initial state ``[I | 0]``
   and values ``[0 | v]`` give ``[M | S_ext]`` as its final state (and, as its output's first K
   columns, ``scale * M_t^T q_t`` per token, kept for the backward);
2. all-gathers the summaries of every segment whose last sequence continues in the next one;
3. folds them in global order (``S_in`` of a segment is ``S_out`` of the one before it, only
   along one sequence) in fp32 (float64 for float64 inputs), and runs the rest of its tokens, the
   sequences continuing from an earlier segment, with the folded initial states.

Backward: the local backward of the continuing-sequence calls that end locally, and
``(scale M_t^T q_t)^T do_t`` summed over a through-segment's tokens, give each segment's own
``dS_in``; these are all-gathered and folded backwards with ``M^T``
(``dS_out[j] = dS_in[j + 1]``, ``dS_in[j] = a[j] + M[j]^T dS_out[j]``), and each segment's
``dS_out`` enters its local backward as the gradient of its last sequence's final state. No rank
reruns another rank's tokens.

Communication (per call, :func:`chunk_gated_delta_rule_cp`): two all-gathers, skipped when no
sequence crosses a segment boundary. Forward: each rank contributes, for each of its segments whose
last sequence continues in the next segment, ``S_ext [HV, K, V]`` and, if one sequence runs through
the whole segment, also ``M [HV, K, K]``, in the state dtype (fp32, float64 for float64 inputs),
zero-padded to the largest rank's payload. Backward: each rank contributes ``dS_in [HV, K, V]`` for
each of its segments whose first sequence started in an earlier one, padded the same way. So each
rank hands the all-gathers at most ``n_seg * HV * K * (K + 2V)`` elements per call (forward
``n_seg * HV * K * (K + V)``, backward ``n_seg * HV * K * V``; n_seg = 2 with the zigzag split, 1
for the middle rank, whose two chunks are adjacent and merged), and each of the ``cp - 1`` other
ranks receives them: at most ``(cp - 1) * n_seg * HV * K * (K + 2V) * 4`` bytes sent per rank in
fp32, independent of the sequence length. The conv (:func:`causal_conv1d_cp`) all-gathers the
last ``W - 1`` tokens of every segment, ``[n_seg, D, W - 1]`` in x's dtype, and in backward the
gradients of those halos, the same size.

Process groups are pluggable (:class:`Collective`): a ``torch.distributed`` group (gloo, nccl),
or :func:`simulate`'s threads in one process, which tests and one-GPU checks use. Every rank must
call the op and backpropagate through it (it has collectives in its backward).
"""
from __future__ import annotations

import bisect
import dataclasses
import threading
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from . import _args
from .. import _checks, _dispatch

# the registry entries the public ops dispatch to (twinkle_kernels.gdn registers their backends;
# this module is imported by it, so it does not import it back)
_CHUNK = _dispatch.op("chunk_gated_delta_rule")
_CONV = _dispatch.op("causal_conv1d")

__all__ = ["chunk_gated_delta_rule_cp", "causal_conv1d_cp", "zigzag_segments", "plan", "fold_states",
           "fold_state_grads", "Collective", "TorchCollective", "simulate", "lockstep", "ContextParallelPlan"]


# -- collectives ------------------------------------------------------------------------------------

class Collective:
    """What the context-parallel ops need of a process group: ``rank``, ``world`` and an
    all-gather of one same-shaped tensor per rank. ``bytes_sent`` counts what this rank hands
    to the all-gathers times ``world - 1`` (each peer receives its tensor once)."""

    rank: int
    world: int

    def __init__(self):
        self.bytes_sent = 0
        self.calls = 0

    def _all_gather(self, t: torch.Tensor) -> List[torch.Tensor]:
        raise NotImplementedError

    def all_gather(self, t: torch.Tensor) -> List[torch.Tensor]:
        t = t.contiguous()
        self.bytes_sent += t.numel() * t.element_size() * (self.world - 1)
        self.calls += 1
        return self._all_gather(t)


class TorchCollective(Collective):
    """A ``torch.distributed`` process group (None: the default group)."""

    def __init__(self, group=None):
        super().__init__()
        import torch.distributed as dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def _all_gather(self, t):
        import torch.distributed as dist
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t, group=self.group)
        return parts


class _ThreadGroup:
    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world)
        self.slots: List[Optional[torch.Tensor]] = [None] * world
        # one rank computes at a time (a rank lets go only inside a collective): the ranks'
        # results do not depend on scheduling, and code that is not thread-safe (Triton's
        # interpreter) runs as in one process
        self.turn = threading.Lock()


class _ThreadCollective(Collective):
    def __init__(self, shared: _ThreadGroup, rank: int):
        super().__init__()
        self.shared, self.rank, self.world = shared, rank, shared.world

    def _all_gather(self, t):
        s = self.shared
        s.slots[self.rank] = t.clone()
        s.turn.release()
        try:
            s.barrier.wait()          # every rank has written its slot
            with s.turn:
                out = [x.clone() for x in s.slots]
            s.barrier.wait()          # every rank has read: the slots may be reused
        finally:
            s.turn.acquire()
        return out


def simulate(world: int, fn: Callable[[int, Collective], object], timeout: float = 600.0) -> list:
    """Runs ``fn(rank, collective)`` for ``rank in range(world)`` on ``world`` threads of this
    process, their collectives connected to each other, one rank computing at a time; returns the
    results in rank order. An exception in one rank breaks the others' collectives and is raised
    here. CPU tensors only where ``fn`` backpropagates: the autograd engine runs a backward of
    CUDA tensors on its one device thread, where two ranks waiting for each other's collective
    would deadlock; :func:`lockstep` serves that case."""
    shared = _ThreadGroup(world)
    results, errors = [None] * world, [None] * world

    def run(r):
        shared.turn.acquire()
        try:
            results[r] = fn(r, _ThreadCollective(shared, r))
        except BaseException as e:  # noqa: BLE001  (raised below, in the caller's thread)
            errors[r] = e
            shared.barrier.abort()   # the other ranks stop waiting for this one
        finally:
            shared.turn.release()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            shared.barrier.abort()
            raise TimeoutError(f"simulated rank did not finish within {timeout} s")
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real or any(e is not None for e in errors):
        raise (real or [e for e in errors if e is not None])[0]
    return results


def _collective(group) -> Collective:
    if isinstance(group, Collective):
        return group
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised; pass a process group or a Collective "
                         "(e.g. from twinkle_kernels.gdn.cp.simulate)")
    return TorchCollective(group)


# -- the plan: where every segment sits and what depends on what --------------------------------------

def zigzag_segments(row_len: int, cp: int, rows: int = 1) -> List[List[Tuple[int, int]]]:
    """Megatron's load-balanced context-parallel split: each of ``rows`` rows of ``row_len``
    tokens (laid end to end in the packed stream) is cut into ``2 * cp`` equal chunks and rank r
    holds chunks r and ``2cp - 1 - r`` of every row, in that order. Returns ``segments`` for the
    ops: per rank, a list of ``(global start, length)``. ``row_len`` must divide by ``2 * cp``."""
    if cp < 1 or row_len % (2 * cp):
        raise ValueError(f"row_len={row_len} must be a multiple of 2 * cp = {2 * cp}")
    c = row_len // (2 * cp)
    return [[(b * row_len + i * c, c) for b in range(rows) for i in (r, 2 * cp - 1 - r)] for r in range(cp)]


@dataclasses.dataclass
class _Seg:
    rank: int
    start: int          # global token range [start, end)
    end: int
    local: int          # offset of its first token in the rank's local tensors
    head_open: bool = False   # its first token continues a sequence of the segment before it
    tail_open: bool = False   # its last sequence continues in the segment after it
    through: bool = False     # one sequence runs through it from end to end
    prev: Optional[int] = None  # index (global order) of the segment it takes its state from


@dataclasses.dataclass
class ContextParallelPlan:
    """Everything the ops derive from ``(cu_seqlens, segments, rank)`` (all ranks derive the same
    global part). ``segs``: the non-empty segments of all ranks in global order, adjacent ones of a
    rank merged; ``mine``: indices into ``segs`` of this rank's, in local order; ``ends``: the
    global indices of the sequences whose final state this rank returns."""
    cu: List[int]
    total: int
    rank: int
    world: int
    segs: List[_Seg]
    mine: List[int]
    ends: List[int]
    local_len: int

    def sequence_at(self, pos: int) -> int:
        """Index of the non-empty sequence holding global token ``pos``."""
        return bisect.bisect_right(self.cu, pos) - 1


def _global_order(segs: List[_Seg]) -> List[_Seg]:
    """The segments in stream order. (tests/kernels/test_gdn_cp.py replaces this with rank-major order to
    show that treating the zigzag pieces as one contiguous shard per rank gives wrong answers.)"""
    return sorted(segs, key=lambda s: s.start)


def plan(cu_seqlens, segments, rank: int, world: int) -> ContextParallelPlan:
    """Validates the layout and derives the plan (see :class:`ContextParallelPlan`).

    Args:
        cu_seqlens: ``[N + 1]`` int tensor (or list) of global packed-sequence offsets.
        segments: per rank, a list of ``(start, length)`` global token ranges (see the module doc).
        rank, world: this rank and the group size.
    """
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1:
            raise TypeError(f"cu_seqlens must be a 1-D int32/int64 tensor, got {cu_seqlens.dtype} "
                            f"of shape {tuple(cu_seqlens.shape)}")
        cu = [int(c) for c in cu_seqlens.tolist()]
    else:
        cu = [int(c) for c in cu_seqlens]
    if not isinstance(segments, (list, tuple)) or len(segments) != world:
        n = len(segments) if isinstance(segments, (list, tuple)) else type(segments).__name__
        raise ValueError(f"group has {world} ranks but segments describes {n}; segments must list every "
                         f"rank's (start, length) pieces, one entry per rank of the group")
    raw = []
    for r, mine in enumerate(segments):
        for i, piece in enumerate(mine):
            try:
                a, n = (int(x) for x in piece)
            except (TypeError, ValueError):
                raise ValueError(f"segments[{r}][{i}] must be a (start, length) pair of ints, got {piece!r}") from None
            if a < 0 or n < 0:
                raise ValueError(f"segments[{r}][{i}] = ({a}, {n}): start and length must be >= 0")
            raw.append((a, a + n, r, i))
    nonempty = sorted((x for x in raw if x[1] > x[0]), key=lambda x: x[0])
    pos = 0
    for a, b, r, i in nonempty:
        if a < pos:
            raise ValueError(f"segments overlap: segments[{r}][{i}] starts at {a}, before the end {pos} of the "
                             f"piece before it in the stream")
        if a > pos:
            raise ValueError(f"segments leave a gap: no rank holds tokens [{pos}, {a}) (segments[{r}][{i}] "
                             f"starts at {a})")
        pos = b
    total = pos
    if total == 0:
        raise ValueError("segments hold no tokens")
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing offsets starting at 0, got {cu}")
    if cu[-1] != total:
        raise ValueError(f"cu_seqlens ends at {cu[-1]} but the segments of all ranks hold {total} tokens; "
                         f"cu_seqlens must be the global offsets of the whole stream")
    # one _Seg per run of a rank's consecutive pieces that are adjacent in the stream
    per_rank: List[List[_Seg]] = []
    for r, mine in enumerate(segments):
        out, local = [], 0
        for a, n in ((int(p[0]), int(p[1])) for p in mine):
            if n == 0:
                continue
            if out and out[-1].end == a:
                out[-1].end = a + n
            else:
                out.append(_Seg(r, a, a + n, local))
            local += n
        per_rank.append(out)
    order = _global_order([s for segs in per_rank for s in segs])
    bounds = set(cu)
    for j, s in enumerate(order):
        s.head_open = s.start not in bounds
        s.tail_open = s.end not in bounds
    for j, s in enumerate(order):
        # the state comes from the segment before it in the stream order, if that one's last
        # sequence is still open
        s.prev = j - 1 if (s.head_open and j > 0 and order[j - 1].tail_open) else None
        nxt = bisect.bisect_right(cu, s.start)
        inner = nxt < len(cu) and cu[nxt] < s.end
        s.through = s.prev is not None and s.tail_open and not inner
    index = {id(s): j for j, s in enumerate(order)}
    mine_idx = [index[id(s)] for s in per_rank[rank]]
    # sequences whose final state this rank returns: a non-empty one where its last token is; an
    # empty one at offset e where token e - 1 is (offset 0: with the token 0)
    ends = []
    for n in range(len(cu) - 1):
        e = cu[n + 1]
        for j in mine_idx:
            s = order[j]
            if s.start < e <= s.end or (e == 0 and s.start == 0):
                ends.append(n)
                break
    local_len = sum(int(p[1]) for p in segments[rank])
    return ContextParallelPlan(cu, total, rank, world, order, mine_idx, ends, local_len)


# -- the fold ---------------------------------------------------------------------------------------

def fold_states(M: Sequence[Optional[torch.Tensor]], S: Sequence[torch.Tensor],
                prev: Sequence[Optional[int]]) -> List[Optional[torch.Tensor]]:
    """States entering every segment, from the segments' summaries, in stream order.

    Args:
        M: per segment ``[HV, K, K]`` (a sequence runs through it) or None (the state leaving it
            does not depend on the one entering it).
        S: per segment ``[HV, K, V]``, the state it leaves from a zero start (None: nothing leaves).
        prev: per segment, the index of the segment it takes its state from, or None.

    Returns per segment ``S_in [HV, K, V]`` or None, from ``S_out[j] = M[j] S_in[j] + S[j]``
    (``S_in[j] = S_out[prev[j]]``), computed in the summaries' dtype.
    """
    s_in: List[Optional[torch.Tensor]] = [None] * len(S)
    s_out: List[Optional[torch.Tensor]] = [None] * len(S)
    for j in range(len(S)):
        if prev[j] is not None:
            s_in[j] = s_out[prev[j]]
        if S[j] is not None:
            s_out[j] = S[j] if (M[j] is None or s_in[j] is None) else torch.matmul(M[j], s_in[j]) + S[j]
    return s_in


def fold_state_grads(M: Sequence[Optional[torch.Tensor]], A: Sequence[Optional[torch.Tensor]],
                     prev: Sequence[Optional[int]]) -> List[Optional[torch.Tensor]]:
    """The backward of :func:`fold_states`: the gradient of every segment's outgoing state.

    ``A[j]`` is the gradient of segment j's incoming state through its own tokens only (None when
    it takes none); the total is ``dS_in[j] = A[j] + M[j]^T dS_out[j]`` and flows to
    ``dS_out[prev[j]]``. Returns per segment ``dS_out [HV, K, V]`` or None."""
    d_out: List[Optional[torch.Tensor]] = [None] * len(A)
    for j in reversed(range(len(A))):
        if prev[j] is None or A[j] is None:
            continue
        d_in = A[j]
        if M[j] is not None and d_out[j] is not None:
            d_in = d_in + torch.matmul(M[j].transpose(-1, -2), d_out[j])
        d_out[prev[j]] = d_in
    return d_out


# -- the gated delta rule ---------------------------------------------------------------------------

@dataclasses.dataclass
class _Call:
    """One call of the local op over some pieces (global ranges) of this rank's tokens."""
    pieces: List[Tuple[int, int, int, int]]   # (local start, local end, global sequence, segment index)
    h0: List[str]                              # per piece: "zero", "init", "in" (the folded S_in)

    def local_cu(self, device) -> torch.Tensor:
        cu = [0]
        for a, b, _, _ in self.pieces:
            cu.append(cu[-1] + b - a)
        return torch.tensor(cu, dtype=torch.long, device=device)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[:, a:b] for a, b, _, _ in self.pieces], 1)


def _calls(p: ContextParallelPlan, has_init: bool):
    """Splits this rank's tokens into the calls of the local op: ``body`` (sequences starting in
    their segment), ``closed`` (continuing from an earlier segment and ending in this one) and
    ``through`` (running through the whole segment)."""
    body, closed, through = _Call([], []), _Call([], []), _Call([], [])
    cu = p.cu
    first = True
    for j in p.mine:
        s = p.segs[j]
        n = p.sequence_at(s.start)
        while n < len(cu) - 1 and cu[n] < s.end:
            a, b = max(cu[n], s.start), min(cu[n + 1], s.end)
            if b > a:
                piece = (s.local + a - s.start, s.local + b - s.start, n, j)
                if cu[n] < s.start and s.prev is not None:
                    (through if s.through else closed).pieces.append(piece)
                    (through if s.through else closed).h0.append("in")
                else:
                    # a sequence starting here (or continuing from a segment that passes no state,
                    # which only a wrong layout produces): the rank's first token may take initial_state
                    body.pieces.append(piece)
                    body.h0.append("init" if (first and has_init and piece[0] == 0) else "zero")
            n += 1
        first = False
    return body, closed, through



def _state_dtype(v: torch.Tensor) -> torch.dtype:
    return torch.float64 if v.dtype == torch.float64 else torch.float32


def _run(call: _Call, xs, scale, h0, l2, chunk_size, backend, v_extra: Optional[int] = None):
    """Runs the local op on ``call``'s pieces of ``xs = (q, k, v, g, beta)`` from the initial states
    ``h0 [n_pieces, HV, K, V(+v_extra)]``; returns (o, final states of every piece)."""
    q, k, v, g, beta = (call.take(t) for t in xs)
    if v_extra is not None:   # the widened state [K, K + V]: values [0 | v]
        v = torch.cat([v.new_zeros(*v.shape[:3], v_extra), v], -1)
    return _CHUNK(q.device, backend, q, k, v, g, beta, scale, h0, True, l2, call.local_cu(q.device), chunk_size)


def _pack(items: List[torch.Tensor], size: int, like: torch.Tensor) -> torch.Tensor:
    """The items flattened end to end, zero-padded to ``size`` elements (all ranks' payloads must
    have one shape)."""
    flat = torch.cat([t.reshape(-1).to(like.dtype) for t in items]) if items else like.new_zeros(0)
    return torch.cat([flat, like.new_zeros(size - flat.numel())])


def _ends_at(p: ContextParallelPlan, piece, segment_end: bool) -> bool:
    """Whether a piece's last token is its sequence's last (or, with ``segment_end``, its segment's)."""
    a, b, n, j = piece
    s = p.segs[j]
    g_end = s.start + (b - s.local)
    return g_end == s.end if segment_end else g_end == p.cu[n + 1]


class _GDNRank:
    """One rank's part of :func:`chunk_gated_delta_rule_cp`, in the phases between its collectives
    (see the module doc): ``forward_local`` -> all-gather -> ``forward_finish`` and
    ``backward_local`` -> all-gather -> ``backward_finish``. The local calls run on detached
    copies of the inputs with their own autograd graphs, which the backward differentiates once
    each. :class:`_GatedDeltaRuleCP` runs the phases with a :class:`Collective` between them;
    :func:`lockstep` runs all ranks' phases in turn in one thread."""

    def __init__(self, q, k, v, g, beta, init, p: ContextParallelPlan, scale, l2, chunk_size, backend):
        self.p, self.scale, self.l2, self.chunk_size, self.backend = p, scale, l2, chunk_size, backend
        self.HV, self.K, self.V = v.shape[2], q.shape[3], v.shape[3]
        self.sdt = _state_dtype(v)
        self.dev = q.device
        self.v_dtype = v.dtype
        self.zero = torch.zeros(self.HV, self.K, self.V, dtype=self.sdt, device=self.dev)
        self.body, self.closed, self.through = _calls(p, init is not None)
        self.leaves = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v, g, beta)]
        self.init = init
        self.needs = any(t.requires_grad for t in (q, k, v, g, beta)) or (init is not None and init.requires_grad)
        self.calls = {}
        nseg = len(p.segs)
        self.M: List[Optional[torch.Tensor]] = [None] * nseg
        self.S: List[Optional[torch.Tensor]] = [None] * nseg
        # what travels: the summaries of segments another one takes its state from, and the
        # incoming-state gradients of those segments
        self.sends = [j for j in range(nseg) if any(t.prev == j for t in p.segs)]
        self.recv = [j for j, t in enumerate(p.segs) if t.prev is not None]
        self.exchange = bool(self.sends)

    def _record(self, name, call, states):
        if not call.pieces:
            return None
        h0 = torch.stack(states).detach().requires_grad_(self.needs)
        with torch.set_grad_enabled(self.needs):
            o, fin = _run(call, self.leaves, self.scale, h0, self.l2, self.chunk_size, self.backend)
        self.calls[name] = (call, h0, o, fin)
        return o, fin

    def _size(self, js, r, through_too):
        HV, K, V = self.HV, self.K, self.V
        return sum(HV * K * V + (HV * K * K if through_too and self.p.segs[j].through else 0)
                   for j in js if self.p.segs[j].rank == r)

    def forward_local(self) -> Optional[torch.Tensor]:
        """Runs what needs nothing from other ranks; returns this rank's summary payload (None
        when no state crosses a segment boundary anywhere)."""
        p, HV, K, V, sdt = self.p, self.HV, self.K, self.V, self.sdt
        init_s = None if self.init is None else self.init[0].detach().to(sdt)
        res_body = self._record("body", self.body, [init_s if kind == "init" else self.zero for kind in self.body.h0])
        self.o_I = None
        if self.through.pieces:
            # [M | S_ext] as the final state of one call from [I | 0] with values [0 | v]
            eye = torch.eye(K, dtype=sdt, device=self.dev).expand(HV, K, K)
            h0w = torch.cat([eye, self.zero], -1).expand(len(self.through.pieces), HV, K, K + V)
            with torch.no_grad():
                ow, fw = _run(self.through, [t.detach() for t in self.leaves], self.scale, h0w, self.l2,
                              self.chunk_size, self.backend, v_extra=K)
            self.o_I = ow[..., :K]   # scale * M_t^T q_t per token: d(o_t)/d(S_in), for the backward
            for i, (_, _, _, j) in enumerate(self.through.pieces):
                self.M[j], self.S[j] = fw[i, :, :, :K].to(sdt), fw[i, :, :, K:].to(sdt)
        if res_body is not None:
            for i, piece in enumerate(self.body.pieces):
                if p.segs[piece[3]].tail_open and _ends_at(p, piece, True):
                    self.S[piece[3]] = res_body[1][i].detach().to(sdt)
        if not self.exchange:
            return None
        mine = [x for j in self.sends if p.segs[j].rank == p.rank
                for x in ([self.M[j]] if p.segs[j].through else []) + [self.S[j]]]
        return _pack(mine, max(self._size(self.sends, r, True) for r in range(p.world)), self.zero)

    def forward_finish(self, parts: Optional[List[torch.Tensor]]):
        """From every rank's payload: folds, runs the continuing sequences; returns (o, finals)."""
        p, HV, K, V = self.p, self.HV, self.K, self.V
        if parts is not None:
            offs = [0] * p.world
            for j in self.sends:
                r = p.segs[j].rank
                if p.segs[j].through:
                    self.M[j] = parts[r][offs[r]:offs[r] + HV * K * K].view(HV, K, K)
                    offs[r] += HV * K * K
                self.S[j] = parts[r][offs[r]:offs[r] + HV * K * V].view(HV, K, V)
                offs[r] += HV * K * V
        s_in = fold_states(self.M, self.S, [t.prev for t in p.segs])
        self._record("closed", self.closed, [s_in[piece[3]] for piece in self.closed.pieces])
        self._record("through", self.through, [s_in[piece[3]] for piece in self.through.pieces])
        o = torch.empty(1, p.local_len, HV, V, dtype=self.v_dtype, device=self.dev)
        self.finals = {}
        for name, (call, _, o_c, fin_c) in self.calls.items():
            pos = 0
            for i, piece in enumerate(call.pieces):
                a, b, n, _ = piece
                o[:, a:b] = o_c[:, pos:pos + b - a].detach()
                pos += b - a
                if _ends_at(p, piece, False):
                    self.finals[n] = (name, i)
        fin = [self.calls[self.finals[n][0]][3][self.finals[n][1]].detach() if n in self.finals else self.zero
               for n in p.ends]
        fin = torch.stack(fin) if fin else self.zero.new_zeros(0, HV, K, V)
        return o, fin

    def _vjp(self, name, tail):
        """Differentiates one local call, with the final-state gradients the caller gave and
        ``tail[j]`` for the last sequence of a segment j that continues elsewhere; accumulates the
        input gradients and returns the gradient of the call's initial states."""
        if name not in self.calls:
            return None
        p = self.p
        call, h0, o, fin = self.calls[name]
        d_o = call.take(self.do).to(o.dtype) if self.do is not None else torch.zeros_like(o)
        d_f = torch.zeros_like(fin)
        for i, piece in enumerate(call.pieces):
            n, j = piece[2], piece[3]
            if self.finals.get(n) == (name, i) and n in self.dfin_of:
                d_f[i] += self.dfin_of[n].to(d_f.dtype)
            if tail is not None and tail[j] is not None and p.segs[j].tail_open and _ends_at(p, piece, True):
                d_f[i] += tail[j].to(d_f.dtype)
        wrt = [t for t in self.leaves if t.requires_grad]
        with torch.enable_grad():
            got = torch.autograd.grad([o, fin], wrt + [h0], [d_o, d_f], allow_unused=True)
        for t, gr in zip(wrt, got[:-1]):
            if gr is not None:
                self.grads[id(t)] = gr if self.grads.get(id(t)) is None else self.grads[id(t)] + gr
        return torch.zeros_like(h0) if got[-1] is None else got[-1]

    def backward_local(self, do, dfin) -> Optional[torch.Tensor]:
        """Each receiving segment's own part of d(loss)/d(S_in), through its own tokens only:
        the backward of the continuing sequences that end here (they wait for nothing), and
        ``sum_t (scale M_t^T q_t) do_t^T`` over a through-segment. Returns the payload."""
        p, HV, K, V, sdt = self.p, self.HV, self.K, self.V, self.sdt
        self.do = do
        self.dfin_of = {n: dfin[i] for i, n in enumerate(p.ends)} if dfin is not None else {}
        self.grads = {}
        if not self.exchange:
            return None
        self.A: List[Optional[torch.Tensor]] = [None] * len(p.segs)
        d_closed = self._vjp("closed", None)
        if d_closed is not None:
            for i, piece in enumerate(self.calls["closed"][0].pieces):
                self.A[piece[3]] = d_closed[i]
        if "through" in self.calls:
            pos = 0
            for a, b, n, j in self.calls["through"][0].pieces:
                if do is None:
                    self.A[j] = torch.zeros(HV, K, V, dtype=sdt, device=self.dev)
                else:
                    self.A[j] = torch.einsum("thk,thv->hkv", self.o_I[0, pos:pos + b - a].to(sdt), do[0, a:b].to(sdt))
                pos += b - a
        width = max(self._size(self.recv, r, False) for r in range(p.world))
        return _pack([self.A[j] for j in self.recv if p.segs[j].rank == p.rank], width, self.zero)

    def backward_finish(self, parts: Optional[List[torch.Tensor]]):
        """Reverse fold with M^T, then the backward of the rest; returns the input gradients
        (q, k, v, g, beta, initial_state), None where not required."""
        p, HV, K, V = self.p, self.HV, self.K, self.V
        d_out: List[Optional[torch.Tensor]] = [None] * len(p.segs)
        if parts is not None:
            offs = [0] * p.world
            for j in self.recv:
                r = p.segs[j].rank
                self.A[j] = parts[r][offs[r]:offs[r] + HV * K * V].view(HV, K, V)
                offs[r] += HV * K * V
            d_out = fold_state_grads(self.M, self.A, [t.prev for t in p.segs])
        d_body = self._vjp("body", d_out)
        self._vjp("through", d_out)
        out = [self.grads.get(id(t)) if t.requires_grad else None for t in self.leaves]
        out = [torch.zeros_like(t) if (t.requires_grad and gr is None) else gr for t, gr in zip(self.leaves, out)]
        d_init = None
        if self.init is not None and self.init.requires_grad:
            rows = [i for i, kind in enumerate(self.body.h0) if kind == "init"]
            d_init = d_body[rows[0]].unsqueeze(0).to(self.init.dtype)
        self.calls = {}   # the local graphs are spent
        return (*out, d_init)


class _GatedDeltaRuleCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, init, p, comm: Collective, scale, l2, chunk_size, backend):
        st = _GDNRank(q, k, v, g, beta, init, p, scale, l2, chunk_size, backend)
        payload = st.forward_local()
        o, fin = st.forward_finish(comm.all_gather(payload) if payload is not None else None)
        ctx.st, ctx.comm = st, comm
        return o, fin

    @staticmethod
    def backward(ctx, do, dfin):
        st = ctx.st
        payload = st.backward_local(do, dfin)
        grads = st.backward_finish(ctx.comm.all_gather(payload) if payload is not None else None)
        return (*grads, None, None, None, None, None, None)


def _local_tokens_check(name: str, t: torch.Tensor, p: ContextParallelPlan) -> None:
    if t.shape[1] != p.local_len:
        raise ValueError(f"{name} holds {t.shape[1]} tokens but rank {p.rank}'s segments hold {p.local_len} "
                         f"(the sum of segments[{p.rank}]'s lengths)")


def chunk_gated_delta_rule_cp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, scale: Optional[float] = None,
                              initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                              use_qk_l2norm_in_kernel: bool = False, *, cu_seqlens, segments, group=None,
                              chunk_size: int = 64, backend: Optional[str] = None
                              ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Context-parallel :func:`~twinkle_kernels.gdn.chunk_gated_delta_rule`: this rank's share of
    the unsplit op's result on the whole packed stream.

    Args:
        q: ``[1, T_r, H, K]``: this rank's tokens, its segments concatenated in the order
            ``segments[rank]`` lists them (float32 / bfloat16 / float16, float64 on the reference).
        k: ``[1, T_r, H, K]``, q's dtype.
        v: ``[1, T_r, HV, V]``, q's dtype; HV % H == 0 (value head j reads key head j // (HV // H)).
        g: ``[1, T_r, HV]`` log-space decay (any float dtype).
        beta: ``[1, T_r, HV]`` write strength (any float dtype).
        scale: read-out scale, default ``K ** -0.5``.
        initial_state: ``[1, HV, K, V]`` (any float dtype) or None: the state the sequence that
            starts at this rank's first local token starts from (the first sequence of the stream on
            rank 0). Every other sequence starts from zeros.
        output_final_state: also return the final states of the sequences ending on this rank.
        use_qk_l2norm_in_kernel: L2-normalise q and k over K inside the op, as the unsplit op.
        cu_seqlens: ``[N + 1]`` int32/int64 global offsets of the packed sequences of the whole
            stream (the same on every rank; empty sequences allowed).
        segments: per rank of the group, a list of ``(global start, length)``; they must tile
            ``[0, cu_seqlens[-1])``. :func:`zigzag_segments` gives megatron's split.
        group: a ``torch.distributed`` process group (None: the default group) or a
            :class:`Collective` (e.g. :func:`simulate`'s).
        chunk_size: as the unsplit op.
        backend: as the unsplit op; it runs every local call.

    Returns ``(o, final_state)``: ``o [1, T_r, HV, V]`` in v's dtype; ``final_state
    [n_end, HV, K, V]`` fp32 (float64 for float64 inputs) for the sequences
    ``plan(cu_seqlens, segments, rank, world).ends`` (those whose last token, or for an empty
    sequence its offset's token before, is on this rank, in global order), or None.
    Differentiable in q, k, v, g, beta and initial_state. Communication: one all-gather in the
    forward of at most ``n_seg * HV * K * (K + V)`` state-dtype elements per rank (the summaries
    ``[M | S_ext]``), one in the backward of at most ``n_seg * HV * K * V`` (the ``dS_in``), none
    when no sequence crosses a segment boundary; independent of T (see the module doc).
    """
    comm = _collective(group)
    scale = _args.gated_delta_rule(q, k, v, g, beta, scale, None, output_final_state, use_qk_l2norm_in_kernel,
                                   None, chunk_size)
    if q.shape[0] != 1:
        raise ValueError(f"q must hold one packed row (B == 1) of this rank's tokens, got B={q.shape[0]}")
    p = plan(cu_seqlens, segments, comm.rank, comm.world)
    _local_tokens_check("q", q, p)
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    if initial_state is not None:
        _checks.tensor("initial_state", initial_state)
        if tuple(initial_state.shape) != (1, HV, K, V):
            raise ValueError(f"initial_state must have shape [1, HV, K, V] = {[1, HV, K, V]} (the state of the "
                             f"sequence starting at this rank's first token), got {tuple(initial_state.shape)}")
        first = p.segs[p.mine[0]].start if p.mine else None
        if first is None or first not in set(p.cu):
            raise ValueError(f"initial_state is given, but rank {p.rank}'s first token (global position {first}) "
                             f"starts no sequence: cu_seqlens has no offset {first}, so that token continues a "
                             f"sequence whose state comes from another rank")
        _checks.same_device(("q", "initial_state"), (q, initial_state))
    o, fin = _GatedDeltaRuleCP.apply(q, k, v, g, beta, initial_state, p, comm, scale, use_qk_l2norm_in_kernel,
                                     chunk_size, backend)
    return o, (fin if output_final_state else None)


# -- the causal conv1d ------------------------------------------------------------------------------

def _halo_sources(p: ContextParallelPlan, W: int):
    """For each of this rank's segments, where its halo comes from: the tokens of its own sequence
    among the ``W - 1`` before it, as ``(width h, [(source segment, tail columns, halo columns)])``
    with tail blocks holding every segment's last ``W - 1`` tokens right-aligned."""
    out = []
    for j in p.mine:
        s = p.segs[j]
        seq_start = p.cu[p.sequence_at(s.start)]
        h = min(W - 1, s.start - seq_start)
        srcs, need, i = [], h, j - 1
        while need > 0:
            # the stream order: segment i ends where segment i + 1 starts
            n = min(need, p.segs[i].end - p.segs[i].start)
            srcs.append((i, (W - 1 - n, W - 1), (need - n, need)))
            need -= n
            i -= 1
        out.append((h, srcs))
    return out


def _tails(x: torch.Tensor, p: ContextParallelPlan, W: int) -> torch.Tensor:
    """The payload of the halo exchange: the last ``W - 1`` tokens of each of this rank's segments,
    right-aligned, ``[n_seg_max, D, W - 1]`` (zero-padded to the rank with most segments)."""
    width = max(sum(1 for s in p.segs if s.rank == r) for r in range(p.world))
    tails = x.new_zeros(width, x.shape[1], W - 1)
    for m, j in enumerate(p.mine):
        s = p.segs[j]
        n = min(W - 1, s.end - s.start)
        lo = s.local + (s.end - s.start) - n
        tails[m, :, W - 1 - n:] = x[0, :, lo:lo + n]
    return tails


def _halos_from(parts: List[torch.Tensor], p: ContextParallelPlan, W: int, sources) -> torch.Tensor:
    """This rank's halos ``[n_seg, D, W - 1]`` (right-aligned) from every rank's tails."""
    slot = _slots(p)
    halos = parts[0].new_zeros(len(p.mine), parts[0].shape[1], W - 1)
    for m, (h, srcs) in enumerate(sources):
        for i, (t0, t1), (h0, h1) in srcs:
            r, idx = slot[i]
            halos[m, :, W - 1 - h + h0:W - 1 - h + h1] = parts[r][idx, :, t0:t1]
    return halos


def _halo_grads_payload(dhalos: torch.Tensor, p: ContextParallelPlan, W: int) -> torch.Tensor:
    width = max(sum(1 for s in p.segs if s.rank == r) for r in range(p.world))
    d = dhalos.contiguous()
    return torch.cat([d, d.new_zeros(width - d.shape[0], d.shape[1], W - 1)])


def _dx_from(parts: List[torch.Tensor], p: ContextParallelPlan, W: int, shape) -> torch.Tensor:
    """The gradient of this rank's tokens through every rank's halos (from their gathered
    gradients): each halo column that came from one of this rank's segments goes back to its token."""
    dx = parts[0].new_zeros(shape)
    for r in range(p.world):
        theirs = sorted((j for j, s in enumerate(p.segs) if s.rank == r), key=lambda j: p.segs[j].local)
        for m, (h, srcs) in enumerate(_halo_sources(dataclasses.replace(p, rank=r, mine=theirs), W)):
            for i, (t0, t1), (h0, h1) in srcs:
                s = p.segs[i]
                if s.rank != p.rank:
                    continue
                lo = s.local + (s.end - s.start) - (W - 1)   # local index of tail column 0
                dx[0, :, lo + t0:lo + t1] += parts[r][m, :, W - 1 - h + h0:W - 1 - h + h1]
    return dx


class _Halos(torch.autograd.Function):
    """x [1, D, T_r] -> halos [n_seg, D, W - 1]: the (right-aligned) tokens each local segment
    reads from before its start. Backward sends each halo's gradient back to the tokens' owners."""

    @staticmethod
    def forward(ctx, x, p: ContextParallelPlan, comm: Collective, W: int, sources):
        ctx.p, ctx.comm, ctx.W, ctx.shape = p, comm, W, x.shape
        return _halos_from(comm.all_gather(_tails(x, p, W)), p, W, sources)

    @staticmethod
    def backward(ctx, dhalos):
        parts = ctx.comm.all_gather(_halo_grads_payload(dhalos, ctx.p, ctx.W))
        return _dx_from(parts, ctx.p, ctx.W, ctx.shape), None, None, None, None


def _slots(p: ContextParallelPlan):
    """segment index -> (rank, position among that rank's segments in local order)."""
    out, count = {}, [0] * p.world
    for j in sorted(range(len(p.segs)), key=lambda j: (p.segs[j].rank, p.segs[j].local)):
        r = p.segs[j].rank
        out[j] = (r, count[r])
        count[r] += 1
    return out


def _needs_halos(p: ContextParallelPlan, W: int) -> bool:
    bounds = set(p.cu)
    return W > 1 and any(s.start not in bounds for s in p.segs)


def _conv_local(x, halos, weight, bias, act, p: ContextParallelPlan, sources, W, backend):
    """The unsplit conv on this rank's segments, each after its halo, as one packed call."""
    pieces, cu, keep = [], [0], []
    for m, j in enumerate(p.mine):
        s = p.segs[j]
        h = sources[m][0] if halos is not None else 0
        if halos is not None:
            # even an empty halo (h = 0) stays in the graph: every rank must reach the halo
            # exchange's backward, whose collective the others wait in
            pieces.append(halos[m:m + 1, :, W - 1 - h:])
        pieces.append(x[:, :, s.local:s.local + s.end - s.start])
        # the piece's own offsets: its halo's first token and the global boundaries inside it
        base = s.start - h
        inner = [c - base for c in p.cu if s.start < c < s.end]
        cu += [cu[-1] + c for c in inner] + [cu[-1] + s.end - base]
        keep.append((cu[-2 - len(inner)] + h, cu[-1]))
    if not pieces:   # no tokens here: still in the exchange (an empty halo tensor, see above)
        return x.clone() if halos is None else x.clone() + halos.sum()
    ext = torch.cat(pieces, 2)
    y = _CONV(x.device, backend, ext, weight, bias, act, torch.tensor(cu, dtype=torch.long, device=x.device))
    return torch.cat([y[:, :, a:b] for a, b in keep], 2)


def causal_conv1d_cp(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                     activation: Optional[str] = "silu", *, cu_seqlens, segments, group=None,
                     backend: Optional[str] = None) -> torch.Tensor:
    """Context-parallel :func:`~twinkle_kernels.gdn.causal_conv1d`: this rank's share of the
    unsplit conv's output on the whole packed stream.

    Each segment reads the ``W - 1`` tokens before it that belong to its own sequence (its halo);
    they are held by other ranks, so every rank all-gathers the last ``W - 1`` tokens of each of
    its segments (``[n_seg, D, W - 1]`` in x's dtype; in backward the halos' gradients, the same
    size, go back the same way), then runs the local conv on its segments with their halos.

    Args:
        x: ``[1, D, T_r]``: this rank's tokens, its segments concatenated in listed order
            (float32 / bfloat16 / float16, float64 on the reference).
        weight: ``[D, W]`` (any float dtype).
        bias: ``[D]`` or None.
        activation: None or "silu" ("swish" is an alias).
        cu_seqlens: as :func:`chunk_gated_delta_rule_cp`.
        segments: as :func:`chunk_gated_delta_rule_cp`.
        group: as :func:`chunk_gated_delta_rule_cp`.
        backend: as the unsplit op.

    Returns ``[1, D, T_r]`` in x's dtype, differentiable in x, weight and bias (the weight and bias
    gradients are this rank's share: summed over the group they equal the unsplit op's).
    """
    comm = _collective(group)
    act = _args.causal_conv1d(x, weight, bias, activation, None)
    if x.shape[0] != 1:
        raise ValueError(f"x must hold one packed row (B == 1) of this rank's tokens, got B={x.shape[0]}")
    p = plan(cu_seqlens, segments, comm.rank, comm.world)
    _local_tokens_check("x", x.transpose(1, 2), p)
    W = weight.shape[1]
    sources = _halo_sources(p, W)
    halos = _Halos.apply(x, p, comm, W, sources) if _needs_halos(p, W) else None
    return _conv_local(x, halos, weight, bias, act, p, sources, W, backend)


# -- every rank in one thread -------------------------------------------------------------------------

def lockstep(inputs: Sequence[dict], cotangents: Sequence[dict], *, cu_seqlens, segments,
             scale: Optional[float] = None, use_qk_l2norm_in_kernel: bool = False, conv_activation="silu",
             chunk_size: int = 64, backend: Optional[str] = None) -> List[dict]:
    """Every rank of :func:`chunk_gated_delta_rule_cp` and :func:`causal_conv1d_cp`, forward and
    backward, in one thread: each phase of every rank in turn, the "all-gathers" between phases
    being lists of the ranks' payloads. The same phases and payloads as the ops (not their
    autograd wrappers); for one device, where :func:`simulate`'s threads cannot backpropagate
    CUDA tensors (see there).

    Args:
        inputs: per rank, a dict with the delta rule's ``q, k, v, g, beta`` (``[1, T_r, ...]``) and
            ``initial_state`` (or None), and the conv's ``x [1, D, T_r]``, ``weight``, ``bias`` (the
            conv keys may be absent: no conv).
        cotangents: per rank, ``do [1, T_r, HV, V]``, ``dfinal [n_end, HV, K, V]`` (or None) and, with a
            conv, ``dy [1, D, T_r]``.
        the rest: as :func:`chunk_gated_delta_rule_cp` (final states are always returned).

    Returns per rank a dict: ``o``, ``final_state``, ``dq, dk, dv, dg, dbeta, dinitial_state`` and,
    with a conv, ``y, dx, dweight, dbias`` (this rank's share of the weight and bias gradients).
    """
    world = len(segments)
    plans = [plan(cu_seqlens, segments, r, world) for r in range(world)]
    out: List[dict] = [{} for _ in range(world)]
    ranks = []
    for r, (inp, p) in enumerate(zip(inputs, plans)):
        v = inp["v"]
        sc = _args.gated_delta_rule(inp["q"], inp["k"], v, inp["g"], inp["beta"], scale, None, True,
                                    use_qk_l2norm_in_kernel, None, chunk_size)
        ts = [inp[n].detach().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
        init = inp.get("initial_state")
        init = None if init is None else init.detach().requires_grad_()
        ranks.append(_GDNRank(*ts, init, p, sc, use_qk_l2norm_in_kernel, chunk_size, backend))
    payloads = [st.forward_local() for st in ranks]
    for r, st in enumerate(ranks):
        out[r]["o"], out[r]["final_state"] = st.forward_finish(None if payloads[0] is None else payloads)
    payloads = [st.backward_local(c["do"], c.get("dfinal")) for st, c in zip(ranks, cotangents)]
    for r, st in enumerate(ranks):
        grads = st.backward_finish(None if payloads[0] is None else payloads)
        out[r].update(zip(("dq", "dk", "dv", "dg", "dbeta", "dinitial_state"), grads))
    if "x" not in inputs[0]:
        return out
    W = inputs[0]["weight"].shape[1]
    act = _args.activation(conv_activation)
    sources = [_halo_sources(p, W) for p in plans]
    need = _needs_halos(plans[0], W)
    tails = [_tails(inp["x"], p, W) for inp, p in zip(inputs, plans)] if need else None
    state = []
    for r, (inp, p) in enumerate(zip(inputs, plans)):
        x, w, b = (None if inp.get(n) is None else inp[n].detach().requires_grad_() for n in ("x", "weight", "bias"))
        halos = _halos_from(tails, p, W, sources[r]).requires_grad_() if need else None
        with torch.enable_grad():
            y = _conv_local(x, halos, w, b, act, p, sources[r], W, backend)
        out[r]["y"] = y.detach()
        state.append((x, w, b, halos, y))
    dhalos = []
    for r, ((x, w, b, halos, y), c) in enumerate(zip(state, cotangents)):
        wrt = [t for t in (x, w, b, halos) if t is not None]
        got = dict(zip(map(id, wrt), torch.autograd.grad(y, wrt, c["dy"], allow_unused=True)))
        grads = [None if t is None else got[id(t)] for t in (x, w, b, halos)]
        out[r].update(dx=grads[0], dweight=grads[1], dbias=grads[2])
        dhalos.append(None if halos is None else _halo_grads_payload(grads[3], plans[r], W))
    if need:
        for r, p in enumerate(plans):
            out[r]["dx"] = out[r]["dx"] + _dx_from(dhalos, p, W, inputs[r]["x"].shape)
    return out
