"""V-Min and V-Half: the paper's building blocks on the V placement (interval 6 slots).

Each is its block's schedule unless a schedule that needs no more memory runs faster (issue 22's
two families): the V-Half block for V-Min at d = 2, 3, 5 (same steady peak, lower bubble); with
few microbatches (m <= 2d, d <= 8; any m at d <= 3) the greedy V schedule capped at the block's peak on
each device; and the exact
solver's cached schedule of the cell (exact.solved). ``meta["built_as"]`` names the alternative taken.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..core.actions import Kind
from ..core.inputs import EPS
from ..core.schedule import Costs, Placement, Schedule, ScheduleError
from ..core.simulator import simulate
from .block import BuildingBlock, fill_w
from .block_schedule import schedule_from_block
from .local_search import Evaluations, pull_into_waits
from .simulated import simulated
from .solved import solved_for
from .zero_bubble import GreedyFamily, best_greedy

V_INTERVAL = 6  # two chunks x (F, B, W) of one slot each


def v_block(starts: Sequence[tuple[int, int, int, int]]) -> BuildingBlock:
    """The V block with device i's F/B passes at ``starts[i]`` = slots of [F chunk 0, F chunk 1,
    B chunk 1, B chunk 0]; each W goes into a free slot after its B (``fill_w``)."""
    placement = Placement.v_shape(len(starts))
    offsets = {}
    for (f0, f1, b1, b0), (chunk0, chunk1) in zip(starts, placement.stages_per_device):
        offsets.update({(Kind.F, chunk0): f0, (Kind.F, chunk1): f1, (Kind.B, chunk1): b1, (Kind.B, chunk0): b0})
    return fill_w(placement, V_INTERVAL, offsets)


def v_min_block(num_devices: int) -> BuildingBlock:
    d = num_devices
    x = 2 if d % 3 == 0 else 0
    return v_block([(i, 2 * d - 1 - i, 2 * d + x + i, 4 * d + x - 1 - i) for i in range(d)])


def v_min_late_block(num_devices: int) -> BuildingBlock | None:
    """The V-Min block with device 0's B of chunk 0 (the microbatch's last backward) one slot later,
    or None where that collides or raises the block's steady peak (d % 3 == 0, d = 1).

    Device 0 holds the first and the last stage and so the least memory of the V-Min block: its W of
    chunk 0 may wait one period longer. The slot it leaves goes to the next microbatch's passes on
    device 0, and the cool-down ends a slot sooner. Over d 2..16, m d/2d/4d and three cost settings it
    is faster in most cells with d % 3 != 0 (e.g. d = 14, m = 14: makespan 135 -> 134 slots) and
    slower at d = 2 and at d = 4, m = 4, so it competes (``v_min``).
    """
    d = num_devices
    if d < 2 or d % 3 == 0:
        return None
    starts = [(i, 2 * d - 1 - i, 2 * d + i, 4 * d - 1 - i) for i in range(d)]
    starts[0] = (0, 2 * d - 1, 2 * d, 4 * d)
    block = v_block(starts)
    if block.collisions() or max(block.steady_peak()) > max(v_min_block(d).steady_peak()) + EPS:
        return None
    return block


def v_half_block(num_devices: int) -> BuildingBlock:
    d = num_devices
    x = 3 if d % 2 == 0 else 0
    return v_block([(2 * i, 3 * d - 2 - i, 3 * d + x + 2 * i - 1, 6 * d + x - 2 - i) for i in range(d)])


# Up to this many microbatches per device V-Half is compared with the greedy at its own memory: with
# few microbatches the block's warm-up and cool-down dominate and the greedy fills them better
# (d=4, m=4: bubble 0.306 -> 0.231 under f=1,b=1.1,w=0.9,comm=0.05); from 4d on they agree within 0.002.
_GREEDY_MAX_MICROBATCHES_PER_DEVICE = 2
_GREEDY_MAX_DEVICES = 8  # above, the greedy's rule variants cost seconds per build for no gain measured
_GREEDY_ANY_M_DEVICES = 3  # d = 2, 3: the blocks use 1F1B's memory (d=2) and the greedy wins at any m (cheap here)


# Up to this many cells (d x m) the late block competes (a second build; above, generation time at
# d = 64, m = 512 is what counts, and the planner extrapolates V-Min from m of about 1.5 d).
_LATE_BLOCK_MAX_CELLS = 2048


def v_min(num_devices: int, num_microbatches: int, costs: Costs) -> Schedule:
    """The V-Min block, or the V-Half block where that needs no more memory and runs faster
    (d = 2, 3, 5: the V-Min block's turns cost it its memory advantage there)."""
    block, half = v_min_block(num_devices), v_half_block(num_devices)
    own = schedule_from_block(block, num_microbatches, costs, "v-min")
    # Built only where the V-Half block's steady peak is no larger (cheap to check, costly to build).
    fits = max(half.steady_peak(costs)) <= max(block.steady_peak(costs)) + EPS
    late = v_min_late_block(num_devices) if num_devices * num_microbatches <= _LATE_BLOCK_MAX_CELLS else None
    return _polished(_best_within(own, costs, [
        *([("v-half block", lambda: schedule_from_block(half, num_microbatches, costs, "v-min"))] if fits else []),
        *_greedy_alternative(own, num_devices, num_microbatches, costs),
        *_solved_alternatives(num_devices, num_microbatches, costs),
        # Last, so that a tie keeps the schedule the alternatives above chose before it existed.
        *([("v-min block, device 0's last B a slot later",
            lambda: schedule_from_block(late, num_microbatches, costs, "v-min"))] if late is not None else []),
    ]), costs)


def v_half(num_devices: int, num_microbatches: int, costs: Costs) -> Schedule:
    """The V-Half block, or with few microbatches the greedy V schedule capped at its peak when faster."""
    own = schedule_from_block(v_half_block(num_devices), num_microbatches, costs, "v-half")
    return _polished(_best_within(own, costs, [*_greedy_alternative(own, num_devices, num_microbatches, costs),
                                               *_solved_alternatives(num_devices, num_microbatches, costs)]), costs)


# Up to this many cells (d x m) the chosen schedule goes through the local search (``local_search``) with
# this many schedules simulated: the waits that the block's order leaves with few microbatches (V-Min at
# d % 3 == 0 and unequal F/B/W, e.g. d = 9, m = 9: bubble 0.4187 -> 0.4130 under f=1,b=1.1,w=0.9,comm=0.05).
_POLISH_MAX_CELLS = 192
_POLISH_EVALUATIONS = 60


def _polished(schedule: Schedule, costs: Costs) -> Schedule:
    """``schedule`` after the local search of its waits, on small cells, at no higher peak
    (``_memory_caps``), where that shortens its makespan; ``meta["polished"]``: the schedules it tried."""
    if schedule.num_devices * schedule.num_microbatches > _POLISH_MAX_CELLS:
        return schedule
    budget = Evaluations(_POLISH_EVALUATIONS)
    before = simulate(schedule, costs)
    found = pull_into_waits(schedule, costs, _memory_caps(before, costs), budget)
    # Only a shorter makespan counts (the search also moves passes that only end sooner).
    if found is None or simulate(found, costs).makespan >= before.makespan - EPS:
        return schedule
    return dataclasses.replace(found, meta={**schedule.meta, "polished": budget.tried})


def _greedy_alternative(own: Schedule, num_devices: int, num_microbatches: int, costs: Costs) -> list:
    few = num_microbatches <= _GREEDY_MAX_MICROBATCHES_PER_DEVICE * num_devices
    if num_devices > _GREEDY_MAX_DEVICES or not (few or num_devices <= _GREEDY_ANY_M_DEVICES):
        return []

    def build() -> Schedule:
        caps = _memory_caps(simulate(own, costs), costs)
        family = GreedyFamily(own.name, Placement.v_shape, lambda d, c: caps)
        return best_greedy(family, num_devices, num_microbatches, costs)

    return [(f"greedy capped at {own.name}'s peak", build)]


def _solved_alternatives(num_devices: int, num_microbatches: int, costs: Costs) -> list:
    """The exact solver's cached schedules of this cell (exact.solved; small cells, exact costs only)."""
    return [("solved (cached)", cell.schedule) for cell in solved_for(num_devices, num_microbatches, costs)]


def _memory_caps(own_result, costs: Costs) -> list[float]:
    """What an alternative may use per device: the block's peak. With uniform stages that is the
    schedule's peak on every device (the memory the paper's tables and a GPU's capacity speak of); with
    uneven stages (``costs.stages``) each device's own block peak, since the devices' peaks then differ and
    the greedy, capped at the maximum, moved memory onto the lighter devices (measured activation bytes
    then stopped following the simulator: tests/runtime/test_uneven_layout_exact.py at PP 4)."""
    peaks = list(own_result.peak_memory)
    return peaks if costs.stages else [max(peaks)] * len(peaks)


def _best_within(own: Schedule, costs: Costs, alternatives) -> Schedule:
    """``own``, or the alternative with the smallest makespan whose peak is no larger (ties: ``own``)."""
    if not alternatives:  # d > 8 and no cached cell: nothing to compare, so no simulation (0.4 s at d=64)
        return own
    best, best_result, label = own, simulated(own, costs), None
    caps = _memory_caps(best_result, costs)
    for name, build in alternatives:
        try:
            schedule = build()
        except ScheduleError:  # e.g. the greedy stalls under this cap
            continue
        result = simulated(schedule, costs)
        fits = all(got <= cap + EPS for got, cap in zip(result.peak_memory, caps))
        if fits and result.makespan < best_result.makespan - EPS:
            best, best_result, label = schedule, result, name
    return best if best is own else dataclasses.replace(best, name=own.name, meta={"built_as": label})
