"""MindSpeed's Megatron adaptor, applied on NPU before megatron models are built.

MindSpeed documents ``import mindspeed.megatron_adaptor`` (after ``import torch_npu``, before
megatron is used) as the entry that patches megatron-core for Ascend (fused kernels, hccl
specifics). :func:`twinkle_megatron.initialize` calls :func:`apply_mindspeed_adaptor` on NPU
only; elsewhere, and when MindSpeed is not installed, it is skipped with a logged reason.
Nothing here has run on Ascend hardware.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import Optional

logger = logging.getLogger("twinkle_kernels")
ADAPTOR = "mindspeed.megatron_adaptor"


def mindspeed_reason() -> Optional[str]:
    """None when MindSpeed's adaptor can be imported, else why not."""
    if importlib.util.find_spec("mindspeed") is None:
        return "MindSpeed is not installed"
    return None


def apply_mindspeed_adaptor() -> Optional[str]:
    """Import MindSpeed's megatron adaptor (idempotent: Python imports a module once).

    Returns None when applied, else the reason it was skipped (also logged).
    """
    why = mindspeed_reason()
    if why is not None:
        logger.info("twinkle: MindSpeed adaptor skipped: %s", why)
        return why
    importlib.import_module(ADAPTOR)
    logger.info("twinkle: applied %s", ADAPTOR)
    return None
