"""Glue to megatron-core / megatron.training (CPU mode, argument and install hooks)."""
