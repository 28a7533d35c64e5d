"""The exact-schedule problem as integer data: what the CP-SAT model (``cpsat``) is built from.

Pure Python (no solver import), so the problem's bounds and its conversion back to a
:class:`Schedule` are testable without OR-Tools.

Time is scaled to integers: the smallest ``scale`` (up to ``_MAX_SCALE``) that makes every pass
time and the comm delay whole numbers; if none does, durations are rounded *down* at
``_FALLBACK_SCALE`` (then every real schedule also fits the rounded problem, so its optimum is
still a proven lower bound; the returned schedule is always simulated at the real costs).

The objective is the simulator's makespan: the longest device span, each device counted from its
own first pass. Run as soon as possible, a device's first pass is F of its first stage on
microbatch 0, which starts at the fixed time ``origin`` (the F chain before it), so a span is
``end(last pass) - origin`` and the objective is linear.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.actions import Action, Kind
from ..core.dependencies import dependencies
from ..core.inputs import EPS
from ..core.ledger import pass_deltas
from ..core.schedule import Costs, MemoryModel, Placement, PlacementKind, Schedule, ScheduleError, one_f_one_b_peak
from ..core.timing import KIND_INDEX, KINDS, run_programs

__all__ = ["ExactProblem", "build_problem", "makespan_of", "peak_of", "schedule_from_starts", "starts_of"]

_MAX_SCALE = 200  # largest time scale tried for exact integer durations (f=1, b=1.1, comm=0.05: 20)
_FALLBACK_SCALE = 100
_MEMORY_SCALE = 1 << 12  # memory units -> integers; a power of two keeps halves and quarters exact
MAX_MEMORY_LIMIT = 8.0  # --memory-limit range: (0, 8] x 1F1B's peak


@dataclass(frozen=True)
class ExactProblem:
    """One cell as integers: passes, their durations, dependency delays and memory changes."""

    placement: Placement
    num_microbatches: int
    costs: Costs
    memory: MemoryModel
    memory_limit: float | None  # x 1F1B's peak; None: no cap
    cap: float | None  # the cap in memory units (memory_limit x 1F1B's peak), None: no cap
    scale: int  # time units per cost unit
    exact_time: bool  # durations are the real ones (else rounded down: the optimum is only a bound)
    passes: tuple[Action, ...]
    duration: tuple[int, ...]  # per pass, scaled
    device: tuple[int, ...]  # per pass
    preds: tuple[tuple[tuple[int, int], ...], ...]  # per pass: (input pass, delay) pairs
    origin: tuple[int, ...]  # per device: start of its first pass when run as soon as possible
    head: tuple[int, ...]  # per pass: its earliest start (longest input chain)
    tails: tuple[dict[int, int], ...]  # per pass: device -> longest chain from its start to an end there
    memory_delta: tuple[int, ...]  # per pass, scaled by memory_scale
    memory_scale: int
    cap_units: int | None  # the cap, scaled (rounded down to the tolerance)

    @property
    def num_devices(self) -> int:
        return self.placement.num_devices

    def index(self, action: Action) -> int:
        kind, stage, microbatch = action
        return (KIND_INDEX[kind] * self.placement.num_stages + stage) * self.num_microbatches + microbatch

    def lower_bound(self) -> int:
        """A makespan bound from the chains alone: no device's span is shorter than a chain into it."""
        bound = max(sum(d for d, dev in zip(self.duration, self.device) if dev == j) for j in range(self.num_devices))
        for p, tail in enumerate(self.tails):
            for j, length in tail.items():
                bound = max(bound, self.head[p] + length - self.origin[j])
        return bound

    def to_time(self, value: float) -> float:
        return value / self.scale


def _scale_for(values: list[float]) -> tuple[int, bool]:
    """The smallest integer scale making every value whole (to EPS), else the fallback."""
    for scale in range(1, _MAX_SCALE + 1):
        if all(abs(v * scale - round(v * scale)) <= 1e-7 * max(1.0, v * scale) for v in values):
            return scale, True
    return _FALLBACK_SCALE, False


def _placement(kind: PlacementKind, num_devices: int) -> Placement:
    return Placement.v_shape(num_devices) if kind is PlacementKind.V else Placement.looped(num_devices)


