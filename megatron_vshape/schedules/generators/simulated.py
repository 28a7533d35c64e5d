"""The simulations a build compares, kept for the next comparison of the same schedule.

A build simulates the same schedule object several times: ``block_schedule`` compares its reorders, then
V-Min / V-Half compare the winner with their alternatives (``v_schedules._best_within``), the registry with
the order built for uniform stages, ``v-auto`` measures every candidate again. A simulation depends on the
schedule, the costs and the memory model alone, and a schedule never changes (frozen, tuples), so the last
few results are kept by the schedule object's identity (the object is kept with them, so its identity
cannot be reused).
"""

from __future__ import annotations

from ..core.schedule import Costs, MemoryModel, Schedule
from ..core.simulator import SimulationResult, simulate

_KEPT: dict[tuple, tuple[Schedule, SimulationResult]] = {}
# Passes of the schedules kept in all, the oldest dropped first (a result holds every pass's times): v-auto at
# d = 16, m = 64 screens 34 repeats of 6k passes before it builds; one d = 64, m = 512 schedule has 200k.
KEPT_PASSES = 400_000


def simulated(schedule: Schedule, costs: Costs, memory: MemoryModel = MemoryModel()) -> SimulationResult:
    """``simulate(schedule, costs, memory)``, kept for the same schedule object."""
    key = (id(schedule), costs, memory)
    found = _KEPT.pop(key, None)
    if found is None or found[0] is not schedule:
        found = (schedule, simulate(schedule, costs, memory))
    _KEPT[key] = found  # the most recently used last
    trim(_KEPT, lambda kept: kept[0])
    return found[1]


def trim(store: dict, schedule_of) -> None:
    """Drop the oldest entries of ``store`` (insertion order) until its schedules hold at most ``KEPT_PASSES``
    passes (the newest is always kept)."""
    sizes = [sum(map(len, schedule_of(value).programs)) for value in store.values()]
    total = sum(sizes)
    for size in sizes[:-1]:
        if total <= KEPT_PASSES:
            break
        store.pop(next(iter(store)))
        total -= size
