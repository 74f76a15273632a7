"""How the tokens of one micro-batch are laid out for the model, against its rows.

A micro-batch holds ``mbs`` user rows of ``S`` positions (``S`` padded for SP / CP). The loss,
the returned per-token outputs and the router-replay ids work on those rows, ``[mbs, S, ...]``;
the model sees them in one of four layouts, one class each:

- :class:`Rows`: the rows as they are, ``[mbs, S]``;
- :class:`ContextParallel`: this CP rank's load-balanced share of every row, ``[mbs, S / cp]``
  (chunks r and 2cp - 1 - r, :func:`twinkle_megatron.layers.attention.cp_positions`);
- :class:`Packed`: the rows flattened into one THD row of ``length`` tokens (``mbs * S`` plus
  SP padding), each packed sample a sequence of megatron's ``PackedSeqParams``;
- :class:`PackedContextParallel`: this CP rank's share of that THD row.

Each layout owns the two directions: :meth:`Layout.to_rows` (the model's per-token tensor ->
rows; under CP an all-gather, :class:`GatherContextParallel`) and :meth:`Layout.model_view` (a
per-token argument in rows -> the model's layout), and :meth:`Layout.token_groups`, the group
index of each token the model sees (mixed-adapter calls). Nothing outside this module asks which
kind a layout is.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist


class GatherContextParallel(torch.autograd.Function):
    """x [mbs, S / cp, ...] (this CP rank's positions ``keeps[rank]``) -> [mbs, S, ...] in sequence order.

    Backward hands each rank the gradient of its own positions only (no reduction): every CP rank
    computes the same loss from the same whole rows, and each back-propagates the part that flows
    through its own tokens; the CP all-reduce of parameter grads adds the parts."""

    @staticmethod
    def forward(ctx, x, keeps, rank, group):
        pieces = [torch.empty_like(x) for _ in keeps]
        dist.all_gather(pieces, x.contiguous(), group=group)
        out = x.new_zeros(x.shape[0], sum(len(k) for k in keeps), *x.shape[2:])
        for keep, piece in zip(keeps, pieces):
            out[:, keep] = piece
        ctx.keep = keeps[rank]
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.keep], None, None, None


# fill(shape, dtype, device) -> the padding appended to a flattened THD row (default: zeros)
Fill = Optional[Callable[[tuple, torch.dtype, torch.device], torch.Tensor]]


class Layout:
    """The base: see the module docstring. Subclasses implement the three methods."""

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's per-token tensor [rows_model, S_model, ...] -> the micro-batch's rows
        [mbs, S, ...]."""
        raise NotImplementedError

    def model_view(self, x: torch.Tensor, fill: Fill = None) -> torch.Tensor:
        """A per-token tensor in rows [mbs, S, ...] -> the layout the model sees (this CP rank's
        positions; one THD row, its padding made by ``fill``, zeros by default). The inverse of
        :meth:`to_rows` on the positions the model sees."""
        raise NotImplementedError

    def token_groups(self, row_groups: torch.Tensor) -> torch.Tensor:
        """The group index of the tokens the model sees, from ``row_groups`` [mbs] (one per row):
        ``[1, mbs]`` (every position of a row is its row's) or ``[T, 1]`` for a THD row (-1 on the
        padding after the last sample)."""
        raise NotImplementedError


class Rows(Layout):
    """The model sees the rows as they are."""

    def to_rows(self, x):
        return x

    def model_view(self, x, fill: Fill = None):
        return x

    def token_groups(self, row_groups):
        return row_groups[None, :]


class ContextParallel(Layout):
    """This CP rank (``rank`` of ``group``) sees positions ``keeps[rank]`` of every row."""

    def __init__(self, keeps: List[torch.Tensor], rank: int, group):
        self.keeps, self.rank, self.group = keeps, rank, group

    def to_rows(self, x):
        return GatherContextParallel.apply(x, self.keeps, self.rank, self.group)

    def model_view(self, x, fill: Fill = None):
        return x[:, self.keeps[self.rank]]

    def token_groups(self, row_groups):
        return row_groups[None, :]


def _pad(flat: torch.Tensor, n: int, fill: Fill) -> torch.Tensor:
    shape = (1, n, *flat.shape[2:])
    block = flat.new_zeros(shape) if fill is None else fill(shape, flat.dtype, flat.device)
    return torch.cat([flat, block], 1)


class Packed(Layout):
    """The ``rows`` = (mbs, S) of the micro-batch flattened into one THD row of ``length``
    tokens (the padding after ``mbs * S`` belongs to no sample)."""

    def __init__(self, rows: Tuple[int, int], length: int):
        self.rows, self.length = tuple(rows), int(length)

    def to_rows(self, x):
        mbs, s = self.rows
        rest = x.shape[2:]
        return x.reshape(-1, *rest)[:mbs * s].reshape(mbs, s, *rest)

    def model_view(self, x, fill: Fill = None):
        flat = x.reshape(1, -1, *x.shape[2:])
        return _pad(flat, self.length - flat.shape[1], fill)

    def token_groups(self, row_groups):
        mbs, s = self.rows
        g = torch.cat([row_groups.repeat_interleave(s), row_groups.new_full((self.length - mbs * s,), -1)])
        return g[:, None]


class PackedContextParallel(Packed):
    """The THD row of :class:`Packed`, of which this CP rank sees positions ``keeps[rank]``."""

    def __init__(self, rows: Tuple[int, int], keeps: List[torch.Tensor], rank: int, group):
        super().__init__(rows, sum(len(k) for k in keeps))
        self.keeps, self.rank, self.group = keeps, rank, group

    def to_rows(self, x):
        return super().to_rows(GatherContextParallel.apply(x, self.keeps, self.rank, self.group))

    def model_view(self, x, fill: Fill = None):
        return super().model_view(x, fill)[:, self.keeps[self.rank].to(x.device)]

    def token_groups(self, row_groups):
        return super().token_groups(row_groups)[self.keeps[self.rank]]
