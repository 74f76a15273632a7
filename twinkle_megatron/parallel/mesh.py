"""DeviceMesh (the parallel layout) and the process-wide initialisation of torch.distributed and
megatron-core's parallel state."""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from typing import Optional

import torch
import torch.distributed as dist

from . import cpu_compat

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DeviceMesh:
    """Sizes of each parallel dimension. ``world_size == dp * tp * pp * cp``.

    Experts use their own grid over the same ranks: ``ep * etp`` must divide ``dp * cp * tp``.
    ``etp`` (expert tensor parallel) defaults to 1, as in upstream Twinkle (megatron-core's own
    ``initialize_model_parallel`` would default it to ``tp``): the experts are split over EP only.
    ``vpp`` is the number of virtual pipeline stages per rank (interleaved schedule; needs pp > 1).
    ``sequence_parallel`` only has an effect with ``tp > 1``. None (what :meth:`from_sizes`
    gives when it is not passed and ``tp > 1``) means the model decides, in :meth:`for_model`:
    on for a mixture-of-experts model (megatron-core refuses MoE + TP without it), off otherwise.
    """
    world_size: int
    dp_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    etp_size: int = 1
    vpp_size: int = 1
    sequence_parallel: Optional[bool] = False

    @classmethod
    def from_sizes(cls, dp_size: Optional[int] = None, tp_size: int = 1, pp_size: int = 1,
                   cp_size: int = 1, ep_size: int = 1, world_size: Optional[int] = None,
                   sequence_parallel: Optional[bool] = None, vpp_size: Optional[int] = None,
                   etp_size: Optional[int] = None, *, fsdp_size: Optional[int] = None,
                   device_type: Optional[str] = None) -> "DeviceMesh":
        """Build and validate a mesh.

        The world size is, in this order: ``world_size``; the initialised process group's size;
        ``$WORLD_SIZE``; else ``dp_size * tp_size * pp_size * cp_size`` (``dp_size`` 1 if not
        given), as upstream Twinkle's ``from_sizes``. When ``dp_size`` is given the product must
        equal the world size found (a ValueError names both); when it is not, ``dp_size`` is what
        the world size leaves over.

        ``etp_size`` defaults to 1. ``sequence_parallel``: None (default) lets the model decide
        (on for MoE with ``tp_size > 1``, see :meth:`for_model`); False with MoE and
        ``tp_size > 1`` is refused when the model is built.

        Upstream Twinkle's spellings: ``device_type`` ('cuda', 'npu' or 'cpu') names the device
        this process trains on; :func:`initialize` picks it (and its backend: nccl, hccl, gloo)
        from what the process sees, so a ``device_type`` that disagrees is a ValueError rather
        than a run on another device. ``fsdp_size`` of None or 1 is accepted; a larger one is a
        ValueError: megatron has no FSDP-sized mesh dimension (upstream's Megatron backend fails
        its own data-parallel check with it too); data-parallel ranks are ``dp_size``, and
        megatron's distributed optimizer shards the optimizer state over them.
        """
        for name, value in (("tp_size", tp_size), ("pp_size", pp_size), ("cp_size", cp_size),
                            ("ep_size", ep_size), ("dp_size", dp_size), ("world_size", world_size),
                            ("vpp_size", vpp_size), ("etp_size", etp_size), ("fsdp_size", fsdp_size)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if sequence_parallel is not None and not isinstance(sequence_parallel, bool):
            raise TypeError(f"sequence_parallel must be True, False or None, got {sequence_parallel!r}")
        if fsdp_size is not None and fsdp_size > 1:
            raise ValueError(
                f"fsdp_size={fsdp_size} is not supported under megatron: FSDP2 sharding is upstream "
                "Twinkle's transformers backend (its Megatron backend refuses it in its own mesh "
                "check too). Give the data-parallel ranks as dp_size (dp_size*fsdp_size); megatron's "
                "distributed optimizer (use_distributed_optimizer) shards the optimizer state over them")
        if device_type is not None:
            _check_device_type(device_type)
        model_parallel = tp_size * pp_size * cp_size
        source = "world_size"
        if world_size is None:
            if dist.is_available() and dist.is_initialized():
                world_size, source = dist.get_world_size(), "torch.distributed's world_size"
            elif os.environ.get("WORLD_SIZE"):
                raw, source = os.environ["WORLD_SIZE"], "$WORLD_SIZE"
                if not raw.isdigit() or int(raw) < 1:
                    raise ValueError(f"$WORLD_SIZE must be a positive int, got {raw!r}")
                world_size = int(raw)
            else:   # no launcher: the sizes say it (upstream's from_sizes: dp_size defaults to 1)
                world_size = (dp_size or 1) * model_parallel
        if dp_size is None:
            if world_size % model_parallel:
                raise ValueError(
                    f"{source}={world_size} is not divisible by tp_size*pp_size*cp_size="
                    f"{tp_size}*{pp_size}*{cp_size}={model_parallel}")
            dp_size = world_size // model_parallel
        if dp_size * model_parallel != world_size:
            raise ValueError(
                f"dp_size*tp_size*pp_size*cp_size={dp_size}*{tp_size}*{pp_size}*{cp_size}="
                f"{dp_size * model_parallel} does not equal {source}={world_size}")
        etp_size = 1 if etp_size is None else etp_size
        if (dp_size * cp_size * tp_size) % (ep_size * etp_size):
            raise ValueError(
                f"ep_size*etp_size={ep_size}*{etp_size} must divide dp_size*cp_size*tp_size="
                f"{dp_size}*{cp_size}*{tp_size}: expert parallelism lives within DP x CP (x TP)")
        vpp_size = 1 if vpp_size is None else vpp_size
        if vpp_size > 1 and pp_size == 1:
            raise ValueError(f"vpp_size={vpp_size} needs pp_size > 1 (got pp_size={pp_size})")
        sp = False if tp_size == 1 else sequence_parallel
        return cls(world_size=world_size, dp_size=dp_size, tp_size=tp_size, pp_size=pp_size,
                   cp_size=cp_size, ep_size=ep_size, etp_size=etp_size, vpp_size=vpp_size,
                   sequence_parallel=sp)

    def check_model(self, *, num_attention_heads: int, num_key_value_heads: int, num_layers: int,
                    num_experts: Optional[int] = None) -> None:
        """Raise ValueError if the model's shape cannot be split over this mesh."""
        if num_attention_heads % self.tp_size:
            raise ValueError(f"num_attention_heads={num_attention_heads} is not divisible by "
                             f"tp_size={self.tp_size}")
        if num_key_value_heads % self.tp_size:
            raise ValueError(f"num_key_value_heads={num_key_value_heads} is not divisible by "
                             f"tp_size={self.tp_size}")
        stages = self.pp_size * self.vpp_size
        if num_layers % stages:
            raise ValueError(f"num_layers={num_layers} is not divisible by pp_size*vpp_size="
                             f"{self.pp_size}*{self.vpp_size}={stages}")
        if self.ep_size > 1 and not num_experts:
            raise ValueError(f"ep_size={self.ep_size} needs a mixture-of-experts model")
        if num_experts and self.tp_size > 1 and self.sequence_parallel is False:
            raise ValueError(f"sequence_parallel=False: a mixture-of-experts model with tp_size={self.tp_size} "
                             "needs sequence parallelism (megatron-core refuses MoE + TP without it): "
                             "pass sequence_parallel=True, or leave it out and it is switched on")
        if num_experts and num_experts % self.ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={self.ep_size}")

    def for_model(self, *, num_experts: Optional[int] = None) -> "DeviceMesh":
        """This mesh with ``sequence_parallel`` decided for a model with ``num_experts`` experts
        (None or 0: dense): an undecided (None) one becomes True for MoE with ``tp_size > 1`` (as
        upstream Twinkle and megatron-core require; logged once per process), else False. A
        decided one is returned as is."""
        if self.sequence_parallel is not None:
            return self
        moe = bool(num_experts) and self.tp_size > 1
        if moe and not _logged["sp_on"]:
            _logged["sp_on"] = True
            logger.info("sequence_parallel switched on: a mixture-of-experts model with tp_size=%d "
                        "needs it (megatron-core refuses MoE + TP without it)", self.tp_size)
        return dataclasses.replace(self, sequence_parallel=moe)

    # upstream Twinkle's data-split interface, which its DataLoader(device_mesh=...) reads
    @property
    def data_world_size(self) -> int:
        """The number of ranks the data is split over: ``dp_size`` (upstream's name)."""
        return self.dp_size

    @property
    def data_rank(self) -> int:
        """This process's data-parallel rank (upstream's name), megatron-core's once
        :func:`initialize` has run (a RuntimeError before: the rank's place in the mesh is not known)."""
        from megatron.core import parallel_state as ps
        if _state["mesh"] is None or not ps.model_parallel_is_initialized():
            raise RuntimeError("DeviceMesh.data_rank: call twinkle_megatron.initialize(mesh) first")
        sizes = lambda m: (m.world_size, m.dp_size, m.tp_size, m.pp_size, m.cp_size)  # noqa: E731
        if sizes(_state["mesh"]) != sizes(self):
            raise RuntimeError(f"DeviceMesh.data_rank: this mesh ({self}) is not the one initialized "
                               f"({_state['mesh']})")
        return ps.get_data_parallel_rank()

    def get_slice(self, total_length: int, rank: Optional[int] = None) -> slice:
        """Upstream's split of ``total_length`` samples over the data-parallel ranks: contiguous
        shares, the first ``total_length % dp_size`` ranks one longer; ``rank`` None: this one's."""
        if self.dp_size == 1:
            return slice(0, total_length)
        rank = self.data_rank if rank is None else rank
        k, m = divmod(total_length, self.dp_size)
        return slice(rank * k + min(rank, m), (rank + 1) * k + min(rank + 1, m))

    def same_groups(self, other: Optional["DeviceMesh"]) -> bool:
        """Whether ``other`` makes the same process groups (every size equal; sequence
        parallelism creates no group)."""
        return other is not None and dataclasses.replace(self, sequence_parallel=None) == \
            dataclasses.replace(other, sequence_parallel=None)


_logged = {"sp_on": False}


def _accelerator() -> str:
    if torch.cuda.is_available():
        return "cuda"
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return "npu"
    return "cpu"


def _check_device_type(requested) -> None:
    """``device_type`` (upstream Twinkle's spelling) must name the device this process trains on."""
    if requested not in ("cuda", "npu", "cpu"):
        raise ValueError(f"device_type must be 'cuda', 'npu' or 'cpu', got {requested!r}")
    found = _accelerator()
    if requested != found:
        hint = (" (hide the GPUs with CUDA_VISIBLE_DEVICES= to train on the CPU)" if requested == "cpu"
                else "")
        raise ValueError(f"device_type={requested!r} but this process sees {found!r}: initialize() "
                         f"trains on the device the process sees{hint}")


def device_type() -> str:
    """'cuda', 'npu' or 'cpu': the accelerator this process trains on."""
    return _accelerator()


_state = {"mesh": None, "owns_group": False, "dynamo_disable": None, "dynamo_env": None, "group": None,
          "timeout_s": None}


def current_mesh() -> Optional[DeviceMesh]:
    return _state["mesh"]


def facade_group():
    """The all-ranks group the facade's own collectives use (checkpoint barriers, input
    agreement): created by :func:`initialize` with its ``timeout_s``, so they are bounded even when
    the caller created the default group with a longer timeout. None before ``initialize``."""
    return _state["group"]


def timeout_s() -> Optional[float]:
    """The ``timeout_s`` given to :func:`initialize` (None before it)."""
    return _state["timeout_s"]


def initialize(mesh: Optional[DeviceMesh] = None, backend: Optional[str] = None, *, seed: int = 42,
               timeout_s: float = 600.0, **upstream_kwargs) -> None:
    """Set up torch.distributed (gloo on CPU, nccl on CUDA, hccl on NPU) and megatron-core's
    parallel state and model-parallel RNG for ``mesh``. On CPU this enables
    :mod:`twinkle_megatron.parallel.cpu_compat` (reverted by :func:`shutdown`). On NPU it first applies
    MindSpeed's megatron adaptor when MindSpeed is installed (else logs why not).

    ``timeout_s`` bounds every collective: the default group (when this call creates it),
    every megatron-core group (TP, PP, DP, CP, EP, ... and their gloo twins) and the facade's own
    group. A rank that stops answering (stalled, or on a dead host) makes the others raise after
    about ``timeout_s`` instead of waiting for megatron's 30-minute default; a rank that dies on
    this host is noticed at once (its sockets close). When the caller created the default group,
    that group keeps the caller's timeout (gloo cannot change it afterwards); the facade never uses
    it, but megatron-core 0.16.1 does for one direction of a 2-stage pipeline's p2p
    (``torch.distributed.group.WORLD`` in ``p2p_communication._p2p_ops``): with ``pp_size == 2``,
    let this call create the group, or give ``init_process_group`` the same timeout.

    Upstream Twinkle's ``initialize(mode='local', global_device_mesh=mesh)`` is accepted too
    (:func:`upstream_mesh`): ``global_device_mesh`` is ``mesh``, and
    with neither given the mesh is data parallel over the launcher's world size, as upstream's. Called
    with those keywords, it also gives twinkle-kit's infrastructure the mesh when twinkle-kit is
    installed (:func:`tell_upstream`), so upstream's DataLoader splits batches over the DP ranks."""
    upstream_call = bool(upstream_kwargs)
    mesh = upstream_mesh(mesh, upstream_kwargs)
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if not dist.is_initialized() and mesh.world_size > 1 and "RANK" not in os.environ \
            and "WORLD_SIZE" not in os.environ:
        # init_process_group would wait for ranks that were never started
        raise ValueError(f"mesh.world_size={mesh.world_size} needs {mesh.world_size} processes, but this "
                         "one was not started by a launcher (no RANK / WORLD_SIZE): run it with "
                         f"torchrun --nproc-per-node {mesh.world_size}")
    dev = device_type()
    if dev == "npu":  # MindSpeed patches megatron-core: before megatron is used or models are built
        from .mindspeed import apply_mindspeed_adaptor
        apply_mindspeed_adaptor()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    backend = backend or {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}[dev]
    if dev == "cpu":
        # megatron's jit_fuser is torch.compile: on CPU it only costs compile time per process.
        # (imported under another name: a function-local `import torch._dynamo` would make `torch`
        # local to initialize and break torch.cuda / torch.npu below with UnboundLocalError)
        import torch._dynamo as dynamo
        _state["dynamo_disable"] = dynamo.config.disable
        # torch.compile also reads the variable on every call (and child processes inherit it)
        _state["dynamo_env"] = os.environ.get("TORCHDYNAMO_DISABLE", "")
        dynamo.config.disable = True
        os.environ["TORCHDYNAMO_DISABLE"] = "1"
        cpu_compat.apply()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", str(mesh.world_size))
        if dev == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        elif dev == "npu":
            torch.npu.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
        _state["owns_group"] = True
    if dist.get_world_size() != mesh.world_size:
        raise ValueError(f"mesh.world_size={mesh.world_size} but torch.distributed has "
                         f"world_size={dist.get_world_size()}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=mesh.tp_size,
        pipeline_model_parallel_size=mesh.pp_size,
        virtual_pipeline_model_parallel_size=mesh.vpp_size if mesh.vpp_size > 1 else None,
        context_parallel_size=mesh.cp_size,
        expert_model_parallel_size=mesh.ep_size,
        expert_tensor_parallel_size=mesh.etp_size,
        # megatron builds timedelta(minutes=...) from this, so a fraction of a minute is honoured
        # (gloo applies it to every send/recv wait; nccl through its watchdog).
        distributed_timeout_minutes=timeout_s / 60.0,
    )
    timeout = datetime.timedelta(seconds=timeout_s)
    if _state["group"] is not None:
        dist.destroy_process_group(_state["group"])
    _state["group"] = dist.new_group(ranks=list(range(dist.get_world_size())), timeout=timeout)
    _state["timeout_s"] = float(timeout_s)
    mrandom.model_parallel_cuda_manual_seed(seed)
    _state["mesh"] = mesh
    if upstream_call:
        tell_upstream(mesh)


def tell_upstream(mesh: DeviceMesh) -> None:
    """An upstream script's ``initialize(mode=..., global_device_mesh=...)`` also gives upstream
    Twinkle's infrastructure the mesh, when twinkle-kit is installed, as upstream's own
    ``initialize`` does: its ``DataLoader`` then hands each data-parallel rank its share of the
    batch (through :attr:`DeviceMesh.data_rank` / :meth:`DeviceMesh.get_slice`) instead of the
    whole batch to every rank. Upstream's seeding is left out (``seed=None``): the RNG stays as
    this package set it."""
    try:
        from twinkle import infra   # twinkle-kit; absent, there is nothing to tell
    except ImportError:
        return
    infra.initialize(mode="local", global_device_mesh=mesh, seed=None)


# upstream Twinkle's initialize keywords other than mode / global_device_mesh / seed: refused, with
# what to do instead (an upstream script passes them with mode='ray', itself refused first)
UPSTREAM_INITIALIZE_KEYWORDS = {
    "nproc_per_node": "Ray's processes per node; start one process per rank with torchrun --nproc-per-node",
    "ncpu_proc_per_node": "Ray's CPU workers; start one process per rank with torchrun",
    "groups": "Ray's device groups; give every rank the mesh (global_device_mesh=) under torchrun",
    "lazy_collect": "Ray's result collection; every rank returns its own results here",
    "remote_group": "Ray's actor groups; build each object on every rank under torchrun",
    "full_determinism": "call torch.use_deterministic_algorithms(True) yourself",
    "name": "the run's name; nothing is named here",
    "notifier": "upstream's failure notifications; none are sent here",
}


def upstream_mesh(mesh: Optional[DeviceMesh], kwargs: dict) -> DeviceMesh:
    """The mesh of ``initialize(mesh, **kwargs)`` with upstream Twinkle's keywords:
    ``global_device_mesh`` is ``mesh`` (both given: a TypeError naming both); ``mode='local'`` is
    what torchrun gives (``'ray'`` is refused with what to do instead); any other keyword is a
    TypeError (upstream's other ``initialize`` keywords, :data:`UPSTREAM_INITIALIZE_KEYWORDS`, each
    named with what to do instead). With no mesh, upstream's default: data parallel over the launcher's world size
    (``DeviceMesh.from_sizes()``)."""
    kwargs = dict(kwargs)
    if kwargs.get("global_device_mesh") is not None:
        if mesh is not None:
            raise TypeError("initialize: give mesh or global_device_mesh (upstream's spelling), not both")
        mesh = kwargs["global_device_mesh"]
    kwargs.pop("global_device_mesh", None)
    mode = kwargs.pop("mode", "local")
    if mode != "local":
        raise TypeError(f"initialize(mode={mode!r}): upstream Twinkle's Ray mode has no counterpart here: start "
                        "one process per rank with torchrun (or twinkle_megatron.parallel.launch); that is "
                        "mode='local'")
    if kwargs:
        known = [f"{k}: {UPSTREAM_INITIALIZE_KEYWORDS[k]}" for k in sorted(kwargs) if k in UPSTREAM_INITIALIZE_KEYWORDS]
        raise TypeError(f"initialize: unexpected keyword argument(s) {sorted(kwargs)}"
                        + ("; upstream Twinkle's, with no meaning here: " + "; ".join(known) if known else ""))
    if mesh is None:
        return DeviceMesh.from_sizes()
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"initialize: mesh must be a twinkle_megatron.DeviceMesh, got {type(mesh).__name__}")
    return mesh


