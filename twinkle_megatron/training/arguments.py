"""The loss arguments of a call: what ``forward_backward`` / ``forward_only`` pass as keywords
(``advantages``, ``old_logps``, ``ref_logps``, GKD's teacher, a user loss's own), checked against
what the loss accepts and requires and brought to the user's row layout ([B, S], or [B, S, k] for
top-k arguments), before the schedule runs (:mod:`.losses` checks each value)."""
from __future__ import annotations

from typing import Dict, Optional

import torch

from . import losses as losses_mod


def prepare_arguments(loss, loss_kwargs: dict, labels: torch.Tensor, loss_mask: torch.Tensor,
                      *, strict: bool, vocab_size: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Check ``loss_kwargs`` against what ``loss`` accepts and requires, and bring each to the
    user's [B, S] fp32 layout (see :func:`losses.per_token_argument`), or [B, S, k] for the loss's
    ``topk_arguments`` (:func:`losses.topk_argument`; its ``student_topk`` argument int64 ids,
    checked against ``vocab_size``; one k for all). ``strict``: a missing required argument is an
    error (training); otherwise None is returned (forward_only falls back to cross entropy). An
    argument in the loss's ``unsupported`` raises NotImplementedError."""
    name = getattr(loss, "name", type(loss).__name__)
    for k, why in dict(getattr(loss, "unsupported", None) or {}).items():
        if loss_kwargs.get(k) is not None:
            raise NotImplementedError(f"loss {name!r}: {k}: {why}")
    accepts = tuple(getattr(loss, "accepts", ()))
    unknown = [k for k in loss_kwargs if k not in accepts]
    if unknown:
        raise TypeError(f"loss {name!r} takes no argument(s) {unknown}; it takes {list(accepts)}")
    missing_of = getattr(loss, "missing_arguments", None)      # a loss's own rule (GKD: one teacher of two)
    missing = missing_of(loss_kwargs) if missing_of is not None else [
        k for k in getattr(loss, "required", ()) if loss_kwargs.get(k) is None]
    if missing:
        if strict:
            raise ValueError(f"loss {name!r} needs {missing} (pass them to forward_backward)")
        return None
    wide = tuple(getattr(loss, "topk_arguments", ()) or ())
    ids = getattr(loss, "student_topk", None)
    out = {}
    prepare = getattr(loss, "prepare_argument", None)
    for k, v in loss_kwargs.items():
        if v is None:
            continue
        own = prepare(k, v, labels, loss_mask, vocab_size) if prepare is not None else None
        if own is not None:
            out[k] = own
        elif k in wide:
            out[k] = losses_mod.topk_argument(k, v, labels, loss_mask, integer=k == ids, vocab_size=vocab_size)
        else:
            out[k] = losses_mod.per_token_argument(k, v, labels, loss_mask)
    ks = {k: v.shape[2] for k, v in out.items() if k in wide}
    if len(set(ks.values())) > 1:
        raise ValueError(f"loss {name!r}: the top-k arguments must share k, got {ks}")
    return out
