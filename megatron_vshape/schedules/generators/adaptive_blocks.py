"""The building-block family of ``v-auto``: gap patterns along the four legs of the V.

Each pattern gives the start slots of one microbatch's F and B passes; the joins at the three
turns of the V are chosen so the block is collision-free modulo the interval (6 slots). W passes
go into the free slots after their B, as in ``blocks.fill_w``. V-Min and V-Half are members of
this family and come first under their own names (see ``candidate_blocks``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from ..core.actions import Kind
from ..core.inputs import EPS as _EPS
from ..core.schedule import Costs, Schedule
from .block import BuildingBlock
from .block_schedule import schedule_from_block
from .v_schedules import V_INTERVAL, v_block, v_half, v_half_block, v_min, v_min_block

NAME = "v-auto"
_GAPS = (1, 2, 3)  # slots between consecutive devices along a leg: 1 = V-Min-like, 3 = loose
_SWITCH_STEPS = ((1, 0, 1, 0), (-1, 0, -1, 0), (0, 1, 0, 1), (0, -1, 0, -1))


@dataclass(frozen=True)
class GapPattern:
    """Where one microbatch's F and B passes start, as gaps along the four legs of the V.

    Each leg holds ``d - 1`` gaps; entry ``j`` is the distance between devices ``j`` and
    ``j + 1``. ``joins`` are the idle slots at the three turns: F chunk 0 -> F chunk 1 on the
    last device, F chunk 1 -> B chunk 1 on device 0 (the loss), B chunk 1 -> B chunk 0 on the
    last device.
    """

    f0: tuple[int, ...]
    f1: tuple[int, ...]
    b1: tuple[int, ...]
    b0: tuple[int, ...]
    joins: tuple[int, int, int] = (0, 0, 0)

    def starts(self) -> list[tuple[int, int, int, int]]:
        """Per device: start slots of [F chunk 0, F chunk 1, B chunk 1, B chunk 0]."""
        d = len(self.f0) + 1
        f0 = list(itertools.accumulate(self.f0, initial=0))
        f1 = _descending(f0[-1] + 1 + self.joins[0], self.f1)
        b1 = list(itertools.accumulate(self.b1, initial=f1[0] + 1 + self.joins[1]))
        b0 = _descending(b1[-1] + 1 + self.joins[2], self.b0)
        return [(f0[i], f1[i], b1[i], b0[i]) for i in range(d)]

    def label(self) -> str:
        legs = "/".join(_compress(leg) for leg in (self.f0, self.f1, self.b1, self.b0))
        return f"gaps {legs} joins {','.join(map(str, self.joins))}"


def _descending(last: int, gaps: tuple[int, ...]) -> list[int]:
    """Starts along a leg that runs from the last device back to device 0."""
    out = [last]
    for gap in reversed(gaps):
        out.append(out[-1] + gap)
    return out[::-1]


def _compress(leg: tuple[int, ...]) -> str:
    """'2' for a uniform leg, '1x3+2x4' for three gaps of 1 then four of 2."""
    runs = [(g, len(list(group))) for g, group in itertools.groupby(leg)]
    return str(runs[0][0]) if len(runs) == 1 else "+".join(f"{g}x{n}" for g, n in runs)


def _leg_patterns(num_devices: int):
    """Gap sequences per leg: uniform, and switching by one slot at one device boundary.

    A switch moves the two legs of one direction together (F chunk 0 with B chunk 1, which run
    from device 0 outwards, or F chunk 1 with B chunk 0): that shifts the lifespans of the
    devices past the boundary, which is what trades memory for bubble between the uniform levels.
    """
    n = num_devices - 1
    for gaps in itertools.product(_GAPS, repeat=4):
        yield tuple((g,) * n for g in gaps)
    for gaps, step, k in itertools.product(itertools.product(_GAPS, repeat=4), _SWITCH_STEPS, range(1, n)):
        other = tuple(g + s for g, s in zip(gaps, step))
        if all(g in _GAPS for g in other):
            yield tuple((g,) * k + (h,) * (n - k) for g, h in zip(gaps, other))


def _collision_free_joins(legs: tuple[tuple[int, ...], ...]):
    """Joins that make every device's four F/B residues (mod the interval) distinct.

    Decided turn by turn: the first join fixes F chunk 1, the second B chunk 1, the third B chunk 0,
    so a bad prefix is dropped before trying the later turns.
    """
    interval = V_INTERVAL
    base = GapPattern(*legs).starts()
    # Offsets of each pass relative to the pattern with all joins 0: F1 moves by j1, B1 by j1+j2, ...
    for j1 in range(interval):
        r1 = [(f0 % interval, (f1 + j1) % interval) for f0, f1, _, _ in base]
        if any(x == y for x, y in r1):
            continue
        for j2 in range(interval):
            r2 = [(b1 + j1 + j2) % interval for _, _, b1, _ in base]
            if any(r in pair for r, pair in zip(r2, r1)):
                continue
            for j3 in range(interval):
                r3 = [(b0 + j1 + j2 + j3) % interval for _, _, _, b0 in base]
                if any(r in pair or r == rb for r, pair, rb in zip(r3, r1, r2)):
                    continue
                yield (j1, j2, j3)


def _order_key(block: BuildingBlock) -> tuple:
    """Two blocks with equal keys repeat into identical programs (same order on every device)."""
    interval = block.interval
    key = []
    for stages in block.placement.stages_per_device:
        starts = [block.offsets[(kind, s)] for s in stages for kind in Kind]
        ref = min(starts)
        residues = sorted((x - ref) % interval for x in starts)
        key.append(tuple(((x - ref) // interval, residues.index((x - ref) % interval)) for x in starts))
    return tuple(key)


@dataclass(frozen=True)
class BlockCandidate:
    """A building block, repeated, squeezed and reordered under the costs."""

    label: str
    block: BuildingBlock
    bound: float  # steady peak of the block, memory units, worst device (uniform memory)
    # V-Min and V-Half are built by their generators (their block, or a faster schedule of no higher peak:
    # v_schedules), so that v-auto is never worse than either at its memory.
    generator: Callable[[int, int, Costs], Schedule] | None = None

    def memory_bound(self, costs: Costs | None = None) -> float:
        """The block's steady peak, each stage weighted by its memory under ``costs``."""
        if costs is None or costs.uniform:
            return self.bound
        return max(self.block.steady_peak(costs))

    def build(self, num_microbatches: int, costs: Costs) -> Schedule:
        if self.generator is not None:
            return self.generator(self.block.placement.num_devices, num_microbatches, costs)
        return schedule_from_block(self.block, num_microbatches, costs, NAME)


