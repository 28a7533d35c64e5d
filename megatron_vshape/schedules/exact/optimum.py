"""``optimize``: the exact schedule of one cell, as a normal :class:`Schedule`.

The heuristics' best schedule that fits the cap warm-starts the solver; the solver's schedule is
converted to per-device programs (each device runs its passes in the solver's start order),
validated and simulated at the real costs, so what is reported is what the simulator measures.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..core.inputs import EPS
from ..core.schedule import Costs, MemoryModel, PlacementKind, Schedule, ScheduleError
from ..core.simulator import SimulationResult, simulate
from ..generators.registry import get_schedule
from ..lowering.validator import keeps_w_order, validate
from . import cpsat
from .problem import ExactProblem, build_problem, makespan_of, peak_of, schedule_from_starts, starts_of

__all__ = ["NAME", "ExactResult", "optimize", "warm_start"]

NAME = "optimal"
# Heuristics that warm-start the solver, per placement (the best that fits the cap is used).
_WARM_STARTS = {
    PlacementKind.V: ("v-min", "v-half", "v-zb"),
    PlacementKind.LOOPED: ("1f1b", "zb-h1", "zb-1p", "zb-2p"),
}


@dataclass(frozen=True)
class ExactResult:
    """The solver's best schedule, simulated, with the proven bound on the makespan."""

    result: SimulationResult  # the schedule simulated at the real costs
    lower_bound: float  # proven: no schedule of the cell (same memory cap) has a smaller makespan
    optimal: bool  # the solver proved its schedule optimal (at the integer times; see exact_time)
    exact_time: bool  # the integer times are the real ones (else rounded down: lower_bound still holds)
    status: str
    wall_s: float
    warm_start: str | None  # the heuristic that seeded the search

    @property
    def schedule(self) -> Schedule:
        return self.result.schedule

    @property
    def gap(self) -> float:
        """(makespan - lower bound) / makespan: 0 when proven optimal."""
        makespan = self.result.makespan
        return max(0.0, (makespan - self.lower_bound) / makespan) if makespan > 0 else 0.0

    def to_json(self) -> dict:
        return {**self.result.to_json(), "validated": True, "w_order_kept": keeps_w_order(self.schedule),
                "lower_bound": self.lower_bound, "gap": self.gap,
                "optimal": self.optimal, "solver_status": self.status, "solver_wall_s": round(self.wall_s, 3),
                "memory_limit": self.schedule.meta.get("memory_limit"), "warm_start": self.warm_start}


def warm_start(problem: ExactProblem) -> tuple[str | None, list[int] | None]:
    """The heuristic with the smallest makespan (integer times) whose peak fits the cap."""
    best: tuple[int, str, list[int]] | None = None
    d, m = problem.num_devices, problem.num_microbatches
    for name in _WARM_STARTS[problem.placement.kind]:
        try:
            schedule = get_schedule(name, d, m, problem.costs, memory=problem.memory)
        except ScheduleError:
            continue
        starts = starts_of(problem, schedule)
        if starts is None or (problem.cap_units is not None and peak_of(problem, starts) > problem.cap_units):
            continue
        span = makespan_of(problem, starts)
        if best is None or span < best[0]:
            best = (span, name, starts)
    return (best[1], best[2]) if best else (None, None)


def optimize(num_devices: int, num_microbatches: int, costs: Costs = Costs(),
             placement: PlacementKind = PlacementKind.V, memory_limit: float | None = 1.0,
             memory: MemoryModel = MemoryModel(), time_limit: float = 60.0, workers: int = 2,
             seed: int = 0) -> ExactResult:
    """The exact schedule (or the best found in ``time_limit`` seconds) and the proven bound.

    ``memory_limit``: a fraction of 1F1B's peak, as for v-auto (None: no cap). ScheduleError
    when OR-Tools is missing, or when no schedule fits the cap.
    """
    if not cpsat.solver_available():
        raise ScheduleError("vshape optimize needs OR-Tools: pip install -e \".[solver]\" (or pip install ortools)")
    problem = build_problem(num_devices, num_microbatches, costs, placement, memory_limit, memory)
    label, hint = warm_start(problem)
    outcome = cpsat.solve(problem, time_limit, workers, hint, seed)
    if outcome.starts is None:
        why = "no schedule fits the memory cap" if outcome.status == "INFEASIBLE" else "no schedule found in time"
        raise ScheduleError(f"optimize: {why} on {num_devices} devices x {num_microbatches} microbatches"
                            f"{'' if memory_limit is None else f' at --memory-limit {memory_limit:g}'}; "
                            f"raise --memory-limit or --time-limit")
    schedule = schedule_from_starts(problem, outcome.starts, NAME)
    schedule = dataclasses.replace(schedule, meta={
        "memory_limit": memory_limit, "memory_limit_units": problem.cap, "lower_bound": outcome.bound / problem.scale,
        "optimal": outcome.optimal})
    validate(schedule)
    result = simulate(schedule, costs, memory)
    if problem.cap is not None and result.peak_memory_max > problem.cap + EPS:
        raise ScheduleError(f"optimize: the solved schedule's peak {result.peak_memory_max:g} exceeds the cap "
                            f"{problem.cap:g} (memory rounding); report this cell")
    bound = outcome.bound / problem.scale
    if abs(bound - result.makespan) <= 1e-9 * max(1.0, result.makespan):  # the same time, up to float sums
        bound = result.makespan
    return ExactResult(result, min(bound, result.makespan), outcome.optimal and problem.exact_time,
                       problem.exact_time, outcome.status, outcome.wall_s, label)
