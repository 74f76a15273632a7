"""twinkle_patches: the patch registry that swaps twinkle_kernels ops into Hugging Face and
Megatron models (import name ``twinkle_patches``; this folder is mapped to it by setup.py).

The registry lands with its own issue; this package holds only its docstring until then.
"""
