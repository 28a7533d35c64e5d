"""megatron-vshape: controllable-memory pipeline schedules (V-Min, V-Half, V-ZB, ...) for megatron-core."""

__version__ = "0.1.0"
