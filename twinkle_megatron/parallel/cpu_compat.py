"""CPU device mode for megatron-core (0.16.1 to 0.19.x): the one place where its CUDA assumptions are handled.

megatron-core is written for CUDA. On a machine without an accelerator (debugging, CI) it runs
correctly on CPU tensors with the gloo backend once these sites are handled (measured on 0.16.1):

1. ``torch.cuda.*`` calls inside megatron modules (``current_device()`` at ~70 sites, ``Stream``,
   ``Event``, ``stream()``, ``current_stream()``, ``synchronize()``, the CUDA RNG functions):
   every loaded ``megatron.core`` module whose global ``torch`` is the real torch gets a proxy whose
   ``torch.cuda`` answers for the CPU (current device = cpu, streams/events are no-ops, the RNG
   functions act on the CPU generator).
2. Literal ``device="cuda"`` allocations (schedules, clip_grads, optimizer, param buffers,
   masks) and ``pin_memory=True`` (rope_utils): the same proxy's tensor factories map a CUDA
   device to the CPU and drop ``pin_memory``.
3. The CUDA RNG tracker (``tensor_parallel/random.py``): its private get/set-state helpers are
   replaced by CPU-generator versions, so ``model_parallel_cuda_manual_seed`` and ``fork()``
   work and stay deterministic.
4. ``Tensor.type() == 'torch.cuda.FloatTensor'`` checks (clip_grads, both optimizers) and
   ``.cuda()`` calls (tied embeddings with PP in ``setup_embeddings_and_output_layer``, the CP
   index in ``get_pos_emb_on_this_cp_rank``): during
   those functions only, ``Tensor.type()`` of a CPU tensor reports the CUDA name and
   ``Tensor.cuda()`` returns the tensor itself.
5. gloo lacks ``reduce_scatter`` and uneven ``all_gather``, and refuses split sizes given as
   tensors in ``all_to_all_single``: the proxy's ``torch.distributed`` (and the module-level
   aliases megatron captured at import, e.g. ``dist_reduce_scatter_func``) emulate them with
   collectives gloo has. ``_coalescing_manager`` issues each collective at once instead of
   deferring it to the block's exit, so those emulations complete before their results are
   read (the distributed optimizer's grad reduce-scatter); the asynchronous all-reduces issued
   inside a block (``overlap_grad_reduce``'s buckets) are waited for by the handle the block
   yields, which megatron's ``finish_grad_sync`` waits on.
6. ``moe_utils.te_general_gemm`` is referenced without TransformerEngine (NameError): set to None.
7. ``dist_checkpointing``'s torch_dist writer collects its write results through a queue served
   by a ``multiprocessing`` Manager it *spawns*; a spawned process re-imports the training
   script's ``__main__`` (and torch: seconds per save). The facade saves synchronously, in the
   training process, so an in-process ``queue.Queue`` serves (the writer still forks its file
   writers, as on GPUs); its ``torch.cuda.synchronize()`` goes through the proxy of 1.
8. ``multi_latent_attention`` imports megatron's TransformerEngine extension, which succeeds
   without TransformerEngine (placeholder classes), and then calls ``isinstance`` with them:
   its ``HAVE_TE`` is set to False when TransformerEngine itself is absent.
9. The grad norm: without TransformerEngine or apex, ``clip_grads`` falls back to megatron's
   ``local_multi_tensor_l2_norm``, which calls ``torch.norm`` per tensor. torch's CPU float32
   L2-norm kernel sums the squares in a single float32 accumulator (pytorch/pytorch#169237,
   #151761; ``sum`` is cascaded, ``norm`` is not), so a large gradient's norm comes out low:
   3.5e-5 relative on a 1-layer, hidden-256 Llama, 9.7e-4 on Llama-3.1-8B's widths (a 16,000 x
   4,096 embedding shard), 4e-2 on a 32,000 x 4,096 tensor of small values with a few large ones.
   ``clip_grads.l2_norm_impl`` is replaced by :func:`_l2_norm`, the same interface summing the
   squares in float64 (``twinkle_kernels.sum_of_squares``).
10. The RNG tracker's ``fork()`` logs ``CPU RNG state changed within GPU RNG context`` when the CPU
    generator moved inside it: on a GPU, a sign that the body drew from a generator the fork does
    not isolate. With 3 the tracked state *is* the CPU generator's, set on entry and restored on
    exit, so a draw inside is isolated as on a GPU (the facade's Gated DeltaNet draws its conv
    and decay parameters there, per tensor-parallel rank) and the message is always a false
    alarm: its logger (``megatron.core.tensor_parallel.random``) drops that one message while
    the mode is applied.
11. Clipping: without TransformerEngine or apex, ``clip_grads`` scales the gradients with
    megatron's ``local_multi_tensor_scale``, which writes ``dst.copy_(src * scale)``: a temporary
    the size of every gradient and a second pass over it (a sixth of a bf16 step's optimizer
    phase on Qwen3-0.6B's widths). ``clip_grads.multi_tensor_scale_impl`` is replaced by
    :func:`_scale`, the same interface scaling in place with ``torch._foreach_mul_`` when source
    and destination are the same tensors (clipping's case): the same products, bit for bit.
12. Gradient accumulation: megatron's DDP backward hook adds each bf16 (or fp16) gradient into its
    fp32 ``main_grad`` with ``main_grad.add_(grad)``. On CPU torch's mixed-dtype add is its slow
    path: on a 2-core Xeon, 1.4 CPU ns per element at 1 M elements and 3.4-3.5 at 50-155 M,
    against 0.4 and 1.1 for the same add done a quarter million elements at a time, each slice
    converted to fp32 first (:func:`_accumulate`; the same sums, bit for bit). The hook is
    wrapped (``DistributedDataParallel._make_backward_post_hook``): the gradient is added first
    by :func:`_accumulate`, and megatron's own hook then runs as after a fused weight-gradient
    GEMM (``grad_added_to_main_grad``), so its bookkeeping (``overlap_grad_reduce``'s bucket
    readiness, ``param.grad = None``) is its own.
13. The word embedding's gradient: ``VocabParallelEmbedding`` calls ``F.embedding``, whose backward
    writes a dense ``[V, H]`` gradient, zeros but for the batch's rows (Qwen3-0.6B: 311 MB in bf16
    for 512 tokens), which DDP's hook then adds whole into the fp32 ``main_grad``; with tied
    embeddings autograd first adds it to the LM head's ``[V, H]`` gradient, a third such tensor.
    On CPU each fresh tensor of that size costs its page faults (the kernel zeroes every page)
    and its unmapping: a bf16 Qwen3-0.6B step allocated 1.2 GB this way. In CPU mode
    ``tensor_parallel.layers.F`` is a proxy whose ``embedding`` adds the rows' gradients straight
    into ``weight.main_grad`` (``index_add_`` in fp32, megatron's fused-wgrad convention) when
    the weight has one, as after DDP wrapping. The weight's own gradient is then None when the
    LM head shares it on this stage (megatron's ``zero_out_wgrad`` mark: the head's gradient
    alone reaches DDP's hook), else megatron's dummy (``torch.empty``, never read) with
    ``grad_added_to_main_grad`` set. The rows are summed in fp32 instead of the weight's dtype
    (repeated tokens are added into ``main_grad`` one by one): the same gradient up to rounding.
14. Gradient accumulation fusion: megatron's linear layers can add their weight gradient straight
    into ``main_grad`` (``gradient_accumulation_fusion``) through apex's
    ``fused_weight_gradient_mlp_cuda``, a CUDA module, so the flag is off on CPU and each weight
    gradient is first written whole in the weight's dtype, then added (item 12). When
    ``tensor_parallel.layers`` has no such module, it is given :class:`_WgradGemmAccum`
    (``twinkle_kernels.wgrad_accum``: the product in row tiles, each added while in cache; the
    same sums). The facade turns the flag on per layer once DDP has given the weights their
    ``main_grad`` (``ddp.fuse_wgrad_accumulation``), with twinkle kernels only.

Items 12-14 are every writer of ``main_grad`` on this path, and each claims a buffer the one-pass
optimizer step left stale before writing it (:mod:`.main_grads`: the first write of a step
overwrites instead of adding); :func:`claims_stale_main_grads` says whether all three are in place.

Not handled here but required (the facade sets them): ``TORCHDYNAMO_DISABLE=1`` in every process
(megatron's jit fuser would compile, ~8 s per process), ``batch_p2p_comm=False`` and
``batch_p2p_sync=False`` (with PP=2 and interleaving, batched p2p over gloo silently swaps
messages), and a norm module of ours in the layer spec (``WrappedTorchNorm`` refuses sequence
parallelism).

``apply()`` is called explicitly by :func:`twinkle_megatron.initialize` on CPU, before any model is
built; nothing happens at import. ``revert()`` (called by ``shutdown``) restores every original
object exactly. ``patched_symbols()`` lists the dotted paths this module depends on on the installed
megatron-core (0.16.1 to 0.19.x; where a name moved between releases, the release's own, from
:mod:`twinkle_megatron.versions`); the canary test asserts each exists.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import queue
import types

import torch
import torch.distributed as _real_dist

import twinkle_kernels as tk
from twinkle_kernels.patching import Patcher
from twinkle_kernels.wgrad import wgrad_accum_reference

from . import main_grads

# Modules imported before patching so that their globals are proxied (megatron imports lazily).
_MODULES = (
    "megatron.core.parallel_state",
    "megatron.core.utils",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.common.embeddings.rope_utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
    "megatron.core.transformer.multi_latent_attention",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.module",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer_param_scheduler",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.torch",
)

# Dotted paths this module replaces or relies on; the canary test checks each one exists.
PATCHED_SYMBOLS = (
    "megatron.core.tensor_parallel.random._get_cuda_rng_state",
    "megatron.core.tensor_parallel.random._set_cuda_rng_state",
    "megatron.core.tensor_parallel.random.model_parallel_cuda_manual_seed",
    "megatron.core.tensor_parallel.mappings.dist_all_gather_func",
    "megatron.core.tensor_parallel.mappings.dist_reduce_scatter_func",
    "megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32",
    "megatron.core.models.common.embeddings.rope_utils.get_pos_emb_on_this_cp_rank",
    "megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params.__init__",
    "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups",
    # reads the module global te_general_gemm, undefined without TransformerEngine:
    "megatron.core.transformer.moe.moe_utils.RouterGatingLinearFunction.forward",
    "megatron.core.models.common.language_module.language_module.LanguageModule.setup_embeddings_and_output_layer",
    "megatron.core.pipeline_parallel.schedules.torch",
    "megatron.core.models.common.embeddings.rope_utils.torch",
    "megatron.core.distributed.param_and_grad_buffer.torch",
    "megatron.core.distributed.param_and_grad_buffer._coalescing_manager",
    "megatron.core.optimizer.clip_grads.l2_norm_impl",
    "megatron.core.utils.local_multi_tensor_l2_norm",
    "megatron.core.optimizer.clip_grads.multi_tensor_scale_impl",
    "megatron.core.utils.local_multi_tensor_scale",
    "megatron.core.distributed.distributed_data_parallel.DistributedDataParallel._make_backward_post_hook",
    "megatron.core.tensor_parallel.layers.F",
)



def patched_symbols() -> tuple:
    """:data:`PATCHED_SYMBOLS` plus the names whose place depends on the installed megatron-core
    (:mod:`twinkle_megatron.versions`): the torch_dist writer's results queue (item 7)."""
    return PATCHED_SYMBOLS + (_queue_symbol(),)


