"""Memory plan: each rank's parameter, gradient, optimizer and activation bytes for a model on a mesh.

``python -m twinkle_megatron.plan --model-id DIR --tp 2 --pp 2 --seq-length 8192 --micro-batch-size 1``
prints, for every pipeline stage (the ranks of one stage hold the same amount), the bytes of

- parameters: counted from the facade's own name tables and sharding rules
  (:mod:`.params`), in the training dtype;
- gradients: megatron's DDP grad buffer (fp32, ``grad_reduce_in_fp32``), for trainable parameters;
- optimizer: Adam's two fp32 moments, plus fp32 main parameters under bf16 / fp16, sharded over
  the data-parallel ranks (times context parallel) with ``--use-distributed-optimizer`` (routed
  experts over the expert-data-parallel ranks);
- activations (:mod:`.activations`): the micro-batches a stage holds at once under megatron's
  1F1B schedule (``min(micro-batches, pp - stage)``) and one layer's backward workspace, without
  recompute and with selective and full recompute;

and whether the largest total fits ``--device-memory`` GB. With ``--lora-rank`` the base weights
are frozen: they have no gradients or optimizer state, the adapters have both.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from .. import config
from . import activations, params

PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
RECOMPUTE = (None, "selective", "full")


@dataclasses.dataclass
class StagePlan:
    """Bytes on one rank of pipeline stage ``stage`` (``activations``: recompute -> bytes)."""
    stage: int
    layers: List[int]
    numel: params.StageParams
    params: int
    grads: int
    optimizer: int
    activations: Dict[Optional[str], int]

    def total(self, recompute: Optional[str] = None) -> int:
        return self.params + self.grads + self.optimizer + self.activations[recompute]


def plan(hf_config: dict, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, dp: int = 1,
         etp: Optional[int] = None, seq_length: int = 4096, micro_batch_size: int = 1,
         num_micro_batches: Optional[int] = None, mixed_precision: str = "bf16",
         use_distributed_optimizer: bool = False, lora_rank: int = 0, sequence_parallel: Optional[bool] = None,
         fused_lm_head: bool = False, recompute_num_layers: int = 1) -> List[StagePlan]:
    """One :class:`StagePlan` per pipeline stage of ``hf_config`` (a config.json dict) on the mesh.

    ``sequence_parallel`` None (default) is decided as ``DeviceMesh.for_model`` decides it: on for a
    mixture-of-experts model with ``tp > 1`` (megatron-core needs it there), else off."""
    if mixed_precision not in PRECISION_BYTES:
        raise ValueError(f"mixed_precision must be one of {sorted(PRECISION_BYTES)}, got {mixed_precision!r}")
    for name, v in dict(tp=tp, pp=pp, cp=cp, ep=ep, dp=dp, seq_length=seq_length,
                        micro_batch_size=micro_batch_size).items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    etp = 1 if etp is None else etp   # DeviceMesh.from_sizes' default
    if ep * etp > dp * cp * tp:
        raise ValueError(f"ep*etp={ep}*{etp} must divide dp*cp*tp={dp}*{cp}*{tp}")
    if seq_length % cp:
        raise ValueError(f"seq_length={seq_length} is not divisible by cp={cp}")
    shape = config.model_shape(hf_config)
    if sequence_parallel is None:
        sequence_parallel = bool(shape.num_experts) and tp > 1
    elif not sequence_parallel and shape.num_experts and tp > 1:
        raise ValueError(f"sequence_parallel=False with tp={tp} on a mixture-of-experts model: megatron-core "
                         "needs sequence parallelism for MoE with tensor parallelism (leave it None)")
    e = PRECISION_BYTES[mixed_precision]
    counts = params.count(shape, params.hf_shapes(hf_config), tp=tp, pp=pp, ep=ep, etp=etp,
                          lora_rank=lora_rank)
    nmb = pp if num_micro_batches is None else num_micro_batches
    expert_dp = dp * cp * tp // (ep * etp)
    out = []
    for c in counts:
        if lora_rank:
            dense_train, expert_train, stored = c.lora, 0, c.base + c.lora
        else:
            dense_train, expert_train, stored = c.dense, c.expert, c.base
        per_param = 8 + (4 if e < 4 else 0)   # Adam moments (+ fp32 main params)
        if use_distributed_optimizer:
            opt = per_param * (dense_train / (dp * cp) + expert_train / expert_dp)
        else:
            opt = per_param * (dense_train + expert_train)
        in_flight = min(nmb, pp - c.stage)
        acts = {r: activations.peak_bytes(
                    shape, c.layers, seq=seq_length, mbs=micro_batch_size, in_flight=in_flight, tp=tp, cp=cp,
                    sp=sequence_parallel,
                    dtype_bytes=e, last_stage=c.stage == pp - 1, fused_lm_head=fused_lm_head, recompute=r,
                    recompute_num_layers=recompute_num_layers)
                for r in RECOMPUTE}
        out.append(StagePlan(c.stage, c.layers, c, params=stored * e, grads=(dense_train + expert_train) * 4,
                             optimizer=int(opt), activations=acts))
    return out


def report(stages: List[StagePlan], device_memory_gb: float) -> str:
    """The plan as a table, one row per stage, in GiB, and whether each recompute setting fits."""
    gib = 2 ** 30
    lines = [f"{'stage':>5} {'layers':>9} {'params':>8} {'grads':>8} {'optim':>8} "
             f"{'act none':>9} {'act sel':>8} {'act full':>9} {'total none':>11} {'sel':>7} {'full':>7}  (GiB per rank)"]
    for s in stages:
        span = f"{s.layers[0]}-{s.layers[-1]}" if s.layers else "-"
        a = s.activations
        lines.append(f"{s.stage:>5} {span:>9} {s.params / gib:8.2f} {s.grads / gib:8.2f} {s.optimizer / gib:8.2f} "
                     f"{a[None] / gib:9.2f} {a['selective'] / gib:8.2f} {a['full'] / gib:9.2f} "
                     f"{s.total(None) / gib:11.2f} {s.total('selective') / gib:7.2f} {s.total('full') / gib:7.2f}")
    for r in RECOMPUTE:
        worst = max(s.total(r) for s in stages)
        verdict = "fits" if worst <= device_memory_gb * gib else "does NOT fit"
        lines.append(f"recompute={r or 'none'}: largest rank {worst / gib:.2f} GiB {verdict} in {device_memory_gb:g} GB")
    return "\n".join(lines)
