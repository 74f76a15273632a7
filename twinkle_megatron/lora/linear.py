"""LoRA on megatron-core's own ColumnParallelLinear / RowParallelLinear.

:class:`LoraAdapter` is attached to a base linear as its child ``lora.<adapter name>`` and runs
from a forward hook on it (:func:`attach`): the base module, its parameters and their names stay
as they are, so the weight conversion, DDP and every caller of the base layer see no difference.
One adapter per Hugging Face target lives inside a fused projection (``linear_qkv`` holds q, k, v;
``linear_fc1`` holds gate and up; the Gated DeltaNet ``in_proj`` holds in_proj_qkv, z, b, a):
each target's ``B`` keeps only the output rows this TP rank owns, and a fixed index puts them
where megatron's layout has them.

Shapes (per TP rank, ``r`` the rank of the adapter, ``T`` the number of targets of the layer):

- column-parallel: ``lora_A[t]`` ``[r, in]`` replicated, ``lora_B[t]`` ``[rows_t, r]`` sharded over
  the output. ``h = x @ A^T`` is computed where the input is (the sequence shard under sequence
  parallelism, then all-gathered: ``r`` channels instead of ``in``); without sequence parallelism
  ``h``'s gradient is all-reduced over TP (so A's gradient is complete on every rank).
- row-parallel: ``lora_A[t]`` ``[r, in / tp]`` sharded over the input; its partial sums ``h`` are
  all-reduced over TP (reduce-scattered over the sequence under sequence parallelism), as the base
  layer's output is; ``lora_B[t]`` ``[out, r]`` replicated.

Routed experts (``expert=True``, one adapter per local expert's ``linear_fc1`` / ``linear_fc2``):
megatron's expert linears do no TP communication of their own (the token dispatcher gathers the
tokens over the expert-TP group before them and sums the partial outputs after them), so the
adapter does none in the forward either. Its replicated factor (column A, row B) sees only this
rank's share of the gradient, which is summed over the expert-TP ``group`` in the backward
(megatron's ``copy_to_tensor_model_parallel_region`` on the factor); its other gradients are what
the base layer's are. Expert parameters carry ``allreduce=False`` (megatron's mark for
expert-parallel parameters: DDP reduces them over the expert-data-parallel group, the optimizer
keeps them with the experts).

Parameters that see only a sequence shard under sequence parallelism (column A, row B) carry
``sequence_parallel=True``, so megatron's grad finalisation sums their gradients over TP (as it
does for norm weights). Sharded parameters carry megatron's ``tensor_model_parallel`` attributes,
so its grad-norm counts each element once; so do all of an expert adapter's factors when
expert-TP is 1 (as megatron's expert weights: no other TP rank holds them).
"""
from __future__ import annotations

import functools
import math
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F


class LoraTarget:
    """One Hugging Face target inside a base linear.

    ``name``: the HF module suffix (``q_proj``); ``full_name``: its HF module path; ``rows``:
    column-parallel only, for every TP rank the HF output rows (LongTensor) that rank's layout
    holds, in megatron's order of this target's rows; ``positions``: this rank's output positions
    of those rows; ``cols``: row-parallel only, for every TP rank the HF input columns it holds.
    ``out_features`` / ``in_features``: the HF (unsharded) shape of the target's weight.
    """

    def __init__(self, name: str, full_name: str, in_features: int, out_features: int, *,
                 rows: Optional[List[torch.Tensor]] = None, positions: Optional[torch.Tensor] = None,
                 cols: Optional[List[torch.Tensor]] = None):
        self.name, self.full_name = name, full_name
        self.in_features, self.out_features = in_features, out_features
        self.rows, self.positions, self.cols = rows, positions, cols


