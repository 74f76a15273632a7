"""Which ``act_fn`` of a transformers MLP / experts module the fused GLU ops compute, and as which
``activation=`` (:func:`glu_activation`); shared by the patches (``_impls``) and the experts
function registered in transformers (``hf_experts``).
"""
from __future__ import annotations

import torch
from torch import nn


def _is_silu(act) -> bool:
    if act is torch.nn.functional.silu or isinstance(act, nn.SiLU):
        return True
    # transformers.activations.SiLUActivation (ACT2FN["silu"]) is not an nn.SiLU subclass
    return type(act).__name__ == "SiLUActivation"


# transformers.activations classes (ACT2FN names) -> the fused GLU's activation. Exact types only: a
# subclass may compute something else. GELUActivation is "gelu" and "gelu_python" (erf, exact);
# GELUTanh ("gelu_pytorch_tanh", "gelu_python_tanh") and NewGELUActivation ("gelu_new") are the tanh
# approximation with the exact constants. Not served: "gelu_fast" (a truncated sqrt(2/pi)),
# "quick_gelu", the clipped "gelu_10", "gelu_accurate", and every non-GELU activation.
_HF_GLU_ACTS = {"GELUActivation": "gelu", "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh",
                "NewGELUActivation": "gelu_tanh"}
GLU_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def glu_activation(act):
    """``(name, None)`` when the fused GLU ops compute ``act`` (``act_fn`` of an MLP / experts module)
    exactly, ``name`` being their ``activation=`` argument; else ``(None, why)``."""
    if _is_silu(act):
        return "silu", None
    if act is torch.nn.functional.gelu:
        return "gelu", None
    if type(act) is nn.GELU and act.approximate in ("none", "tanh"):
        return ("gelu" if act.approximate == "none" else "gelu_tanh"), None
    name = _HF_GLU_ACTS.get(type(act).__name__)
    if name is not None and type(act).__module__ == "transformers.activations":
        return name, None
    return None, (f"act_fn is {type(act).__name__}, which the fused GLU does not compute "
                  f"(it serves {', '.join(GLU_ACTIVATIONS)})")