@lru_cache(maxsize=32)
def candidate_blocks(num_devices: int) -> tuple[BlockCandidate, ...]:
    """Distinct collision-free blocks whose steady peak fits 1F1B's memory.

    V-Min and V-Half come first (under their own names), then the enumerated family. Blocks
    that repeat into the same programs are kept once (the peak, too, follows from the order).
    """
    blocks = list(_named_blocks(num_devices))
    seen = {_order_key(c.block) for c in blocks}
    for legs in _leg_patterns(num_devices):
        for joins in _collision_free_joins(legs):
            pattern = GapPattern(*legs, joins)
            block = v_block(pattern.starts())
            key = _order_key(block)
            if key in seen:
                continue
            seen.add(key)
            candidate = _with_bound(pattern.label(), block)
            if candidate.bound <= num_devices + _EPS:  # more than 1F1B's memory never fits a limit <= 1
                blocks.append(candidate)
    return tuple(blocks)


def _named_blocks(num_devices: int) -> tuple[BlockCandidate, BlockCandidate]:
    """V-Min and V-Half, without enumerating the family (minutes at d=64)."""
    return (_with_bound("v-min", v_min_block(num_devices), v_min),
            _with_bound("v-half", v_half_block(num_devices), v_half))


def _with_bound(label: str, block: BuildingBlock, generator=None) -> BlockCandidate:
    return BlockCandidate(label, block, max(block.steady_peak()), generator)