def init_full(target: LoraTarget, r: int, init_lora_weights: bool, seed: int):
    """The full ``(A [r, in], B [out, r])`` of ``target`` in fp32, from a CPU generator seeded by
    ``seed`` and the target's HF name (the same whatever the layout).

    ``init_lora_weights=True`` is peft's default: A kaiming-uniform (a=sqrt(5), as ``nn.Linear``),
    B zero. ``False`` leaves both as ``nn.Linear`` initialises them (uniform +-1/sqrt(fan_in)),
    which is what peft does for False."""
    import zlib
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(target.full_name.encode())) % (2 ** 63))
    bound_a = 1.0 / math.sqrt(target.in_features)
    a = torch.empty(r, target.in_features).uniform_(-bound_a, bound_a, generator=g)
    if init_lora_weights:
        b = torch.zeros(target.out_features, r)
    else:
        b = torch.empty(target.out_features, r).uniform_(-1.0 / math.sqrt(r), 1.0 / math.sqrt(r), generator=g)
    return a, b


def init_expert_full(full_name: str, num_experts: int, r: int, in_features: int, out_features: int,
                     init_lora_weights: bool, seed: int):
    """peft's fused ``(A [r * E, in], B [out, r * E])`` of one routed-expert parameter
    (``...mlp.experts.gate_up_proj``), fp32, seeded like :func:`init_full` (layout-independent).
    ``False``: both as ``nn.Linear`` initialises peft's ``lora_A`` / ``lora_B`` (fan-in ``in`` and
    ``r * E``). Expert ``e``'s factors are :func:`expert_factors`."""
    import zlib
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(full_name.encode())) % (2 ** 63))
    bound_a = 1.0 / math.sqrt(in_features)
    a = torch.empty(r * num_experts, in_features).uniform_(-bound_a, bound_a, generator=g)
    if init_lora_weights:
        b = torch.zeros(out_features, r * num_experts)
    else:
        bound_b = 1.0 / math.sqrt(r * num_experts)
        b = torch.empty(out_features, r * num_experts).uniform_(-bound_b, bound_b, generator=g)
    return a, b


def expert_factors(a: torch.Tensor, b: torch.Tensor, expert: int, num_experts: int):
    """Expert ``expert``'s ``(A_e [r, in], B_e [out, r])`` inside peft's fused factors: peft reads
    A as ``[E, r, in]`` (rows ``e*r .. e*r+r-1``) and B as ``[out, r, E]`` (columns ``e, e+E, ...``),
    and adds ``scaling * B_e @ A_e`` to expert ``e``'s ``[out, in]`` weight."""
    r = a.shape[0] // num_experts
    return a[expert * r:(expert + 1) * r], b[:, expert::num_experts]


def fuse_experts(factors: List[tuple]):
    """Inverse of :func:`expert_factors` over all experts: ``[(A_e, B_e)] -> (A, B)``."""
    a = torch.cat([f[0] for f in factors], 0)
    b = torch.stack([f[1] for f in factors], 2).reshape(factors[0][1].shape[0], -1)
    return a, b


def _mark(param: torch.nn.Parameter, *, partition_dim: Optional[int], sequence_parallel: bool,
          expert: bool = False):
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
    set_tensor_model_parallel_attributes(param, partition_dim is not None,
                                         partition_dim if partition_dim is not None else -1, 1)
    if sequence_parallel:
        param.sequence_parallel = True
    if expert:
        param.allreduce = False


