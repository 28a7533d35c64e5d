"""From a building block to a schedule: repeat -> reorder the warm-up/cool-down -> squeeze.

The block (``block.BuildingBlock``) is repeated every interval; the warm-up and cool-down are
reordered (passes move into earlier idle slots while no device's peak passes the block's largest:
``slot_reorder``, or real-time idle filling: ``reorder.fill_idle``); the simulator then runs each
device's order as soon as possible (the squeeze).

Writing a new schedule is a matter of writing offsets; see the README.
"""

from __future__ import annotations

import math

from ..core.inputs import EPS
from ..core.schedule import Costs, Schedule
from .block import BuildingBlock
from .reorder import fill_idle
from .simulated import simulated, trim
from .slot_reorder import block_key, cooldown_follows_warmup, cooldown_starts, slot_schedule

# Above this many cells (devices x microbatches) only the slot reorder runs: the real-time
# reorder replays the whole schedule per look-ahead step and takes minutes at d=64, m=512.
_COMPARE_CELLS = 2048


def schedule_from_block(block: BuildingBlock, num_microbatches: int, costs: Costs, name: str) -> Schedule:
    """Repeat, squeeze and reorder.

    Reorders of the warm-up and cool-down compete: the slot reorder (``slot_reorder``: in slot
    time, W lazily in idle slots, every device up to the largest peak of the repeated block), once
    for every place its cool-down may start (``cooldown_starts``), and the real-time idle filling
    (``fill_idle``: W at the block's slots, each device up to its own peak). The lower bubble under
    ``costs`` wins (then the lower peak). Either way no device exceeds the block's steady peak
    (``steady_peak``, W at the block's own slots): a slot reorder whose lazy W would need more is
    dropped. Above ``_COMPARE_CELLS`` only the slot reorder runs (it is the one that wins on long
    runs: measured d = 2..16, m = d..8d), with its default cool-down unless the cool-down follows the
    warm-up (m <= about d: there the later starts gain 0.2-0.7 % at d = 48 and 64, m = d).
    """
    costs.check_stages(block.placement.num_stages, name)
    if not costs.uniform:
        return _weighted_from_block(block, num_microbatches, costs, name)
    peak = max(block.steady_peak())
    large = block.placement.num_devices * num_microbatches > _COMPARE_CELLS
    starts = cooldown_starts(block, num_microbatches)
    if large and not cooldown_follows_warmup(block, num_microbatches):
        starts = starts[:1]  # the later starts gain < 0.25 % on long runs: not worth a build each here
    candidates = [slot_schedule(block, num_microbatches, name, peak, cooldown_after=start) for start in starts]
    candidates = [c for c in candidates if c is not None]  # lazy W needs more than the block's own W slots
    if not large or not candidates:  # the idle filling takes minutes at d = 64, m = 512
        candidates.append(_idle_filled(block, num_microbatches, costs, name))
    candidates = _distinct(candidates)
    if len(candidates) == 1:
        return candidates[0]
    results = [simulated(c, costs) for c in candidates]
    best = min(range(len(candidates)), key=lambda i: (round(results[i].bubble_rate, 9), results[i].peak_memory_max, i))
    return candidates[best]


def _distinct(candidates: list[Schedule]) -> list[Schedule]:
    """The candidates without repeats of an earlier one's programs (the cool-down starts often reorder alike):
    a repeat simulates alike and, later in the list, never wins a tie."""
    seen: set = set()
    out = []
    for candidate in candidates:
        if candidate.programs not in seen:
            seen.add(candidate.programs)
            out.append(candidate)
    return out


def _weighted_from_block(block: BuildingBlock, num_microbatches: int, costs: Costs, name: str) -> Schedule:
    """:func:`schedule_from_block` under per-stage memory: the slot reorder counts chunk
    activations, so each candidate's simulated (weighted) peak is checked against the block's
    weighted steady peak, and the plain repeated block stays as the fallback."""
    bound = max(block.steady_peak(costs)) + EPS
    if block.placement.num_devices * num_microbatches <= _COMPARE_CELLS:
        # No cool-down at all (None) is kept here: measured never best alone only under uniform costs.
        candidates = [slot_schedule(block, num_microbatches, name, math.inf, cooldown_after=start)
                      for start in [*cooldown_starts(block, num_microbatches), None]]
        candidates.append(_idle_filled(block, num_microbatches, costs, name))
    else:
        candidates = [slot_schedule(block, num_microbatches, name, math.inf)]
    fallback = repeated(block, num_microbatches, name)
    candidates = _distinct([c for c in candidates if c is not None] + [fallback])
    results = [simulated(c, costs) for c in candidates]
    fitting = [i for i, r in enumerate(results) if r.peak_memory_max <= bound] or \
        [next(i for i, c in enumerate(candidates) if c.programs == fallback.programs)]
    # At equal bubble and worst peak, the lower memory on the other devices: with several cool-down starts
    # competing, one can raise another device's peak for nothing (V-Half d=2 m=4 on layers 1,3,2,2: device 0
    # 1.5 units instead of 1.25 at the same makespan).
    best = min(fitting, key=lambda i: (round(results[i].bubble_rate, 9), results[i].peak_memory_max,
                                       round(sum(results[i].peak_memory), 9), i))
    return candidates[best]


def _idle_filled(block: BuildingBlock, num_microbatches: int, costs: Costs, name: str) -> Schedule:
    """The repeated block with W at its own slots, idle time filled by ``fill_idle`` when that
    shortens the makespan under ``costs`` without raising any device's own peak."""
    plain = repeated(block, num_microbatches, name)
    squeezed = simulated(plain, costs)
    reordered, makespan, reached = fill_idle(
        plain, costs, list(squeezed.peak_memory), lookahead=2 * block.placement.num_devices
    )
    fits = all(new <= old + EPS for new, old in zip(reached, squeezed.peak_memory))
    return reordered if fits and makespan < squeezed.makespan - EPS else plain


def repeated(block: BuildingBlock, num_microbatches: int, name: str) -> Schedule:
    """``block.repeat``, kept for the last few (block, size, name): the idle filling starts from it, and
    ``v-auto``'s screen simulates the same repeat first (``simulated`` keeps that result by the object)."""
    key = (block_key(block), num_microbatches, name)
    found = _REPEATED.pop(key, None)
    if found is None:
        found = block.repeat(num_microbatches, name)
    _REPEATED[key] = found
    trim(_REPEATED, lambda schedule: schedule)
    return found


_REPEATED: dict[tuple, Schedule] = {}
