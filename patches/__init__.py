"""twinkle_patches: swap twinkle_kernels ops into Hugging Face transformers models, and back.

    import twinkle_patches as tp
    report = tp.apply(model)            # or tp.apply() before building models
    print(report)                       # what was swapped (impl, backend) and what was skipped, and why
    tp.revert(report)                   # originals back, identical objects
    with tp.patched(model, ops=("rms_norm",)): ...
    tp.list_patches()                   # the registry
    tp.family_swaps()                   # per family: which targets swap on the installed transformers
    with tp.record_routing(model) as rec: model(ids)   # MoE routing [B, S, L_moe, k]: rec.routed_experts
    with tp.replay_routing(model, R): model(ids)       # ... and replayed (twinkle_patches.router_replay)

Importing this package patches nothing and reads no environment variable; see
:func:`twinkle_patches.apply` for the toggles read when it runs. The import name ``twinkle_patches``
maps to the folder ``patches/`` (setup.py; tests/conftest.py for a plain checkout).
"""
from ._apply import apply, family_swaps, list_patches, patched, revert
from ._report import PatchReport, Skipped, Swapped
from ._specs import FAMILIES, OPS, PatchSpec
from .router_replay import RoutingSession, record_routing, replay_routing

__all__ = ["apply", "revert", "patched", "list_patches", "family_swaps", "PatchReport", "PatchSpec", "Swapped", "Skipped",
           "FAMILIES", "OPS", "record_routing", "replay_routing", "RoutingSession"]