def _queue_symbol() -> str:
    from .. import versions
    return versions.CHANGES["write_results_queue"].names()[0].replace(":", ".")


_CPU = torch.device("cpu")


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _NoOpStream:
    """Stands in for torch.cuda.Stream / Event: CPU work is synchronous."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NoOpStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def wait(self, *args, **kwargs):
        pass

    def elapsed_time(self, other):
        return 0.0

    def __eq__(self, other):
        return isinstance(other, _NoOpStream)

    def __hash__(self):
        return 0


class _CudaOnCpu(types.ModuleType):
    """``torch.cuda`` as seen by megatron in CPU mode. Unlisted names fall through to torch.cuda."""

    def __init__(self):
        super().__init__("torch.cuda")
        self.Stream = _NoOpStream
        self.Event = _NoOpStream
        self.current_device = lambda: _CPU
        self.synchronize = lambda *a, **k: None
        self.current_stream = lambda *a, **k: _NoOpStream()
        self.default_stream = lambda *a, **k: _NoOpStream()
        self.stream = lambda *a, **k: contextlib.nullcontext()
        self.set_stream = lambda *a, **k: None
        self.get_rng_state = lambda *a, **k: torch.get_rng_state()
        self.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
        self.manual_seed = lambda seed: torch.manual_seed(seed)
        self.manual_seed_all = lambda seed: torch.manual_seed(seed)
        self.empty_cache = lambda: None
        self.nvtx = types.SimpleNamespace(range_push=lambda *a, **k: None,
                                          range_pop=lambda *a, **k: None,
                                          range=lambda *a, **k: contextlib.nullcontext())
        self.random = types.SimpleNamespace(get_rng_state=lambda *a, **k: torch.get_rng_state())

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


def _on_cpu(fn):
    def wrapper(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)
    wrapper.__wrapped__ = fn
    return wrapper


_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint",
              "empty_strided", "as_tensor", "zeros_like", "ones_like", "empty_like", "full_like",
              "randn_like", "rand_like", "eye", "linspace")


# ---- gloo emulation of the collectives it lacks --------------------------------------------

class _DoneWork:
    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


def _is_gloo(group) -> bool:
    return _real_dist.get_backend(group) == "gloo"


def _all_gather_into_tensor(output, input, group=None, async_op=False):
    if not _is_gloo(group):
        return _real_dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)
    world = _real_dist.get_world_size(group)
    parts = list(output.view(world, *input.shape).unbind(0)) if input.dim() else list(output.chunk(world))
    bufs = [torch.empty_like(input) for _ in range(world)]
    _real_dist.all_gather(bufs, input.contiguous(), group=group)
    for p, b in zip(parts, bufs):
        p.copy_(b)
    return _DoneWork() if async_op else None


def _reduce_scatter_tensor(output, input, op=_real_dist.ReduceOp.SUM, group=None, async_op=False):
    if not _is_gloo(group):
        return _real_dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)
    world = _real_dist.get_world_size(group)
    rank = _real_dist.get_rank(group)
    full = input.contiguous().clone()
    _real_dist.all_reduce(full, op=op, group=group)
    output.copy_(full.view(world, -1)[rank].view_as(output))
    return _DoneWork() if async_op else None


def _reduce_scatter(output, input_list, op=_real_dist.ReduceOp.SUM, group=None, async_op=False):
    if not _is_gloo(group):
        return _real_dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)
    rank = _real_dist.get_rank(group)
    sizes = [t.numel() for t in input_list]
    full = torch.cat([t.reshape(-1) for t in input_list])
    _real_dist.all_reduce(full, op=op, group=group)
    start = sum(sizes[:rank])
    output.copy_(full[start:start + sizes[rank]].view_as(output))
    return _DoneWork() if async_op else None


def _all_gather(tensor_list, tensor, group=None, async_op=False):
    if not _is_gloo(group) or all(t.shape == tensor.shape for t in tensor_list):
        return _real_dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    # Uneven first dimension: pad to the longest, gather, then trim.
    longest = max(t.shape[0] for t in tensor_list)
    padded = tensor.new_zeros((longest,) + tuple(tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    bufs = [torch.empty_like(padded) for _ in tensor_list]
    _real_dist.all_gather(bufs, padded, group=group)
    for out, buf in zip(tensor_list, bufs):
        out.copy_(buf[: out.shape[0]])
    return _DoneWork() if async_op else None


class _Issued:
    """What megatron's ``_coalescing_manager`` block yields here: ``wait()`` waits for every
    asynchronous collective issued inside the block (megatron drops their handles and waits on
    this object alone, e.g. ``finish_grad_sync`` under ``overlap_grad_reduce``)."""

    def __init__(self):
        self.works = []

    def wait(self, *args, **kwargs):
        works, self.works = self.works, []
        for work in works:
            work.wait()
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self.works)


_open_blocks: list = []   # the _no_coalescing blocks being run, innermost last


@contextlib.contextmanager
def _no_coalescing(*args, async_ops: bool = False, **kwargs):
    # The emulations above run several real collectives and read their results at once; inside
    # torch's _coalescing_manager those would be deferred to its exit (grads came out unreduced).
    # So the collectives run as issued; the asynchronous ones (the bucket all-reduces of
    # overlap_grad_reduce) are recorded by _all_reduce and waited for by the yielded object's
    # wait(). Yielding an object whose wait() returned at once let finish_grad_sync read the
    # grads while gloo was still reducing into them (wrong, timing-dependent grads).
    issued = _Issued()
    _open_blocks.append(issued)
    try:
        yield issued
    finally:
        _open_blocks.remove(issued)
    if not async_ops:
        issued.wait()


def _all_reduce(tensor, op=_real_dist.ReduceOp.SUM, group=None, async_op=False):
    work = _real_dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    if async_op and _open_blocks:
        _open_blocks[-1].works.append(work)
    return work


def _as_list(sizes):
    if isinstance(sizes, torch.Tensor):
        return [int(s) for s in sizes.tolist()]
    return None if sizes is None else [int(s) for s in sizes]


def _all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                       group=None, async_op=False):
    return _real_dist.all_to_all_single(output, input, _as_list(output_split_sizes),
                                        _as_list(input_split_sizes), group=group, async_op=async_op)


_DIST_REPLACEMENTS = {
    "all_reduce": _all_reduce,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "_all_gather_base": _all_gather_into_tensor,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
    "_reduce_scatter_base": _reduce_scatter_tensor,
    "reduce_scatter": _reduce_scatter,
    "all_gather": _all_gather,
    "all_to_all_single": _all_to_all_single,
}


class _DistOnGloo(types.ModuleType):
    def __init__(self):
        super().__init__("torch.distributed")
        for name, fn in _DIST_REPLACEMENTS.items():
            setattr(self, name, fn)

    def __getattr__(self, name):
        return getattr(_real_dist, name)


class _TorchOnCpu(types.ModuleType):
    """``torch`` as seen by megatron modules in CPU mode (see the module docstring)."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CudaOnCpu()
        self.distributed = _DistOnGloo()
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))
        self.autocast = lambda device_type, *a, **k: torch.autocast(
            "cpu" if device_type == "cuda" else device_type, *a, **k)

    def __getattr__(self, name):
        return getattr(torch, name)


