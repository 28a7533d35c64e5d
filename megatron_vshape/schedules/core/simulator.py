"""Timed simulation of a schedule: start/end of each pass, makespan, bubble, memory.

Each device runs its program in order. A pass starts when the device is free and all its
dependencies have finished; a dependency on another device also pays ``costs.comm``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import accumulate, chain, repeat
from operator import itemgetter

from .actions import Action, Kind
from .gc_pause import without_gc
from .ledger import pass_deltas
from .schedule import Costs, MemoryModel, Schedule, ScheduleError, vocab_pass_times
from .timing import KINDS, Interval, PassIds, ProgramTimes, Timeline, run_programs, stage_durations
from .vocab_embedding import buffer_events, send_events

__all__ = ["DeadlockError", "Interval", "SimulationResult", "simulate"]


class DeadlockError(ScheduleError):
    """The programs' order makes some pass wait forever for a dependency."""


@dataclass(frozen=True)
class SimulationResult:
    schedule: Schedule
    costs: Costs
    timeline: Mapping[Action, Interval]
    makespan: float
    work_per_device: float
    bubble_rate: float
    peak_memory: tuple[float, ...]
    memory_timeline: tuple[tuple[tuple[float, float], ...], ...]
    work_each: tuple[float, ...] = ()  # busy time of every device (work_per_device is the largest)
    # All-to-all time of every device that no compute hides (in work_each): 0 without costs.a2a.
    exposed_a2a: tuple[float, ...] = ()

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
            "costs": {"f": self.costs.f, "b": self.costs.b, "w": self.costs.w, "comm": self.costs.comm,
                      **({"a2a": self.costs.a2a} if self.costs.a2a else {})},
            # a stage's all-to-all share only where there is an all-to-all (the output is unchanged otherwise)
            "stage_costs": [{key: value for key, value in dataclasses.asdict(work).items()
                             if key != "a2a" or self.costs.a2a} for work in self.costs.stages],
            "vocab_parallel": None if self.costs.vocab is None else dataclasses.asdict(self.costs.vocab),
            "work_each_device": list(self.work_each),
            "makespan": self.makespan,
            "bubble_rate": self.bubble_rate,
            "work_per_device": self.work_per_device,
            "peak_memory": list(self.peak_memory),
            "peak_memory_max": self.peak_memory_max,
            **({"pairs": len(self.schedule.pairs), "exposed_a2a_each_device": list(self.exposed_a2a)}
               if self.costs.a2a or self.schedule.pairs else {}),
        }


