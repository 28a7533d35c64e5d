"""Checks on the numbers a user gives: finite, in range, of sane size, or one line naming the field.

Every cost, limit and size that reaches a generator from outside (CLI flags, training flags, cost
strings, CSV and text schedule files) goes through here first. The reason is that the generators
trust their inputs: a NaN passes every ``<= 0`` check (NaN compares false) and then loops forever
in the reorder, an infinite cost makes every time equal, and a microbatch index of 10^8 in a
two-row file makes the validator build 10^8 expected actions. Errors are :class:`InputError`
(a ``ValueError``), so the command lines report them as ``error: <field>: ...`` with exit 2.

Pure Python; no import from the rest of the package, so any module may use it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

# A pass time (f, b, w) and a message time (comm), in any unit: the generators compare times with
# an absolute tolerance of 1e-9, so times must stay well above it and sums of millions of them
# must stay exact enough to compare; six decades either side of 1 cover ms, s and us.
EPS = 1e-9  # that tolerance (times, and memory units against caps), for every generator
MIN_COST = 1e-6
MAX_COST = 1e6
# Sizes. One pass takes about 0.5 KB and 50-300 us to generate, validate and simulate (measured
# on 2 cores; V-Half's reorder is the slowest), so 2^23 passes is about 4 GB and up to an hour.
MAX_DEVICES = 1024
MAX_MICROBATCHES = 1 << 16
MAX_CHUNKS = 64
MAX_PASSES = 1 << 23
# Above this many passes, generation takes more than a few seconds: say so (see progress.py).
LARGE_PASSES = 1 << 16


class InputError(ValueError):
    """A user-given number is not finite, out of range or too large; ``str()`` is one line."""


def real(field: str, value, low: float, high: float, *, low_open: bool = False) -> float:
    """``value`` as a float in ``[low, high]`` (``(low, high]`` with ``low_open``), else InputError."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise InputError(f"{field}: {_short(value)} is not a number") from None
    opening = "(" if low_open else "["
    if not math.isfinite(number):
        raise InputError(f"{field}: must be a finite number in {opening}{low:g}, {high:g}]; got {value}")
    if number < low or (low_open and number == low) or number > high:
        raise InputError(f"{field}: must be in {opening}{low:g}, {high:g}]; got {number:g}")
    return number + 0.0  # -0.0 prints as "-0"


def count(field: str, value, low: int, high: int) -> int:
    """``value`` as an int in ``[low, high]``, else InputError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{field}: must be a whole number in [{low}, {high}]; got {_short(value)}")
    if not low <= value <= high:
        raise InputError(f"{field}: must be in [{low}, {high}]; got {value}")
    return value


def _short(value) -> str:
    """``repr(value)``, cut to a length that fits in one error line."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def cost(field: str, value) -> float:
    """A pass time: finite, in [MIN_COST, MAX_COST]."""
    return real(field, value, MIN_COST, MAX_COST)


def comm_cost(field: str, value) -> float:
    """A message time: 0, or finite in [MIN_COST, MAX_COST]."""
    number = real(field, value, 0.0, MAX_COST)
    if 0.0 < number < MIN_COST:
        raise InputError(f"{field}: must be 0 or in [{MIN_COST:g}, {MAX_COST:g}]; got {number:g}")
    return number


@dataclass(frozen=True)
class Size:
    """A schedule's size: devices, microbatches and stages per device, with the flags that set them."""

    devices: int
    microbatches: int
    chunks: int = 2
    devices_flag: str = "--stages"
    microbatches_flag: str = "--microbatches"
    chunks_flag: str = "--chunks"

    @property
    def passes(self) -> int:
        """F, B and W of every stage and microbatch: what generation costs in time and memory."""
        return 3 * self.devices * self.chunks * self.microbatches

    @property
    def large(self) -> bool:
        return self.passes > LARGE_PASSES

    def check(self, max_passes: int | None = None) -> Size:
        """Each size in range and the product of sane size (``max_passes``, default MAX_PASSES)."""
        count(self.devices_flag, self.devices, 1, MAX_DEVICES)
        count(self.microbatches_flag, self.microbatches, 1, MAX_MICROBATCHES)
        count(self.chunks_flag, self.chunks, 1, MAX_CHUNKS)
        limit = MAX_PASSES if max_passes is None else max_passes
        if self.passes > limit:
            raise InputError(
                f"{self.devices_flag} {self.devices} x {self.microbatches_flag} {self.microbatches} x "
                f"{self.chunks} chunks is {self.passes:,} passes, above the {limit:,} this tool builds "
                f"(about 0.5 KB each); use fewer devices or microbatches")
        return self


def check_microbatches_held(actions: Iterable, num_stages: int, num_microbatches: int,
                            source: str = "the file") -> None:
    """Refuse a microbatch count a schedule file cannot hold, before anything is sized by it.

    A complete schedule runs one F per stage and microbatch, so ``num_microbatches`` can be at
    most the number of forwards of each stage in the file. ``actions`` are ``(kind, stage,
    microbatch)`` triples whose kind's ``value`` is ``"F"`` for a forward.
    """
    forwards: Counter = Counter()
    largest = -1
    for action in actions:
        largest = max(largest, action[2])
        if getattr(action[0], "value", action[0]) == "F":
            forwards[action[1]] += 1
    fewest_stage = min(range(num_stages), key=lambda s: forwards[s], default=0)
    held = forwards[fewest_stage]
    if num_microbatches > held:
        told = (f"microbatch index {largest} means {num_microbatches} microbatches"
                if largest + 1 == num_microbatches else f"{num_microbatches} microbatches")
        raise InputError(
            f"{source} holds {held} forward pass(es) of stage {fewest_stage}, so at most {held} microbatch(es); "
            f"{told}, which it cannot complete (fix the indices or give a smaller --microbatches)")
