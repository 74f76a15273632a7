"""Megatron TP/PP smoke test on Ascend NPU: a tiny Qwen3, tensor + pipeline parallel, 10 steps.

    torchrun --nproc_per_node 8 examples/npu/tp_npu.py --tp-size 2 --pp-size 2     # (dp 2)
    bash examples/npu/tp_npu.sh

Asserts the loss is finite and decreasing. ``--device cpu`` runs it under gloo (tests).
"""
from _common import TINY_QWEN3, parser, train

if __name__ == "__main__":
    train(parser(__doc__, tp_size=2, pp_size=2).parse_args(), TINY_QWEN3)
