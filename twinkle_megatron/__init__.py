"""twinkle_megatron: a thin facade over megatron-core (DeviceMesh, initialize, MegatronModel).

The facade lands with its own issue; this package holds only its docstring until then.
"""
