"""FP8 recipes: carried as plain settings (no scaling is computed)."""

import enum
from dataclasses import dataclass


class Format(enum.Enum):
    E4M3 = "e4m3"
    HYBRID = "hybrid"


@dataclass
class DelayedScaling:
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    override_linear_precision: tuple = (False, False, False)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    interval: int = 1
    reduce_amax: bool = True


@dataclass
class Float8CurrentScaling:
    fp8_format: Format = Format.HYBRID


@dataclass
class MXFP8BlockScaling:
    fp8_format: Format = Format.E4M3


@dataclass
class Float8BlockScaling:
    fp8_format: Format = Format.E4M3
