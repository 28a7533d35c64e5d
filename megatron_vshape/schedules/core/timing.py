"""The timing core: start and end of every pass when each device runs its program in order.

A pass starts when its device is free and its inputs are there; an input from another device
also pays ``costs.comm``. Passes are numbered ``(kind * num_stages + stage) * m + microbatch``
so that times live in flat lists and the inputs of a pass are found by arithmetic (hashing
hundreds of thousands of Action tuples was most of the simulator's time at d=64, m=512).

Event driven like :func:`drive.drive`: a device that waits for an input registers on it and is
woken when it is produced, so the cost is linear in the number of passes.

The ready-time rule is :mod:`ready`'s: its table (``input_table``), which the generators' rule
function also reads.

Vocabulary passes (``vocab_shards`` > 0) add the kinds H and G after F, B, W (ids ``(kind *
num_stages + shard) * m + microbatch``, shard < num_stages). H is a collective pass: a device that
reaches H of microbatch k waits there until every device has (one rendezvous of the pipeline group
on one in-order queue), and then all start together.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

from .actions import Action, Kind, VocabKind
from .ready import UNSET, input_table

KIND_INDEX = {Kind.F: 0, Kind.B: 1, Kind.W: 2, VocabKind.H: 3, VocabKind.G: 4}
KINDS = (Kind.F, Kind.B, Kind.W)
ALL_KINDS = (*KINDS, VocabKind.H, VocabKind.G)  # flat-id order with vocabulary passes


class Interval(NamedTuple):
    """Where and when one pass ran. A named tuple, not a dataclass: the planner's memory count reads every
    pass's interval of every simulated plan (4 million at the 1024-GPU GPT-3 plan, where a frozen dataclass's
    constructor and the generator around it were about 5 % of the profile: issue 44)."""

    device: int
    start: float
    end: float


# Interval from a (device, start, end) tuple without the named tuple's Python-level __new__.
_new_interval = partial(tuple.__new__, Interval)


class PassIds:
    """The numbering of (kind, stage, microbatch) used by the flat time lists."""

    def __init__(self, num_stages: int, num_microbatches: int):
        self.num_stages, self.num_microbatches = num_stages, num_microbatches
        self.per_kind = num_stages * num_microbatches

    def of(self, action: Action) -> int:
        kind, stage, microbatch = action
        if not (0 <= stage < self.num_stages and 0 <= microbatch < self.num_microbatches):
            return -1
        return (KIND_INDEX[kind] * self.num_stages + stage) * self.num_microbatches + microbatch

    def action(self, pass_id: int) -> Action:
        kind, rest = divmod(pass_id, self.per_kind)
        stage, microbatch = divmod(rest, self.num_microbatches)
        return Action(ALL_KINDS[kind], stage, microbatch)


@dataclass
class ProgramTimes:
    """Result of running the programs: flat start/end lists, each program as pass ids, and the
    programs' cursors (a cursor short of its program's length means that device is stuck)."""

    ids: PassIds
    programs: list[list[int]]
    start: list[float]
    end: list[float]
    cursor: list[int]
    durations: tuple[float, ...]  # indexed by kind * num_stages + stage (pass id // microbatches)

    @property
    def stuck(self) -> list[int]:
        return [dev for dev, program in enumerate(self.programs) if self.cursor[dev] < len(program)]


def run_programs(
    programs, device_of_stage, num_stages: int, num_microbatches: int,
    durations, comm: float, fused_backward: bool = False, vocab_shards: int = 0,
    pairs: Mapping[int, tuple[int, float]] | None = None,
) -> ProgramTimes:
    """As-soon-as-possible execution of every device's program in order.

    ``durations``: (F, B, W) for every stage alike, or one time per (kind, stage), indexed by
    ``kind * num_stages + stage`` (see :func:`stage_durations`; with vocabulary passes, 5 kinds). With
    ``fused_backward`` a B waits for the W of the stage after it (the gradient leaves only when that
    fused B+W ends). ``vocab_shards``: the programs hold vocabulary passes, shard r on device r.
    ``pairs``: overlapped F&B pairs, the F's pass id -> (the B's pass id, the pair's time) (see
    :func:`run_id_programs`).
    """
    durations = tuple(durations)
    if len(durations) == 3:
        durations = stage_durations([durations] * num_stages)
    ids = PassIds(num_stages, num_microbatches)
    table = input_table(device_of_stage, num_microbatches, comm, fused_backward, vocab_shards)
    return run_id_programs([_ids_of(program, ids) for program in programs], ids, durations, table, vocab_shards,
                           pairs=pairs)


@dataclass(frozen=True)
class TimedPrefix:
    """The first ``cursor[d]`` passes of every device's program, timed and final: ``end`` (and ``start``)
    hold their times, UNSET for every other pass; device d is free from ``free[d]``. Timing resumes from
    here (:func:`run_id_programs`) when only what follows the prefixes changes."""

    cursor: tuple[int, ...]
    free: tuple[float, ...]
    start: list[float]
    end: list[float]


def run_id_programs(id_programs: list[list[int]], ids: PassIds, durations: tuple[float, ...], table,
                    vocab_shards: int = 0, prefix: TimedPrefix | None = None, horizon_pass: int = -1,
                    solo_pass: int = -1, pairs: Mapping[int, tuple[int, float]] | None = None) -> ProgramTimes:
    """:func:`run_programs` on programs of pass ids, its input table given; from ``prefix`` when given
    (the passes in it are not timed again; the lists are copied). With ``horizon_pass`` (a pass id) the run
    stops early: once that pass is timed, a device stops when it is free later than the pass's end plus the
    longest pass and message (every pass starting by then is timed, the rest are left UNSET and the
    device's cursor short: a caller that looks only that far ahead pays for no more). ``solo_pass``: a
    collective pass (an H) that runs alone on its device, as soon as its device and inputs allow, without
    waiting for the other shards (a relaxation: nothing ends later than with the rendezvous).
    ``pairs``: F pass id -> (B pass id, time) of overlapped pairs, the B right after its F in the program: the
    pair starts when the device is free and both passes' inputs are there, and both end together (the F's
    output and the B's gradient leave when the pair ends)."""
    m, per_kind = ids.num_microbatches, ids.per_kind
    kinds = 5 if vocab_shards else 3
    if prefix is None:
        start = [0.0] * (kinds * per_kind)
        end = [UNSET] * (kinds * per_kind)
        cursor, free = [0] * len(id_programs), [0.0] * len(id_programs)
    else:
        start, end = list(prefix.start), list(prefix.end)
        cursor, free = list(prefix.cursor), list(prefix.free)
    # The shared ready-time rule's table (ready.input_table), read inline: see ready.py.
    _, first, first_delay, second, second_delay = table
    # Collective passes (H) have ids in [first_collective, end_collective); without vocabulary passes no id
    # reaches first_collective, so the hot loop pays one comparison.
    first_collective = 3 * per_kind if vocab_shards else len(end)
    end_collective = 4 * per_kind
    arrived: dict[int, list[tuple[int, float, int]]] = {}  # microbatch -> (device, ready, pass id) at its H
    # The H passes whose device has arrived (each device's H of a microbatch has its own id; a set, not a scan of
    # ``arrived``: a device queued again while it waits asks once per queueing, d times per rendezvous).
    waiting_at_h: set[int] = set()
    waiters: dict[int, list[int]] = {}
    horizon = math.inf
    slack = max(durations) + max(max(first_delay), max(second_delay)) if horizon_pass >= 0 else 0.0
    queue = deque(range(len(id_programs)))
    while queue:
        device = queue.popleft()
        program, c, now = id_programs[device], cursor[device], free[device]
        length = len(program)
        while c < length:
            if now > horizon:
                break  # past the horizon: left untimed (nothing the caller reads waits on it)
            x = program[c]
            if x < 0:
                break  # not a pass of this schedule: stays stuck
            k = x // m
            ready = now
            offset = first[k]
            if offset:
                e = end[x - offset]
                if e < 0:  # an input is not there yet: wait for it
                    waiters.setdefault(x - offset, []).append(device)
                    break
                e += first_delay[k]
                if e > ready:
                    ready = e
            offset = second[k]
            if offset:
                e = end[x - offset]
                if e < 0:
                    waiters.setdefault(x - offset, []).append(device)
                    break
                e += second_delay[k]
                if e > ready:
                    ready = e
            if pairs and x in pairs:
                y, pair_time = pairs[x]
                missing, ready = _pair_ready(y, ready, end, table)
                if missing >= 0:
                    waiters.setdefault(missing, []).append(device)
                    break
                start[x] = start[y] = ready
                now = end[x] = end[y] = ready + pair_time
                if waiters:
                    for z in (x, y):
                        woken = waiters.pop(z, None)
                        if woken:
                            queue.extend(woken)
                c += 2
                continue
            if x >= first_collective and x < end_collective and x != solo_pass:
                if x in waiting_at_h:
                    break  # already waiting at this rendezvous (queued again meanwhile)
                waiting_at_h.add(x)
                arrivals = arrived.setdefault(x % m, [])
                arrivals.append((device, ready, x))
                if len(arrivals) < vocab_shards:
                    break  # the others are not there yet: the last to arrive releases everyone
                ready = max(entry[1] for entry in arrivals)
                for other, _, y in arrivals:
                    start[y] = ready
                    end[y] = ready + durations[y // m]
                    if other != device:
                        cursor[other] += 1
                        free[other] = end[y]
                        queue.append(other)
                        woken = waiters.pop(y, None)
                        if woken:
                            queue.extend(woken)
            start[x] = ready
            now = ready + durations[k]
            end[x] = now
            if x == horizon_pass:
                horizon = now + slack
            if waiters:
                woken = waiters.pop(x, None)
                if woken:
                    queue.extend(woken)
            c += 1
        cursor[device], free[device] = c, now
    return ProgramTimes(ids, id_programs, start, end, cursor, durations)


def _pair_ready(y: int, ready: float, end: list[float], table) -> tuple[int, float]:
    """(-1, when the pair's F (ready at ``ready``) and B ``y`` can both start), or (a missing input of y, _)."""
    m, first, first_delay, second, second_delay = table
    k = y // m
    for offsets, delays in ((first, first_delay), (second, second_delay)):
        offset = offsets[k]
        if offset:
            e = end[y - offset]
            if e < 0:
                return y - offset, ready
            e += delays[k]
            if e > ready:
                ready = e
    return -1, ready


def stage_durations(per_stage, vocab: tuple[float, float] | None = None, vocab_shards: int = 0) -> tuple[float, ...]:
    """The flat duration table of :func:`run_programs` from ``per_stage[s] = (F, B, W)``; ``vocab``: the
    (H, G) time of each of ``vocab_shards`` shards (the rest of those kinds' rows is unused)."""
    table = tuple(times[kind] for kind in range(3) for times in per_stage)
    if vocab is None:
        return table
    return table + vocab_rows(vocab, vocab_shards, len(per_stage))


def vocab_rows(values, shards: int, num_stages: int) -> tuple[float, ...]:
    """The H and G rows of a flat (kind, stage) table: ``values`` = (H's, G's), each one value for every
    shard or a tuple of one per shard (shard r is row r), the rest of each row unused (0)."""
    pad = (0.0,) * (num_stages - shards)

    def row(value) -> tuple[float, ...]:
        return tuple(value) if isinstance(value, tuple) else (value,) * shards

    return row(values[0]) + pad + row(values[1]) + pad


def _ids_of(program, ids: PassIds) -> list[int]:
    s_count, m = ids.num_stages, ids.num_microbatches
    kind_index = KIND_INDEX
    out = [(kind_index[kind] * s_count + stage) * m + mb for kind, stage, mb in program]
    if out:
        # Every stage and microbatch in range (min and max over the columns, in C: a generator over the passes
        # ran 9 million steps in that plan); else, rarely, foreign passes get -1 (stuck).
        _, stages, microbatches = zip(*program)
        if not (0 <= min(stages) and max(stages) < s_count and 0 <= min(microbatches) and max(microbatches) < m):
            out = [ids.of(action) for action in program]
    return out


class Timeline(Mapping):
    """Action -> Interval over a :class:`ProgramTimes`, built on access (a dict of 200k
    Intervals at d=64, m=512 cost more than the whole timing run)."""

    def __init__(self, times: ProgramTimes, programs):
        self._times, self._programs = times, programs
        self._device: dict[int, int] | None = None

    def _device_of(self, pass_id: int) -> int | None:
        if self._device is None:
            self._device = {x: dev for dev, program in enumerate(self._times.programs) for x in program}
        return self._device.get(pass_id)

    def __getitem__(self, action: Action) -> Interval:
        x = self._times.ids.of(action)
        device = self._device_of(x) if x >= 0 else None
        if device is None or self._times.end[x] < 0:
            raise KeyError(action)
        return _new_interval((device, self._times.start[x], self._times.end[x]))

    def __iter__(self) -> Iterator[Action]:
        for program in self._programs:
            yield from program

    def __len__(self) -> int:
        return sum(len(program) for program in self._programs)

    def items(self) -> list[tuple[Action, Interval]]:
        times, out = self._times, []
        start, end = times.start, times.end
        for device, (program, id_program) in enumerate(zip(self._programs, times.programs)):
            out.extend([(action, _new_interval((device, start[x], end[x]))) for action, x in zip(program, id_program)])
        return out

    def values(self) -> list[Interval]:
        return [interval for _, interval in self.items()]
