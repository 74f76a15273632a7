"""Modules used inside megatron-core models (no heavy imports here: import the submodules)."""
