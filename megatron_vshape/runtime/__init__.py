"""torch + megatron-core: how a schedule runs on real ranks (executor, p2p, placement, memory)."""

from .executor import ScheduleExecutor, build_forward_backward_func
from .memory import ActivationMeter
from .placement import ChunkSpec, build_model_chunks, chunk_specs

__all__ = ["ActivationMeter", "ChunkSpec", "ScheduleExecutor", "build_forward_backward_func",
           "build_model_chunks", "chunk_specs"]