class LoraAdapter(torch.nn.Module):
    """The LoRA delta of one base linear: ``out + scaling * B(A(dropout(x)))`` per target, in the
    base layer's TP layout.

    ``kind``: "column" or "row"; ``targets``: :class:`LoraTarget` list (row-parallel: exactly one);
    ``full``: ``{name: (A, B)}`` full fp32 matrices from :func:`init_full`; ``out_local``: the base
    layer's local output size (column); ``tp_rank`` / ``tp_size`` / ``sequence_parallel``: the
    base layer's (for ``expert=True``: its expert-TP rank / size, and ``group`` the expert-TP
    group; sequence parallelism does not apply). Parameters ``lora_A.<name>`` / ``lora_B.<name>`` in ``dtype`` on ``device``.
    """

    def __init__(self, kind: str, targets: Sequence[LoraTarget], full: Dict[str, tuple], *,
                 r: int, scaling: float, dropout: float, out_local: int, tp_rank: int, tp_size: int,
                 sequence_parallel: bool, dtype: torch.dtype, device, expert: bool = False, group=None):
        super().__init__()
        if expert and sequence_parallel:
            raise ValueError("expert adapters see whole token sets: sequence_parallel must be False")
        if expert and tp_size > 1 and group is None:
            raise ValueError("an expert adapter over expert-TP > 1 needs the expert-TP group")
        if expert and len(targets) != 1:
            raise ValueError(f"an expert linear carries one target, got {[t.name for t in targets]}")
        self.expert, self.group = expert, group
        if kind not in ("column", "row"):
            raise ValueError(f"kind must be 'column' or 'row', got {kind!r}")
        if kind == "row" and len(targets) != 1:
            raise ValueError(f"a row-parallel layer carries one target, got {[t.name for t in targets]}")
        self.kind, self.targets, self.r, self.scaling = kind, list(targets), r, scaling
        self.tp_rank, self.tp_size, self.sequence_parallel = tp_rank, tp_size, sequence_parallel
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self.lora_A = torch.nn.ParameterDict()
        self.lora_B = torch.nn.ParameterDict()
        sp = sequence_parallel and tp_size > 1
        for t in self.targets:
            a, b = full[t.name]
            if kind == "column":
                a_local, b_local = a, b[t.rows[tp_rank]]
            else:
                a_local, b_local = a[:, t.cols[tp_rank]], b
            pa = torch.nn.Parameter(a_local.to(device=device, dtype=dtype).contiguous())
            pb = torch.nn.Parameter(b_local.to(device=device, dtype=dtype).contiguous())
            # over expert-TP 1 an expert's factors are this rank's alone, and marked so as megatron
            # marks its expert-TP-1 expert weights: its grad-norm filter reads the attention-TP
            # rank, and with TP > 1 and expert-TP 1 every TP rank holds other experts
            own = expert and tp_size == 1
            if kind == "column":
                _mark(pa, partition_dim=1 if own else None, sequence_parallel=sp, expert=expert)
                _mark(pb, partition_dim=0, sequence_parallel=False, expert=expert)
            else:
                _mark(pa, partition_dim=1, sequence_parallel=False, expert=expert)
                _mark(pb, partition_dim=0 if own else None, sequence_parallel=sp, expert=expert)
            self.lora_A[t.name], self.lora_B[t.name] = pa, pb
        # column, several targets (or rows out of order): every target's B is put into one
        # [out_local, T * r] matrix, zero outside its own rows and rank columns, so that the
        # delta is one matmul whatever the layout (fewer ops: at small sizes their count is the
        # cost). _rows: for each row of cat(B_t), its row in that matrix seen as [out_local * T, r]
        # (position * T + t): one int64 per output row (an index per element would cost twice
        # the adapter's B in int64). Plain attributes (not buffers): no part of the state dict.
        self.out_local = out_local
        self.enabled = True    # whether the forward hook adds this delta (lora.tenants switches it)
        self._rows = None
        if kind == "column":
            t0 = self.targets[0]
            identity = len(self.targets) == 1 and torch.equal(t0.positions, torch.arange(out_local))
            if not identity:
                n = len(self.targets)
                self._rows = torch.cat([t.positions * n + i for i, t in enumerate(self.targets)]).to(device)

    def factors(self):
        """``(A [R, in_local], B [out_local, R])``, ``R = T * r``: this rank's factors of all targets
        as one LoRA pair (column with several targets: each target's ``B`` put into its own
        rows and rank columns of one zero matrix)."""
        names = [t.name for t in self.targets]
        a = torch.cat([self.lora_A[n] for n in names], 0) if len(names) > 1 else self.lora_A[names[0]]
        if self.kind == "row" or self._rows is None:
            return a, self.lora_B[names[0]]
        values = torch.cat([self.lora_B[n] for n in names], 0)
        b = values.new_zeros(self.out_local * len(names), self.r).index_add(0, self._rows, values)
        return a, b.view(self.out_local, len(names) * self.r)

    def sharded_input(self) -> bool:
        """Whether each TP rank sees a different part of the input (dropout masks then differ)."""
        return (self.sequence_parallel or self.kind == "row") and self.tp_size > 1

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's contribution to the base layer's output, before ``scaling``, for its
        input ``x`` (``[S, B, in]``, or the base layer's sequence shard / input shard)."""
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        if isinstance(self.dropout, torch.nn.Dropout) and self.training and self.sharded_input():
            with get_cuda_rng_tracker().fork():   # a different mask per TP shard
                xd = self.dropout(x)
        else:
            xd = self.dropout(x)
        if self.expert:
            names = [t.name for t in self.targets]
            a = torch.cat([self.lora_A[n] for n in names], 0) if len(names) > 1 else self.lora_A[names[0]]
            return self._expert_delta(xd, a, names)
        a, b = self.factors()
        return F.linear(self.communicate(F.linear(xd.to(a.dtype), a)), b)

    def communicate(self, h: torch.Tensor) -> torch.Tensor:
        """The base layer's TP communication applied to ``h = x @ A^T`` (``[S(/tp), B, R]``):
        column: all-gathered from the sequence shard (SP) or copied into the TP region; row: the
        partial sums reduce-scattered (SP) or all-reduced."""
        from megatron.core import tensor_parallel as tpl
        if self.tp_size == 1:
            return h
        if self.kind == "column":
            return (tpl.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True)
                    if self.sequence_parallel else tpl.copy_to_tensor_model_parallel_region(h))
        return (tpl.reduce_scatter_to_sequence_parallel_region(h) if self.sequence_parallel
                else tpl.reduce_from_tensor_model_parallel_region(h))

    def _expert_delta(self, x, a, names):
        """No communication forward; the replicated factor's gradient summed over expert-TP."""
        b = self.lora_B[names[0]]
        if self.tp_size > 1:   # identity forward, the gradient all-reduced over expert-TP
            from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region as summed
            if self.kind == "column":
                a = summed(a, group=self.group)
            else:
                b = summed(b, group=self.group)
        return F.linear(F.linear(x.to(a.dtype), a), b)


