"""Megatron TP + MoE/EP + CP smoke test on Ascend NPU: a tiny Qwen3-MoE, tensor + expert + context
parallel, 10 steps.

    torchrun --nproc_per_node 8 examples/npu/tp_moe_cp_npu.py --tp-size 2 --cp-size 2 --ep-size 2   # (dp 2)
    bash examples/npu/tp_moe_cp_npu.sh

MoE with TP > 1 runs with sequence parallelism. Asserts the loss is finite and decreasing.
``--device cpu`` runs it under gloo (tests).
"""
from _common import TINY_QWEN3_MOE, parser, train

if __name__ == "__main__":
    args = parser(__doc__, tp_size=2, cp_size=2, ep_size=2).parse_args()
    train(args, TINY_QWEN3_MOE, sequence_parallel=args.tp_size > 1)
