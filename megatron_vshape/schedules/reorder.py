"""Reordering the warm-up and cool-down of a squeezed schedule without raising any peak.

A repeated building block leaves idle time where a device waits for an input (mostly in the
warm-up and the cool-down). This pass replays each device's order in time and, whenever the
next pass is not ready, starts instead the first pass within a short look-ahead that *is*
ready, provided that running it early keeps every prefix of the device's remaining order at or
below the device's original peak. In the steady state nothing waits, so nothing moves there.
"""

from __future__ import annotations

import heapq

from .actions import Action, Kind
from .dependencies import dependencies
from .inputs import EPS as _EPS
from .schedule import Costs, Schedule


def fill_idle(
    schedule: Schedule, costs: Costs, peaks: list[float], lookahead: int
) -> tuple[Schedule, float, list[float]]:
    """A new order for ``schedule`` (same passes) that fills waits with ready passes.

    Returns the new schedule with the makespan and per-device peak of the replay that built it
    (the replay starts every pass as soon as its device and inputs allow, like the simulator).
    """
    placement = schedule.placement
    num_stages = schedule.num_stages
    # Memory change of each (kind, stage): F allocates the stage's activation, W frees it.
    delta = {}
    for stage in range(num_stages):
        activation = schedule.activation(stage, costs)
        delta.update({(Kind.F, stage): activation, (Kind.B, stage): 0.0, (Kind.W, stage): -activation})
    remaining = [list(program) for program in schedule.programs]
    end_time: dict[Action, float] = {}
    free_at = [0.0] * schedule.num_devices
    memory = [0.0] * schedule.num_devices
    order: list[list[Action]] = [[] for _ in schedule.programs]
    first_start: list[float | None] = [None] * schedule.num_devices
    reached = [0.0] * schedule.num_devices
    events = [0.0]
    now = 0.0
    left = sum(len(p) for p in remaining)

    def ready_time(action: Action, device: int) -> float | None:
        ready = 0.0
        for dep in dependencies(action, num_stages):
            end = end_time.get(dep)
            if end is None:
                return None
            if placement.device_of(dep.stage) != device:
                end += costs.comm
            ready = max(ready, end)
        return ready

    def pick(device: int) -> int | None:
        todo = remaining[device]
        running = 0.0  # cumulative memory change of the passes a pulled pass would jump over
        worst = 0.0
        for index, action in enumerate(todo[: lookahead + 1]):
            ready = ready_time(action, device)
            if ready is not None and ready <= now + _EPS:
                if index == 0 or memory[device] + delta[action[:2]] + worst <= peaks[device] + _EPS:
                    return index
            elif ready is not None:
                heapq.heappush(events, ready)
            running += delta[action[:2]]
            worst = max(worst, running)
        return None

    while left:
        for device in range(schedule.num_devices):
            if free_at[device] > now + _EPS or not remaining[device]:
                continue
            index = pick(device)
            if index is None:
                continue
            action = remaining[device].pop(index)
            end = now + schedule.pass_cost(action, costs)
            end_time[action] = end
            free_at[device] = end
            memory[device] += delta[action[:2]]
            reached[device] = max(reached[device], memory[device])
            if first_start[device] is None:
                first_start[device] = now
            order[device].append(action)
            heapq.heappush(events, end)
            heapq.heappush(events, end + costs.comm)
            left -= 1
        while events and events[0] <= now + _EPS:
            heapq.heappop(events)
        if left and not events:  # cannot happen for a valid input order; fail loudly if it does
            raise RuntimeError(f"{schedule.name}: reorder stalled")
        if events:
            now = events[0]
    reordered = Schedule(schedule.name, placement, schedule.num_microbatches, tuple(map(tuple, order)),
                         dict(schedule.meta), schedule.fused_backward)
    makespan = max(free_at[d] - (first_start[d] or 0.0) for d in range(schedule.num_devices))
    return reordered, makespan, reached