@without_gc
def simulate(
    schedule: Schedule, costs: Costs = Costs(), memory: MemoryModel = MemoryModel()
) -> SimulationResult:
    _check(schedule, costs)
    pairs = pair_table(schedule, costs)
    times = _run_programs(schedule, costs, pairs)
    spans = [times.end[program[-1]] - times.start[program[0]] for program in times.programs if program]
    work = _work(times, schedule.num_stages, costs.uniform and not schedule.vocab_parallel)
    exposed = _exposed_a2a(schedule, costs, times, pairs)
    if pairs:  # a pair takes its own time, not its halves' sum
        saved = [0.0] * len(work)
        for device, program in enumerate(times.programs):
            for x in program:
                if x in pairs:
                    y, pair_time = pairs[x]
                    saved[device] += times.durations[x // times.ids.num_microbatches] + \
                        times.durations[y // times.ids.num_microbatches] - pair_time
        work = [busy - cut for busy, cut in zip(work, saved)]
    makespan = max(spans, default=0.0)
    most_work = max(work, default=0.0)
    # The idle share of all devices' time. With uniform costs every device has the same work and this is
    # the paper's bubble rate; with per-stage costs the lighter devices' idle time (the imbalance a
    # balanced layout removes) counts too, not only the busiest device's.
    mean_work = most_work if costs.uniform else sum(work) / len(work) if work else 0.0
    bubble = 1.0 - mean_work / makespan if makespan > 0 else 0.0
    # Memory deltas per (kind, stage), indexed like the durations (pass id // microbatches): the
    # ledger's, so the generators cap under the count reported here.
    deltas = pass_deltas(schedule.placement, costs, memory)
    buffers = _vocab_buffer_events(schedule, costs, times)
    mem_timelines = tuple(_memory_timeline(times, program, deltas, extra)
                          for program, extra in zip(times.programs, buffers))
    peaks = tuple(max(map(_level_of, tl), default=0.0) for tl in mem_timelines)
    timeline = Timeline(times, schedule.programs)
    return SimulationResult(schedule, costs, timeline, makespan, most_work, bubble, peaks, mem_timelines, tuple(work),
                            exposed)


def last_end(schedule: Schedule, costs: Costs = Costs()) -> float:
    """When the last pass of ``schedule`` ends under ``costs`` (``simulate``'s timeline, no more): the end of
    every device's last pass, without the memory, work and bubble a ranking of many orders never reads."""
    _check(schedule, costs)
    times = _run_programs(schedule, costs, pair_table(schedule, costs))
    return max(times.end[program[-1]] for program in times.programs if program)


def _check(schedule: Schedule, costs: Costs) -> None:
    costs.check_stages(schedule.num_stages, f"schedule {schedule.name!r}")
    if costs.vocab is not None and not schedule.vocab_parallel:
        raise ScheduleError(f"schedule {schedule.name!r} holds no vocabulary passes but the costs give their "
                            "work; build it with those costs (the registry places the passes)")


def _work(times: ProgramTimes, num_stages: int, uniform: bool) -> list[float]:
    """Busy time of each device: the sum of its passes' durations."""
    m, durations = times.ids.num_microbatches, times.durations
    if uniform:  # counts x (F, B, W): today's arithmetic, so uniform results stay bit-identical
        per_kind = times.ids.per_kind
        out = []
        for program in times.programs:
            kinds = [x // per_kind for x in program]
            out.append(sum(kinds.count(k) * durations[k * num_stages] for k in range(3)))
        return out
    return [sum(durations[x // m] for x in program) for program in times.programs]


def _run_programs(schedule: Schedule, costs: Costs, pairs: dict[int, tuple[int, float]]) -> ProgramTimes:
    """As-soon-as-possible execution of every device's program in order ("squeeze")."""
    placement = schedule.placement
    times = run_programs(
        schedule.programs, [placement.device_of(s) for s in range(placement.num_stages)],
        schedule.num_stages, schedule.num_microbatches,
        pass_durations(schedule, costs), costs.comm, schedule.fused_backward,
        schedule.num_devices if schedule.vocab_parallel else 0, pairs,
    )
    stuck = [str(schedule.programs[dev][times.cursor[dev]]) for dev in times.stuck]
    if stuck:
        raise DeadlockError(f"schedule {schedule.name!r} deadlocks: devices wait forever at {', '.join(stuck)}")
    return times


def pass_durations(schedule: Schedule, costs: Costs, vocab_parallel: bool | None = None) -> tuple[float, ...]:
    """The timing core's flat duration table of ``schedule``'s passes under ``costs`` (with the vocabulary
    passes' rows where the schedule holds them, or where ``vocab_parallel`` says it will)."""
    scale = schedule.placement.layer_scale
    per_stage = [tuple(costs.of(kind, stage) * scale for kind in KINDS) for stage in range(schedule.num_stages)]
    if costs.a2a:  # an F or B alone exposes its all-to-all in full
        a2a = [costs.a2a_time(scale, stage) for stage in range(schedule.num_stages)]
        per_stage = [(f + a, b + a, w) for (f, b, w), a in zip(per_stage, a2a)]
    with_vocab = schedule.vocab_parallel if vocab_parallel is None else vocab_parallel
    shards = schedule.num_devices if with_vocab else 0
    if not shards:
        return stage_durations(per_stage)
    h, g = vocab_pass_times(costs, shards)
    # The last stage's device's H also runs the loss function and waits for the hidden gradient's reduce.
    holder = schedule.placement.device_of(schedule.num_stages - 1)
    extra = costs.vocab.holder_time(costs)
    return stage_durations(per_stage, (tuple(h + (extra if r == holder else 0.0) for r in range(shards)), g), shards)


def pair_table(schedule: Schedule, costs: Costs) -> dict[int, tuple[int, float]]:
    """The timing core's pairs: the F's pass id -> (the B's pass id, the pair's time under ``costs``).

    ScheduleError when a pair's halves are not adjacent, forward first, in one device's program (the
    validator says more: which rule a pair breaks)."""
    if not schedule.pairs:
        return {}
    ids = PassIds(schedule.num_stages, schedule.num_microbatches)
    scale = schedule.placement.layer_scale
    position = {action: (device, i) for device, program in enumerate(schedule.programs)
                for i, action in enumerate(program)}
    table = {}
    for pair in schedule.pairs:
        where, after = position.get(pair.forward), position.get(pair.backward)
        if where is None or after is None or after != (where[0], where[1] + 1):
            raise ScheduleError(f"schedule {schedule.name!r}: pair {pair} is not its F then its B, adjacent on one "
                                "device")
        forward = costs.of(Kind.F, pair.forward.stage) * scale
        backward = costs.of(Kind.B, pair.backward.stage) * scale
        table[ids.of(pair.forward)] = (ids.of(pair.backward), costs.pair_time(
            forward, backward, scale, (pair.forward.stage, pair.backward.stage)))
    return table


def _exposed_a2a(schedule: Schedule, costs: Costs, times: ProgramTimes,
                 pairs: dict[int, tuple[int, float]]) -> tuple[float, ...]:
    """All-to-all time of each device that no compute hides: in full for an F or B alone, for a pair what
    its time has beyond its compute."""
    if not costs.a2a:
        return tuple(0.0 for _ in times.programs)
    scale, per_kind, m = schedule.placement.layer_scale, times.ids.per_kind, times.ids.num_microbatches
    a2a = [costs.a2a_time(scale, stage) for stage in range(schedule.num_stages)]  # by (pass id // m) % stages
    paired_backwards = {y for y, _ in pairs.values()}
    out = []
    for program in times.programs:
        exposed = 0.0
        for x in program:
            if x in pairs:
                y, pair_time = pairs[x]
                compute = times.durations[x // m] + times.durations[y // m] - a2a[(x // m) % schedule.num_stages] \
                    - a2a[(y // m) % schedule.num_stages]
                exposed += pair_time - compute
            elif x < 2 * per_kind and x not in paired_backwards:  # an F or a B alone
                exposed += a2a[(x // m) % schedule.num_stages]
        out.append(round(exposed, 9))
    return tuple(out)


def _vocab_buffer_events(schedule: Schedule, costs: Costs, times: ProgramTimes) -> list[list[tuple[float, float]]]:
    """Per device, (time, change) of the embedding's buffers (:func:`.vocab_embedding.buffer_events`: the first
    stage's embeddings and gradients, every device's tokens) and of the hidden gradient's send buffers
    (:func:`.vocab_embedding.send_events`), in the memory timeline's units; empty lists without vocabulary
    passes or without their ``embedding`` / ``tokens`` / ``send`` memory."""
    vocab = costs.vocab
    if not schedule.vocab_parallel or vocab is None or not (vocab.embedding or vocab.tokens or vocab.send):
        return [[] for _ in times.programs]
    first = schedule.placement.device_of(0)
    last = schedule.placement.device_of(schedule.num_stages - 1)
    sends = send_events(schedule.programs, last) if vocab.send else [()] * len(times.programs)
    out = []
    for ids, events, changes in zip(times.programs, buffer_events(schedule.programs, first, training=True), sends):
        timed = []
        for event in events:
            if event.index < len(ids):
                x = ids[event.index]
                at = times.end[x] if event.at_end else times.start[x]
            else:  # the call's end
                at = max((times.end[x] for x in ids), default=0.0)
            # In units of one microbatch over L/d layers, like the passes' deltas (one V chunk F is half of one).
            timed.append((at, (event.embeddings * vocab.embedding + event.tokens * vocab.tokens) / 2.0))
        # A send buffer is made at its H's start and let go at the start of the next H or of G(k).
        timed += [(times.start[ids[index]], change * vocab.send / 2.0) for index, change in changes]
        out.append(timed)
    return out


def _memory_timeline(times: ProgramTimes, program: list[int], deltas,
                     extra: list[tuple[float, float]] = ()) -> tuple[tuple[float, float], ...]:
    """Activation memory of one device after each allocation/release event, in units.

    F (and a vocabulary H) allocates at its start; B and W (and G) release at their end. Releases at
    the same instant as an allocation are applied first. A device runs its program in order, so its
    allocations and its releases each come in time order already: merging the two is enough (no sort).
    ``extra``: more (time, change) events (the embedding's buffers), merged in time order (a release first
    at equal times).
    """
    per_kind = times.ids.per_kind
    m = times.ids.num_microbatches
    start, end = times.start, times.end
    # F and H allocate (ids below per_kind, or in [3, 4) x per_kind); the test is inline, not a function: this
    # runs for every pass of every simulation.
    h_from, h_to = 3 * per_kind, 4 * per_kind
    allocs = [(start[x], deltas[x // m]) for x in program if x < per_kind or h_from <= x < h_to]
    releases = [(end[x], deltas[x // m]) for x in program if not (x < per_kind or h_from <= x < h_to)]
    releases = [event for event in releases if event[1]]
    if extra:
        allocs = sorted(allocs + [e for e in extra if e[1] > 0], key=lambda e: e[0])
        releases = sorted(releases + [e for e in extra if e[1] < 0], key=lambda e: e[0])
    # Merge (releases first at equal times: a stable sort of the releases, then the allocations, both in time
    # order already, is that merge, done in C), then the running level (accumulated from 0.0 in the same order
    # as a loop would, rounded alike).
    merged = sorted(releases + allocs, key=_time_of)
    levels = map(round, accumulate([delta for _, delta in merged], initial=0.0), repeat(9))
    return tuple(zip(chain((0.0,), [time for time, _ in merged]), levels))


_time_of, _level_of = itemgetter(0), itemgetter(1)