# ---- scoped Tensor.type() -----------------------------------------------------------------

_REAL_TENSOR_TYPE = torch.Tensor.type


def _cuda_named_type(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs and self.device.type == "cpu":
        return "torch.cuda." + _REAL_TENSOR_TYPE(self).split(".", 1)[1]
    return _REAL_TENSOR_TYPE(self, dtype, non_blocking, **kwargs)


_REAL_TENSOR_CUDA = torch.Tensor.cuda


def _stay_on_cpu(self, *args, **kwargs):
    return self


def _with_cuda_type_names(fn):
    """Run ``fn`` with ``Tensor.type()`` naming CPU tensors as CUDA ones (megatron's type checks)
    and ``Tensor.cuda()`` leaving them where they are."""
    def wrapper(*args, **kwargs):
        torch.Tensor.type = _cuda_named_type
        torch.Tensor.cuda = _stay_on_cpu
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.type = _REAL_TENSOR_TYPE
            torch.Tensor.cuda = _REAL_TENSOR_CUDA
    wrapper.__wrapped__ = fn
    return wrapper


# ---- apply / revert -------------------------------------------------------------------------

_saved = Patcher()   # every change apply() made, undone by revert()


def is_applied() -> bool:
    return bool(_saved)


def _resolve(path):
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


_PACKAGE = "megatron.core"


def _wrap_everywhere(module, name):
    """Wrap ``module.name`` with :func:`_with_cuda_type_names`, and every alias of it that other
    megatron modules imported by name."""
    original = getattr(module, name)
    _saved.replace_everywhere(original, _with_cuda_type_names(original), name=name, package=_PACKAGE)


def apply() -> None:
    """Enable the CPU device mode. Idempotent; undo with :func:`revert`."""
    if _saved:
        return
    try:
        _apply()
    except BaseException:
        revert()
        raise


def _apply() -> None:
    for name in _MODULES:
        importlib.import_module(name)
    torch_proxy = _TorchOnCpu()
    # every megatron module global, under whatever name, that is one of these objects
    table = [(torch, torch_proxy), (_real_dist, torch_proxy.distributed),
             (_real_dist._coalescing_manager, _no_coalescing)]
    table += [(getattr(_real_dist, n), fn) for n, fn in _DIST_REPLACEMENTS.items()]
    for original, replacement in table:
        _saved.replace_everywhere(original, replacement, package=_PACKAGE)

    from megatron.core.tensor_parallel import random as mrandom
    _saved.setattr(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    _saved.setattr(mrandom, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    rng_log = logging.getLogger(mrandom.__name__)   # item 10: the list is restored by revert()
    _saved.setattr(rng_log, "filters", [*rng_log.filters, _no_cpu_rng_alarm])

    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer
    from megatron.core.models.common.embeddings import rope_utils
    _wrap_everywhere(clip_grads, "clip_grad_by_total_norm_fp32")
    from megatron.core import utils as mutils
    if clip_grads.l2_norm_impl is mutils.local_multi_tensor_l2_norm:   # no TE / apex kernel
        _saved.setattr(clip_grads, "l2_norm_impl", _l2_norm)
    if clip_grads.multi_tensor_scale_impl is mutils.local_multi_tensor_scale:
        _saved.setattr(clip_grads, "multi_tensor_scale_impl", _scale)
    _wrap_everywhere(rope_utils, "get_pos_emb_on_this_cp_rank")   # .cuda() of its CP index
    cls = optimizer.Float16OptimizerWithFloat16Params
    _saved.setattr(cls, "__init__", _with_cuda_type_names(cls.__init__))
    cls = distrib_optimizer.DistributedOptimizer
    build = vars(cls)["_build_model_and_main_param_groups"]
    _saved.setattr(cls, "_build_model_and_main_param_groups", type(build)(_with_cuda_type_names(build.__func__)))

    from megatron.core.tensor_parallel import layers as tp_layers
    if tp_layers.F is not torch.nn.functional:   # a moved import must fail here, not go unpatched
        raise ImportError("megatron.core.tensor_parallel.layers.F is not torch.nn.functional")
    _saved.setattr(tp_layers, "F", _FunctionalOnCpu())
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
    _saved.setattr(DistributedDataParallel, "_make_backward_post_hook",
                   _fast_accumulating(DistributedDataParallel._make_backward_post_hook))

    if not getattr(tp_layers, "_grad_accum_fusion_available", False):   # item 14
        _saved.setattr(tp_layers, "fused_weight_gradient_mlp_cuda", _WgradGemmAccum)

    from megatron.core.models.common.language_module.language_module import LanguageModule
    _saved.setattr(LanguageModule, "setup_embeddings_and_output_layer",
         _with_cuda_type_names(LanguageModule.setup_embeddings_and_output_layer))

    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        _saved.setattr(moe_utils, "te_general_gemm", None)

    from megatron.core.transformer import multi_latent_attention
    if importlib.util.find_spec("transformer_engine") is None and multi_latent_attention.HAVE_TE:
        _saved.setattr(multi_latent_attention, "HAVE_TE", False)

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    queue_name = _queue_symbol().rsplit(".", 1)[1]
    getattr(filesystem_async, queue_name)   # a moved name must fail here, not become a no-op setattr
    _saved.setattr(filesystem_async, queue_name, _write_results_queue)


def _no_cpu_rng_alarm(record: logging.LogRecord) -> bool:
    """Item 10: the RNG tracker's logger keeps every record but the CPU-generator alarm."""
    return not record.getMessage().startswith("CPU RNG state changed within GPU RNG context")


def _l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron's ``multi_tensor_l2norm`` interface (item 9): the L2 norm of all the tensors of
    ``tensor_lists[0]`` together, as a float64 tensor of shape [1], and None (no per-tensor
    norms, as megatron's local fallback). The squares are summed in float64 by
    ``twinkle_kernels.sum_of_squares``: one C++ pass over all the tensors, each element widened
    before it is squared. On a 2-core Xeon, 50 M fp32 elements take 0.20 ns each (0.44 CPU ns)
    against 0.55 (1.1) for float64 copies of 2**20-element slices dotted with themselves, this
    module's earlier way."""
    return tk.sum_of_squares(list(tensor_lists[0])).sqrt().reshape(1), None


def _scale(chunk_size, noop_flag, tensor_lists, scale):
    """megatron's ``multi_tensor_scale`` interface (item 11): ``dst = src * scale`` for each pair
    of ``tensor_lists[0]`` / ``tensor_lists[1]``, in place and without a temporary where a
    destination is its source."""
    srcs, dsts = tensor_lists[0], tensor_lists[1]
    same = [d for s, d in zip(srcs, dsts) if s is d]
    if same:
        torch._foreach_mul_(same, scale)
    for s, d in zip(srcs, dsts):
        if s is not d:
            d.copy_(s * scale)


_ACCUMULATE_CHUNK = 1 << 18   # elements per fp32 slice (1 MB: stays in cache between its two passes)


def _accumulate(main_grad: torch.Tensor, grad: torch.Tensor) -> None:
    """``main_grad += grad`` (item 12) for a contiguous fp32 ``main_grad`` and a bf16 / fp16
    ``grad`` of its shape: slice by slice, each converted to fp32 and added, the same rounding
    as ``main_grad.add_(grad)``. Any other case is that add."""
    if (grad.dtype == main_grad.dtype or not main_grad.is_contiguous() or not grad.is_contiguous()
            or grad.shape != main_grad.shape):
        main_grad.add_(grad)
        return
    for dst, src in zip(main_grad.view(-1).split(_ACCUMULATE_CHUNK),
                        grad.view(-1).split(_ACCUMULATE_CHUNK)):
        dst.add_(src.to(dst.dtype))


def _overwrite(main_grad: torch.Tensor, grad: torch.Tensor) -> None:
    """``main_grad = grad`` over stale contents (:mod:`.main_grads`): the values ``main_grad.add_(grad)``
    gives on zeros."""
    if grad.layout == torch.strided and grad.shape == main_grad.shape:
        main_grad.copy_(grad)
    else:
        main_grad.zero_()
        main_grad.add_(grad)


def _fast_accumulating(make_hook):
    """Wrap ``DistributedDataParallel._make_backward_post_hook`` (item 12): a gradient megatron's
    hook would add into ``main_grad`` is added by :func:`_accumulate` first; the hook then runs
    with ``grad_added_to_main_grad`` set, as after megatron's fused weight-gradient GEMM, and the
    flag is put back."""
    def make(self, param):
        hook = make_hook(self, param)

        def hook_with_fast_add(*unused):
            grad = param.grad
            zero_out = getattr(param, "zero_out_wgrad", False)
            # megatron's hook adds when the grad is not in main_grad yet, or always for a weight
            # marked zero_out_wgrad (an embedding tied to the head on this stage)
            if (grad is None or param not in self.param_to_bucket_group
                    or (param.grad_added_to_main_grad and not zero_out)):
                return hook(*unused)
            if main_grads.claim(param.main_grad):   # the step's first write: over stale contents
                _overwrite(param.main_grad, grad.data)
            elif grad.layout != torch.strided or grad.dtype == param.main_grad.dtype:
                return hook(*unused)
            else:
                _accumulate(param.main_grad, grad.data)
            added = param.grad_added_to_main_grad
            param.grad_added_to_main_grad = True
            if zero_out:
                param.zero_out_wgrad = False
            try:
                return hook(*unused)
            finally:
                param.grad_added_to_main_grad = added
                if zero_out:
                    param.zero_out_wgrad = True
        return hook_with_fast_add
    make.__wrapped__ = make_hook
    make.claims_stale_main_grads = True
    return make


class _WgradGemmAccum:
    """apex's ``fused_weight_gradient_mlp_cuda`` interface on the CPU (item 14): megatron's linear
    layers call it with the layer's input and output gradient as ``[tokens, K]`` / ``[tokens, N]``
    and the weight's ``main_grad`` ``[N, K]``."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor,
                              main_grad: torch.Tensor) -> None:
        """Adds into ``main_grad``, or writes over it when it is stale (:mod:`.main_grads`)."""
        tk.wgrad_accum(total_input.reshape(-1, total_input.shape[-1]),
                       grad_output.reshape(-1, grad_output.shape[-1]), main_grad,
                       accumulate=not main_grads.claim(main_grad))

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor,
                              main_grad: torch.Tensor) -> None:
        """A bf16 / fp16 ``main_grad`` (grads not accumulated in fp32): the product, then the add
        (or the copy over stale contents), as ``wgrad_accum``'s reference does it for any dtype."""
        wgrad_accum_reference(total_input.reshape(-1, total_input.shape[-1]),
                              grad_output.reshape(-1, grad_output.shape[-1]), main_grad,
                              accumulate=not main_grads.claim(main_grad))


class _EmbeddingIntoMainGrad(torch.autograd.Function):
    """``F.embedding(ids, weight)`` (item 13) whose weight gradient is added into ``weight.main_grad``
    (fp32 [V, H]) row by row in the backward. ``weight``'s returned gradient: None for a weight
    marked ``zero_out_wgrad`` (shared with the LM head on this stage, whose gradient carries DDP's
    hook), else megatron's never-read dummy with ``grad_added_to_main_grad`` set."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        ids, = ctx.saved_tensors
        weight = ctx.weight
        main = weight.main_grad
        if main_grads.claim(main):   # the step's first write, over stale contents: rows only
            main.zero_()
        main.index_add_(0, ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).to(main.dtype))
        if getattr(weight, "zero_out_wgrad", False):
            return None, None
        weight.grad_added_to_main_grad = True
        return None, torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)


def _embedding(input, weight, *args, **kwargs):
    """``torch.nn.functional.embedding`` for megatron's ``VocabParallelEmbedding`` in CPU mode (item
    13): through :class:`_EmbeddingIntoMainGrad` when ``weight`` is a trainable parameter with a
    DDP ``main_grad`` under grad mode and no other option is given, else torch's own."""
    if (args or kwargs or not torch.is_grad_enabled() or not weight.requires_grad
            or getattr(weight, "main_grad", None) is None or not hasattr(weight, "grad_added_to_main_grad")
            or weight.main_grad.shape != weight.shape):
        return torch.nn.functional.embedding(input, weight, *args, **kwargs)
    return _EmbeddingIntoMainGrad.apply(input, weight)


class _FunctionalOnCpu(types.ModuleType):
    """``torch.nn.functional`` as seen by ``megatron.core.tensor_parallel.layers`` in CPU mode."""

    def __init__(self):
        super().__init__("torch.nn.functional")
        self.embedding = _embedding

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)


_results = None


def _write_results_queue(mp_mode: str = "spawn"):
    """The torch_dist writer's results queue for synchronous saves (item 7): one in-process
    queue, put to and read from by the training process itself (``mp_mode``: megatron-core 0.17+'s
    argument, the context its Manager would use; no process is started here)."""
    global _results
    if _results is None:
        _results = queue.Queue()
    return _results


def claims_stale_main_grads() -> bool:
    """Whether every writer of DDP's ``main_grad`` on this CPU path claims stale buffers before
    writing (:mod:`.main_grads`): items 12 (DDP's hook), 13 (the word embedding) and 14 (the
    linear layers' fused weight gradient, which the routed experts call too) in place."""
    if not _saved:
        return False
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
    from megatron.core.tensor_parallel import layers as tp_layers
    hook = DistributedDataParallel._make_backward_post_hook
    return (getattr(tp_layers, "fused_weight_gradient_mlp_cuda", None) is _WgradGemmAccum
            and isinstance(tp_layers.F, _FunctionalOnCpu)
            and getattr(hook, "claims_stale_main_grads", False))


def revert() -> None:
    """Restore every object :func:`apply` replaced, in reverse order."""
    _saved.undo()
