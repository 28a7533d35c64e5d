from .base import TransformerEngineBaseModule  # noqa: F401
from .grouped_linear import GroupedLinear  # noqa: F401
from .layernorm import LayerNorm, RMSNorm  # noqa: F401
from .layernorm_linear import LayerNormLinear  # noqa: F401
from .linear import Linear  # noqa: F401
