"""Megatron TP + MoE/EP smoke test on Ascend NPU: a tiny Qwen3-MoE, tensor + expert parallel, 10 steps.

    torchrun --nproc_per_node 8 examples/npu/tp_moe_npu.py --tp-size 2 --ep-size 2   # (dp 4)
    bash examples/npu/tp_moe_npu.sh

MoE with TP > 1 runs with sequence parallelism (megatron-core requires it). Asserts the loss is
finite and decreasing. ``--device cpu`` runs it under gloo (tests).
"""
from _common import TINY_QWEN3_MOE, parser, train

if __name__ == "__main__":
    args = parser(__doc__, tp_size=2, ep_size=2).parse_args()
    train(args, TINY_QWEN3_MOE, sequence_parallel=args.tp_size > 1)