def get_device_placement(device_group=None) -> str:
    """Upstream's ``get_device_placement()``: a printable summary of the layout, here the mesh given
    to :func:`twinkle_megatron.initialize` and this rank's place in it (upstream draws its Ray
    device groups; a ``device_group`` argument is refused, as those groups do not exist here)."""
    if device_group is not None:
        raise TypeError("get_device_placement(device_group=...): upstream's Ray device groups do not exist "
                        "here; the layout is the mesh given to twinkle_megatron.initialize")
    mesh = current_mesh()
    if mesh is None:
        return "No device mesh: call twinkle_megatron.initialize first."
    from megatron.core import parallel_state as ps
    sizes = ", ".join(f"{k}={getattr(mesh, k + '_size')}" for k in ("dp", "tp", "pp", "cp", "ep", "etp"))
    here = (f"rank {dist.get_rank()}: dp {ps.get_data_parallel_rank()}, "
            f"tp {ps.get_tensor_model_parallel_rank()}, pp {ps.get_pipeline_model_parallel_rank()}, "
            f"cp {ps.get_context_parallel_rank()}")
    return f"DeviceMesh(world_size={mesh.world_size}, {sizes}); {here}"


def shutdown() -> None:
    """Undo :func:`initialize`: megatron parallel state, the process group if we created it,
    and the CPU device mode."""
    from megatron.core import parallel_state
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if _state["group"] is not None and dist.is_initialized():
        dist.destroy_process_group(_state["group"])
    _state["group"], _state["timeout_s"] = None, None
    if _state["owns_group"] and dist.is_initialized():
        dist.destroy_process_group()
        _state["owns_group"] = False
    cpu_compat.revert()
    if _state["dynamo_disable"] is not None:
        import torch._dynamo as dynamo
        dynamo.config.disable = _state["dynamo_disable"]
        _state["dynamo_disable"] = None
        if _state["dynamo_env"]:
            os.environ["TORCHDYNAMO_DISABLE"] = _state["dynamo_env"]
        else:
            os.environ.pop("TORCHDYNAMO_DISABLE", None)
        _state["dynamo_env"] = None
    _state["mesh"] = None
