"""A local search over device programs: pull a ready pass into a wait (issue 44).

The generators place passes by rules (block offsets, slot reorders, the greedy's priorities); each rule
is a heuristic, and a schedule they build can still have a wait that a later pass could fill, or a pass
that waits for an input its own producer could have sent sooner. This search tries exactly those moves:

* a later pass of the waiting device that is ready by then, pulled into the wait (at most
  ``WINDOW`` positions ahead);
* the input the waiting pass waited for, pulled ahead on its own device (at most ``WINDOW`` positions).

A move keeps each stage's microbatch order and every dependency, and is taken when the schedule stays
within the memory caps (per device, as the simulator counts them) and (makespan, sum of all end times)
goes down: first improvement, then the next round from the new schedule. Its budget is a number of
schedules simulated, so what it finds does not depend on the machine. ``scripts/v_gap_search.py`` runs
the same search with a larger budget as one of its stronger searches.
"""

from __future__ import annotations

from ..core.dependencies import dependencies
from ..core.inputs import EPS
from ..core.schedule import Costs, MemoryModel, Schedule
from ..core.simulator import SimulationResult, simulate

WINDOW = 6  # positions a pass may be pulled ahead in one move


class Evaluations:
    """A budget of schedules simulated."""

    def __init__(self, count: int) -> None:
        self.left = count
        self.tried = 0

    def count(self) -> None:
        self.tried += 1
        self.left -= 1

    def spent(self) -> bool:
        return self.left <= 0


def _key(result: SimulationResult) -> tuple[float, float]:
    # The makespan alone is flat under most single moves (only the worst device counts); the sum
    # of all end times rewards every move that lets some pass finish sooner.
    return round(result.makespan, 9), round(sum(iv.end for iv in result.timeline.values()), 6)


def pull_into_waits(schedule: Schedule, costs: Costs, caps: list[float], budget,
                    memory: MemoryModel = MemoryModel()) -> Schedule | None:
    """The schedule after first-improvement moves (see the module docstring) within ``budget`` (an
    object with ``count()`` and ``spent()``, e.g. :class:`Evaluations`), every device's peak within
    ``caps``; None when no move improved it."""
    stages = schedule.num_stages
    device_of = schedule.placement.device_of
    programs = [list(p) for p in schedule.programs]

    def build(progs) -> Schedule:
        return Schedule(schedule.name, schedule.placement, schedule.num_microbatches, tuple(map(tuple, progs)),
                        dict(schedule.meta), schedule.fused_backward)

    def fits(result: SimulationResult) -> bool:
        return all(got <= cap + EPS for got, cap in zip(result.peak_memory, caps))

    best = simulate(build(programs), costs, memory)
    best_key = _key(best)
    moved = False
    while not budget.spent():
        timeline = best.timeline

        def arrival(dep, device, timeline=timeline):
            return timeline[dep].end + (costs.comm if device_of(dep.stage) != device else 0.0)

        where = {a: (device, i) for device, program in enumerate(programs) for i, a in enumerate(program)}
        moves = []  # (device, from position, to position)
        for device, program in enumerate(programs):
            for i in range(1, len(program)):
                waiting = program[i]
                if timeline[waiting].start - timeline[program[i - 1]].end <= EPS:
                    continue
                moves.extend((device, j, i) for j in range(i + 1, min(i + 1 + WINDOW, len(program))))
                inputs = dependencies(waiting, stages)
                if inputs:
                    late_device, late_at = where[max(inputs, key=lambda dep: arrival(dep, device))]
                    moves.extend((late_device, late_at, late_at - k) for k in range(1, WINDOW + 1)
                                 if late_at - k >= 0)
        improved = False
        for device, j, i in moves:
            program = programs[device]
            action = program[j]
            jumped = program[i:j]
            inputs = dependencies(action, stages)
            if any(a.kind is action.kind and a.stage == action.stage for a in jumped):
                continue  # each stage keeps its microbatch order (as every generator and the solver)
            if any(dep in jumped for dep in inputs):
                continue
            ready = max((arrival(dep, device) for dep in inputs), default=0.0)
            if ready >= timeline[program[i]].start - EPS:
                continue  # it could not start any sooner there
            trial = programs[:device] + [program[:i] + [action] + jumped + program[j + 1:]] + programs[device + 1:]
            result = simulate(build(trial), costs, memory)
            budget.count()
            if fits(result) and _key(result) < best_key:
                programs, best, best_key, improved, moved = trial, result, _key(result), True, True
                break
            if budget.spent():
                break
        if not improved:
            break
    return build(programs) if moved else None