def stacked_factors(modules: Sequence["LoraAdapter"]) -> Optional["StackedFactors"]:
    """For adapters of one base linear that share one layout (kind, targets, rank, row positions):
    their :class:`StackedFactors`, or None when the layouts differ (then each adapter's factors are
    built and padded apart)."""
    first = modules[0]
    names = [t.name for t in first.targets]

    def same(m):
        if (m.kind, [t.name for t in m.targets], m.r, m.out_local) != (first.kind, names, first.r, first.out_local):
            return False
        if (m._rows is None) != (first._rows is None):
            return False
        return m._rows is None or m._rows is first._rows or torch.equal(m._rows, first._rows)
    return StackedFactors(modules) if all(same(m) for m in modules[1:]) else None


class StackedFactors:
    """All :meth:`LoraAdapter.factors` of adapters sharing one layout, stacked at once: calling it
    gives ``(w_a [G, in_local, R], w_b [G, R, out_local])`` (``R = T * r``), transposed views of one
    concatenation each, every ``B`` placed in its rows by one ``index_add`` for all adapters.
    :meth:`grads` maps the stacks' gradients straight back to the parameters (views and one
    gather: no autograd graph of the stacking is built)."""

    def __init__(self, modules: Sequence["LoraAdapter"]):
        first = modules[0]
        names = [t.name for t in first.targets]
        self.g, self.t, self.r, self.out_local = len(modules), len(names), first.r, first.out_local
        self.width = self.t * self.r
        self.a_params = [m.lora_A[n] for m in modules for n in names]
        self.b_params = [m.lora_B[n] for m in modules for n in names]
        self.rows = None
        if first._rows is not None:   # adapter k's rows of the stacked [G * out_local * T, r] matrix
            step = self.out_local * self.t
            self.rows = torch.cat([first._rows + k * step for k in range(self.g)])

    def __call__(self):
        w_a = torch.cat(self.a_params, 0).view(self.g, self.width, -1).transpose(1, 2)
        if self.rows is None:
            return w_a, torch.stack(self.b_params).transpose(1, 2)
        values = torch.cat(self.b_params, 0)
        b = values.new_zeros(self.g * self.out_local * self.t, self.r).index_add(0, self.rows, values)
        return w_a, b.view(self.g, self.out_local, self.width).transpose(1, 2)

    def grads(self, dw_a: Optional[torch.Tensor], dw_b: Optional[torch.Tensor]):
        """``[(parameter, its gradient)]`` from the gradients of the stacks (None: that side has none)."""
        out = []
        if dw_a is not None:
            da = dw_a.transpose(1, 2).reshape(self.g * self.width, -1)
            out += zip(self.a_params, da.split(self.r, 0))
        if dw_b is not None:
            db = dw_b.transpose(1, 2)   # [G, out_local, R]
            if self.rows is None:
                out += zip(self.b_params, db.unbind(0))
            else:
                rows = db.reshape(self.g * self.out_local * self.t, self.r).index_select(0, self.rows)
                out += zip(self.b_params, rows.split([b.shape[0] for b in self.b_params], 0))
        return out


