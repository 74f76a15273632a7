"""Modules used inside the megatron model (kept free of eager heavy imports)."""
