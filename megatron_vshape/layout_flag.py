"""Transformer layers per pipeline stage: ``--pipeline-layout uniform|balanced|N0,N1,...``.

A layout is a tuple with one count per *global* stage (2d numbers for a V placement, in stage
order, so device 0 holds entries 0 and 2d-1). ``balanced`` is returned as the string
``"balanced"``: choosing it needs the cost model (``megatron_vshape.planner.balance``), which
this pure module does not import.

Empty stages: the first stage (embedding) and the last stage (final norm, LM head, loss) may hold
no transformer layer, because they still have work of their own. A middle stage with no layer
would be a stage with nothing to run, so it is refused.

Pure Python; no torch import.
"""

from __future__ import annotations

from .schedules.core.inputs import InputError

FLAG = "--pipeline-layout"
BALANCED = "balanced"
UNIFORM = "uniform"


def uniform_layout(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Today's split: the same count on every stage (``num_layers`` must divide evenly)."""
    if num_stages < 1:
        raise InputError(f"{FLAG}: need at least one stage; got {num_stages}")
    if num_layers % num_stages:
        raise InputError(
            f"{FLAG} uniform: --num-layers {num_layers} is not divisible by the {num_stages} pipeline stages; "
            f"use a multiple of {num_stages}, or {FLAG} {BALANCED} or explicit counts N0,...,N{num_stages - 1}")
    return (num_layers // num_stages,) * num_stages


def parse_layout(text: str, num_layers: int, num_stages: int) -> tuple[int, ...] | str:
    """``uniform`` -> today's counts; ``balanced`` -> the string ``"balanced"``; ``N0,N1,...`` -> checked counts.

    Errors are one-line :class:`InputError` messages naming ``--pipeline-layout``.
    """
    choice = text.strip().lower()
    if choice == UNIFORM:
        return uniform_layout(num_layers, num_stages)
    if choice == BALANCED:
        return BALANCED
    return check_layout(_parse_counts(text), num_layers, num_stages)


def _parse_counts(text: str) -> tuple[int, ...]:
    parts = [part.strip() for part in text.split(",")]
    try:
        return tuple(int(part) for part in parts)
    except ValueError:
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise InputError(f"{FLAG}: {shown!r} is not {UNIFORM}, {BALANCED} or comma-separated layer counts "
                         "such as 3,4,4,5") from None


def check_layout(counts, num_layers: int, num_stages: int) -> tuple[int, ...]:
    """``counts`` as a tuple if it is a valid layout of ``num_layers`` over ``num_stages``, else InputError."""
    counts = tuple(counts)
    if len(counts) != num_stages:
        raise InputError(f"{FLAG}: {len(counts)} counts given for {num_stages} pipeline stages "
                         f"(2 x PP for a V schedule, PP x chunks otherwise); give {num_stages} numbers")
    negative = [str(c) for c in counts if c < 0]
    if negative:
        raise InputError(f"{FLAG}: layer counts must be >= 0; got {', '.join(negative)}")
    if sum(counts) != num_layers:
        raise InputError(f"{FLAG}: counts sum to {sum(counts)} but --num-layers is {num_layers}; "
                         f"make them add up to {num_layers}")
    empty = [str(stage) for stage in range(1, num_stages - 1) if counts[stage] == 0]
    if empty:
        raise InputError(f"{FLAG}: stage(s) {', '.join(empty)} would hold no layer; only the first stage "
                         f"(embedding) and the last (LM head and loss) may be empty")
    return counts


def format_layout(counts) -> str:
    """The text form, ``"3,4,4,5"`` (what ``--pipeline-layout`` takes back)."""
    return ",".join(str(c) for c in counts)