def _hook(name: str, module, args, kwargs, output):
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    adapter = module.lora[name]
    if not adapter.enabled:    # time-shared: another adapter (or none) runs this call
        return None
    return torch.add(out, adapter.delta(x).to(out.dtype), alpha=adapter.scaling), bias


def attach(base: torch.nn.Module, name: str, adapter: LoraAdapter):
    """Make ``adapter`` the child ``lora.<name>`` of ``base`` (a megatron Column/RowParallelLinear;
    ``lora`` a ``ModuleDict`` of its adapters by name) and add its delta to every output of
    ``base``. Returns the hook handle (``.remove()`` detaches the computation; the child stays
    until deleted)."""
    if getattr(base, "gather_output", False):
        raise ValueError(f"{type(base).__name__} with gather_output=True is not supported by LoRA")
    slots = base._modules.get("lora")
    if slots is None:
        slots = base.lora = torch.nn.ModuleDict()
    if name in slots:
        raise ValueError(f"{type(base).__name__} already carries LoRA adapter {name!r}")
    slots[name] = adapter
    return base.register_forward_hook(functools.partial(_hook, name), with_kwargs=True)


def gather_full(adapter: LoraAdapter, group, grads: bool = False) -> Dict[str, tuple]:
    """``{target full_name: (A [r, in], B [out, r])}``: the adapter's full fp32 CPU matrices
    (collective over the TP ``group``); ``grads=True``: their gradients (megatron's ``main_grad``
    where DDP keeps it, else ``.grad``) instead."""
    import torch.distributed as dist

    def value(p):
        if grads:
            p = getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad
        return p.detach().float()
    out = {}
    for t in adapter.targets:
        a, b = value(adapter.lora_A[t.name]), value(adapter.lora_B[t.name])
        sharded = b if adapter.kind == "column" else a
        if adapter.tp_size > 1:
            parts = [torch.empty_like(sharded) for _ in range(adapter.tp_size)]
            dist.all_gather(parts, sharded.contiguous(), group=group)
        else:
            parts = [sharded]
        if adapter.kind == "column":
            full_b = torch.zeros(t.out_features, adapter.r)
            for rank, part in enumerate(parts):
                full_b[t.rows[rank]] = part.cpu()
            out[t.full_name] = (a.cpu(), full_b)
        else:
            full_a = torch.zeros(adapter.r, t.in_features)
            for rank, part in enumerate(parts):
                full_a[:, t.cols[rank]] = part.cpu()
            out[t.full_name] = (full_a, b.cpu())
    return out


@torch.no_grad()
def load_full(adapter: LoraAdapter, full: Dict[str, tuple]) -> None:
    """Copy this rank's shards of the full ``{full_name: (A, B)}`` matrices into ``adapter``."""
    for t in adapter.targets:
        if t.full_name not in full:
            raise KeyError(f"the adapter checkpoint has no weights for {t.full_name!r}")
        a, b = full[t.full_name]
        if tuple(a.shape) != (adapter.r, t.in_features) or tuple(b.shape) != (t.out_features, adapter.r):
            raise ValueError(f"{t.full_name}: checkpoint gives A {tuple(a.shape)}, B {tuple(b.shape)}; "
                             f"this adapter has A ({adapter.r}, {t.in_features}), B ({t.out_features}, {adapter.r})")
        if adapter.kind == "column":
            a_local, b_local = a, b[t.rows[adapter.tp_rank]]
        else:
            a_local, b_local = a[:, t.cols[adapter.tp_rank]], b
        adapter.lora_A[t.name].copy_(a_local)
        adapter.lora_B[t.name].copy_(b_local)
