"""What every flag check reads: the parallel :class:`Sizes` derived from the flags, and a check's signature.

Pure argparse (no torch or megatron): shared by ``checks``, ``feature_checks`` and the run's schedule.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from .flags import arg_or


@dataclass(frozen=True)
class Sizes:
    """The parallel sizes the checks need, derived the way Megatron's validate_args derives them."""

    world: int
    tp: int
    pp: int
    cp: int
    dp: int
    num_microbatches: int | None  # None when the batch sizes do not divide (reported separately)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Sizes:
        tp = arg_or(args, "tensor_model_parallel_size", 1)
        pp = arg_or(args, "pipeline_model_parallel_size", 1)
        cp = arg_or(args, "context_parallel_size", 1)
        world = arg_or(args, "world_size", tp * pp * cp)
        dp = max(world // max(tp * pp * cp, 1), 1)
        mbs = arg_or(args, "micro_batch_size", 1)
        gbs = arg_or(args, "global_batch_size", None) or mbs * dp
        m = gbs // (mbs * dp) if gbs % (mbs * dp) == 0 else None
        return cls(world, tp, pp, cp, dp, m)


Check = Callable[[argparse.Namespace, Sizes], "str | None"]


