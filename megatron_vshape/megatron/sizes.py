"""What every flag check reads: the derived parallel :class:`Sizes` and the requested schedule.

Pure argparse (no torch or megatron): shared by ``checks`` and ``feature_checks``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from ..schedules.generators.registry import fuses_backward
from .arguments import MEGATRON_OWN_SCHEDULES


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


def arg_or(args: argparse.Namespace, name: str, default):
    """``args.name``, or ``default`` when it is missing or None (flags Megatron has not parsed yet)."""
    value = getattr(args, name, None)
    return default if value is None else value


Check = Callable[[argparse.Namespace, Sizes], "str | None"]


def schedule_of(args) -> str | None:
    """The --pipeline-schedule given (None: Megatron's default schedule)."""
    return getattr(args, "pipeline_schedule", None)


def splits_backward(name: str | None) -> bool:
    """Whether schedule ``name`` runs B and W apart (megatron-vshape's zb-* and v-* schedules)."""
    if name is None or name in MEGATRON_OWN_SCHEDULES:
        return False
    return not fuses_backward(name)

