"""transformer_engine.pytorch stand-in: the modules megatron-core's TE wrappers subclass."""

from . import distributed, fp8, ops  # noqa: F401
from .attention import DotProductAttention  # noqa: F401
from .fp8 import fp8_autocast, fp8_model_init  # noqa: F401
from .module import GroupedLinear, LayerNorm, LayerNormLinear, Linear, RMSNorm  # noqa: F401
