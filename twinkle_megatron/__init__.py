"""twinkle_megatron: a thin facade over megatron-core.

``DeviceMesh`` (the parallel layout), ``initialize`` / ``shutdown`` (torch.distributed + megatron
parallel state; on CPU the documented compatibility layer in ``parallel.cpu_compat``) and
``MegatronModel`` (a GPTModel built from a Hugging Face config, trained with megatron's schedules
and optimizer). Nothing is patched at import time.
"""
from .parallel.mesh import DeviceMesh, current_mesh, get_device_placement, initialize, shutdown
from .options import OverlapOptions, PrecisionConfig, RecomputeConfig
from .model import MegatronModel, MultiLoraMegatronModel, NonFiniteGradientError, TwinkleModel
from .validate import InputMismatchError

__all__ = ["DeviceMesh", "initialize", "shutdown", "current_mesh", "MegatronModel", "MultiLoraMegatronModel",
           "TwinkleModel",
           "NonFiniteGradientError", "InputMismatchError", "PrecisionConfig", "RecomputeConfig", "OverlapOptions",
           "get_device_placement"]
