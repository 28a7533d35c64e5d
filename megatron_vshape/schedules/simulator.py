"""Timed simulation of a schedule: start/end of each pass, makespan, bubble, memory.

Each device runs its program in order. A pass starts when the device is free and all its
dependencies have finished; a dependency on another device also pays ``costs.comm``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .actions import Action, Kind
from .dependencies import dependencies
from .drive import drive
from .schedule import Costs, MemoryModel, Schedule, ScheduleError


class DeadlockError(ScheduleError):
    """The programs' order makes some pass wait forever for a dependency."""


@dataclass(frozen=True)
class Interval:
    device: int
    start: float
    end: float


@dataclass(frozen=True)
class SimulationResult:
    schedule: Schedule
    costs: Costs
    timeline: dict[Action, Interval]
    makespan: float
    work_per_device: float
    bubble_rate: float
    peak_memory: tuple[float, ...]
    memory_timeline: tuple[tuple[tuple[float, float], ...], ...]

    @property
    def makespan_total(self) -> float:
        """End of the last pass on any device (the makespan counts each device from its own start)."""
        return max((iv.end for iv in self.timeline.values()), default=0.0)

    @property
    def peak_memory_max(self) -> float:
        return max(self.peak_memory)

    def to_json(self) -> dict:
        return {
            "schedule": self.schedule.name,
            "stages": self.schedule.num_devices,
            "microbatches": self.schedule.num_microbatches,
            "num_stages": self.schedule.num_stages,
            "placement": self.schedule.placement.kind.value,
            "costs": {"f": self.costs.f, "b": self.costs.b, "w": self.costs.w, "comm": self.costs.comm},
            "makespan": self.makespan,
            "bubble_rate": self.bubble_rate,
            "work_per_device": self.work_per_device,
            "peak_memory": list(self.peak_memory),
            "peak_memory_max": self.peak_memory_max,
        }


def simulate(
    schedule: Schedule, costs: Costs = Costs(), memory: MemoryModel = MemoryModel()
) -> SimulationResult:
    timeline = _run_programs(schedule, costs)
    spans = []
    for program in schedule.programs:
        if program:
            spans.append(timeline[program[-1]].end - timeline[program[0]].start)
    makespan = max(spans, default=0.0)
    work = max(schedule.work_per_device(costs), default=0.0)
    bubble = 1.0 - work / makespan if makespan > 0 else 0.0
    mem_timelines = tuple(
        _memory_timeline(schedule, program, timeline, memory) for program in schedule.programs
    )
    peaks = tuple(max((v for _, v in tl), default=0.0) for tl in mem_timelines)
    return SimulationResult(schedule, costs, timeline, makespan, work, bubble, peaks, mem_timelines)


def _run_programs(schedule: Schedule, costs: Costs) -> dict[Action, Interval]:
    """As-soon-as-possible execution of every device's program in order ("squeeze")."""
    num_stages = schedule.num_stages
    device_of = schedule.placement.device_of
    timeline: dict[Action, Interval] = {}
    device_free = [0.0] * schedule.num_devices
    scale = schedule.placement.layer_scale
    duration = {kind: costs.of(kind) * scale for kind in Kind}

    def inputs(action: Action):
        deps = dependencies(action, num_stages)
        if schedule.fused_backward and action.kind is Kind.B:
            # The upstream gradient leaves only when that stage's fused B+W ends.
            deps = tuple(Action(Kind.W, d.stage, d.microbatch) if d.kind is Kind.B else d for d in deps)
        return deps

    def needs(device: int, action: Action):
        return inputs(action)

    def run(device: int, action: Action):
        ready = device_free[device]
        for dep in inputs(action):
            end = timeline[dep].end
            if device_of(dep.stage) != device:
                end += costs.comm
            ready = max(ready, end)
        end = ready + duration[action.kind]
        timeline[action] = Interval(device, ready, end)
        device_free[device] = end
        return (action,)

    cursor = drive(schedule.programs, needs, run)
    stuck = [str(p[c]) for p, c in zip(schedule.programs, cursor) if c < len(p)]
    if stuck:
        raise DeadlockError(f"schedule {schedule.name!r} deadlocks: devices wait forever at {', '.join(stuck)}")
    return timeline


def _memory_timeline(schedule, program, timeline, memory: MemoryModel):
    """Activation memory of one device after each allocation/release event, in units.

    F allocates at its start; B and W release at their end. Releases at the same instant
    as an allocation are applied first.
    """
    activation = schedule.activation()
    events = []
    for action in program:
        interval = timeline[action]
        delta = memory.delta(action.kind, activation)
        if action.kind is Kind.F:
            events.append((interval.start, 1, delta))
        elif delta:
            events.append((interval.end, 0, delta))
    events.sort()
    level = 0.0
    out = [(0.0, 0.0)]
    for time, _, delta in events:
        level += delta
        out.append((time, round(level, 9)))
    return tuple(out)