def build_problem(num_devices: int, num_microbatches: int, costs: Costs = Costs(),
                  placement: PlacementKind = PlacementKind.V, memory_limit: float | None = None,
                  memory: MemoryModel = MemoryModel()) -> ExactProblem:
    """The cell as integers; ScheduleError (one line naming the flag) for sizes or limits it cannot take."""
    if num_devices < 1 or num_microbatches < 1:
        raise ScheduleError(f"--stages and --microbatches must be >= 1; got {num_devices} and {num_microbatches}")
    if memory_limit is not None and not 0 < memory_limit <= MAX_MEMORY_LIMIT:
        raise ScheduleError(f"--memory-limit must be in (0, {MAX_MEMORY_LIMIT:g}] (a fraction of 1F1B's peak "
                            f"activation memory); got {memory_limit:g}")
    place = _placement(placement, num_devices)
    costs.check_stages(place.num_stages, f"the {placement.value} placement on {num_devices} devices")
    m, stages = num_microbatches, place.num_stages
    passes = tuple(Action(kind, stage, mb) for kind in KINDS for stage in range(stages) for mb in range(m))
    real = [costs.of(kind, stage) * place.layer_scale for kind in KINDS for stage in range(stages)]
    scale, exact = _scale_for([*real, costs.comm])
    per_kind_stage = [math.floor(v * scale + 1e-7) for v in real]
    if min(per_kind_stage) < 1:
        raise ScheduleError("--costs: a pass time rounds to zero at this scale; give times of at least 0.01")
    comm = math.floor(costs.comm * scale + 1e-7)
    device = tuple(place.device_of(a.stage) for a in passes)
    duration = tuple(per_kind_stage[i // m] for i in range(len(passes)))
    index = {a: i for i, a in enumerate(passes)}
    preds = tuple(
        tuple((index[dep], comm if device[index[dep]] != device[i] else 0) for dep in dependencies(a, stages))
        for i, a in enumerate(passes)
    )
    head = _heads(passes, duration, preds, stages)
    origin = tuple(head[index[Action(Kind.F, place.stages_per_device[j][0], 0)]] for j in range(num_devices))
    tails = _tails(passes, duration, device, preds, stages)
    deltas = pass_deltas(place, costs, memory)
    memory_delta = _memory_deltas(deltas, stages, m)
    cap = None if memory_limit is None else memory_limit * one_f_one_b_peak(num_devices, costs)
    cap_units = None if cap is None else math.floor((cap + EPS) * _MEMORY_SCALE)
    return ExactProblem(place, m, costs, memory, memory_limit, cap, scale, exact, passes, duration, device, preds,
                        origin, head, tails, memory_delta, _MEMORY_SCALE, cap_units)


def _topological(passes: tuple[Action, ...], stages: int) -> list[int]:
    """Pass indices inputs first: F by stage up, B by stage down, then W (kind-major indices)."""
    m = len(passes) // (3 * stages)
    order = [s * m + k for s in range(stages) for k in range(m)]
    order += [(stages + s) * m + k for s in reversed(range(stages)) for k in range(m)]
    order += [(2 * stages + s) * m + k for s in range(stages) for k in range(m)]
    return order


def _heads(passes, duration, preds, stages) -> tuple[int, ...]:
    head = [0] * len(passes)
    for p in _topological(passes, stages):
        head[p] = max((head[q] + duration[q] + delay for q, delay in preds[p]), default=0)
    return tuple(head)


def _tails(passes, duration, device, preds, stages) -> tuple[dict[int, int], ...]:
    """Per pass p and device j reached from p: the longest chain from p's start to the end of a pass on j.

    ``start(p) + tails[p][j] <= origin[j] + makespan`` holds in every schedule: the redundant
    constraints that give the solver the chains' bound directly instead of by propagation.
    """
    tails: list[dict[int, int]] = [{} for _ in passes]
    for p in reversed(_topological(passes, stages)):
        tails[p].setdefault(device[p], duration[p])
        for q, delay in preds[p]:  # p is a successor of q
            for j, length in tails[p].items():
                through = duration[q] + delay + length
                if through > tails[q].get(j, 0):
                    tails[q][j] = through
    return tuple(tails)


def _memory_deltas(deltas: tuple[float, ...], stages: int, m: int) -> tuple[int, ...]:
    """Scaled memory change per pass; B's and W's releases sum exactly to F's allocation."""
    out = [0] * (3 * stages * m)
    for s in range(stages):
        allocated = round(deltas[s] * _MEMORY_SCALE)
        by_b = round(-deltas[stages + s] * _MEMORY_SCALE)
        for k in range(m):
            out[s * m + k] = allocated
            out[(stages + s) * m + k] = -by_b
            out[(2 * stages + s) * m + k] = -(allocated - by_b)
    return tuple(out)


def schedule_from_starts(problem: ExactProblem, starts: list[int], name: str = "optimal") -> Schedule:
    """The schedule that runs each device's passes in the order of ``starts`` (ties: index order)."""
    programs = [[] for _ in range(problem.num_devices)]
    for p in sorted(range(len(problem.passes)), key=lambda p: (starts[p], p)):
        programs[problem.device[p]].append(problem.passes[p])
    return Schedule(name, problem.placement, problem.num_microbatches, tuple(tuple(p) for p in programs))



def starts_of(problem: ExactProblem, schedule: Schedule) -> list[int] | None:
    """Scaled start of every pass when ``schedule``'s programs run as soon as possible under the
    problem's integer times (a warm start for the solver), or None if they deadlock."""
    m, stages = problem.num_microbatches, problem.placement.num_stages
    table = [problem.duration[k * m] for k in range(3 * stages)]
    comm = max((delay for preds in problem.preds for _, delay in preds), default=0)
    device_of = [problem.placement.device_of(s) for s in range(stages)]
    times = run_programs(schedule.programs, device_of, stages, m, table, comm)
    if times.stuck:
        return None
    return [round(times.start[problem.index(a)]) for a in problem.passes]


def makespan_of(problem: ExactProblem, starts: list[int]) -> int:
    """The objective of ``starts``: the longest device span from the device's origin."""
    ends = [0] * problem.num_devices
    for p, start in enumerate(starts):
        ends[problem.device[p]] = max(ends[problem.device[p]], start + problem.duration[p])
    return max(end - origin for end, origin in zip(ends, problem.origin))


def peak_of(problem: ExactProblem, starts: list[int]) -> int:
    """Largest scaled memory level of any device (F allocates at its start, B/W release at their end)."""
    events = [[] for _ in range(problem.num_devices)]
    for p, start in enumerate(starts):
        delta = problem.memory_delta[p]
        at = start if delta > 0 else start + problem.duration[p]
        events[problem.device[p]].append((at, delta))
    peak = 0
    for device_events in events:
        level = 0
        for _, delta in sorted(device_events):  # releases (negative) first at equal times
            level += delta
            peak = max(peak, level)
    return peak
