"""Placing the vocabulary passes into a schedule (vocabulary parallelism: Yeung et al., MLSys 2025).

Under vocabulary parallelism the output layer and the loss are spread over every pipeline device, so
the transformer schedule is generated for the layers alone (any generator, unchanged) and this pass
adds, for every microbatch k, one H pass on every device (the shard's output layer and loss, forward
and input gradient: a collective pass, every device's H of k runs together) and one G pass (the
shard's weight gradient).

**H.** Each H of microbatch k is a rendezvous of every device, placed one at a time in the order of the
last stage's forwards (every device meets them in that order, which the collectives need). On the last
stage's device H(k) goes right after F(k) (B(k) needs it). Let t_k be that F's end. The rendezvous may
meet at t_k (every other device breaks before its pass running then) or when one device's running pass
ends (every device breaks after the passes it has finished by then): each such meeting time is a trial,
timed from where the H passes placed so far leave every device (a prefix that no later H changes). A
trial is judged by its pace, the end of the last stage's next forward (the next rendezvous can come no
earlier), looking one rendezvous ahead: the trial whose best next trial has the earliest pace wins, then
its own pace. Meeting late can pay: a device that finishes its running pass first may let the next
rendezvous meet early. The choice is that of timing every trial and looking ahead from every one, but a
trial is timed only while a lower bound on its pace (``_Bounds``: the passes before the breaks keep
their times, every device's passes after its H follow it, each after its inputs) can still win. On uniform stages the boundaries of 1F1B's and the V schedules' steady states line
up and H costs its own duration only.

**G.** G(k) needs the loss gradient g(k), which the last stage's device computes in H(k). Every device runs
G(k) after H(k+1) (the next H in the order every device meets them; the last H's G after that H), so that
g(k) rides in H(k+1)'s broadcast of the hidden state (the authors' Algorithm 2; ``lowering/loss_grads.py``)
instead of a collective of its own; the last stage's device, which needs no broadcast, keeps the same order
so that no device reaches a rendezvous a G ahead of the others (``_first_h_before_g``). Each device thus
holds one more microbatch's G inputs (softmax shard and hidden state) than with G right after its H: the
authors' p + 1 microbatches; the memory ledger and the simulator count them (an H allocates, its G frees).
Right after that H where the schedule fuses its backward, and where it keeps activation memory low (V-Min,
V-Half). Elsewhere (zero-bubble schedules) a G fills an idle gap of its device after that H, as the
zero-bubble schedules' own W passes do, up to the H ``MAX_DEFERRED_G`` rendezvous later; what no gap takes
runs right after that H.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

from ..core.actions import Action, Kind, VocabKind
from ..core.inputs import EPS
from ..core.ready import UNSET, input_table
from ..core.schedule import Costs, Schedule, ScheduleError, vocab_pass_times
from ..core.simulator import pass_durations, simulate
from ..core.timing import PassIds, ProgramTimes, TimedPrefix, run_id_programs


def with_vocab_passes(schedule: Schedule, costs: Costs, gaps_for_g: bool) -> Schedule:
    """``schedule`` (transformer passes only) with every shard's H and G of every microbatch placed.

    ``costs.vocab``: the vocabulary work; ``gaps_for_g``: G passes may wait for idle gaps (zero-bubble
    schedules) instead of running right after their H.
    """
    if schedule.vocab_parallel:
        return schedule
    with_h = replace(schedule, programs=_place_h(schedule, costs), vocab_parallel=True,
                     meta={**schedule.meta, "vocab_parallel": True})
    return _place_g(with_h, costs, gaps_for_g and not schedule.fused_backward)


@dataclass(frozen=True)
class _Trial:
    """One place for the H passes of a rendezvous: the programs with them in, timed."""

    pace: float  # the end of the last stage's next forward (the last rendezvous: the makespan)
    breaks: tuple[int, ...]  # where H went into each device's program
    programs: list[list[int]]
    times: ProgramTimes


class _Place:
    """A place for a rendezvous's H passes (``breaks``), timed only when asked (:meth:`timed`): a search that
    rules a place out by a lower bound on its pace never runs it. Two bounds: ``cheap`` (made with the place)
    and :meth:`bound` (at least as high, made when asked: :class:`_Bounds`)."""

    __slots__ = ("breaks", "cheap", "later", "_bounds", "_bound", "_trial", "_prefix_after")

    def __init__(self, bounds: _Bounds, breaks: tuple[int, ...], cheap: float):
        self.breaks, self.cheap, self._bounds = breaks, cheap, bounds
        self._bound: float | None = None
        self._trial: _Trial | None | bool = False  # False: not timed yet; None: H never meets there
        self._prefix_after: TimedPrefix | None = None
        self.later: ProgramTimes | None = None  # the next rendezvous's relaxed run after it (``best``)

    def bound(self) -> float:
        if self._bound is None:
            self._bound = max(self.cheap, self._bounds.pace(self.breaks))
        return self._bound

    def timed(self) -> _Trial | None:
        """The trial, timed (once); None where its H never meets or its pace is not timed."""
        if self._trial is False:
            self._trial = self._bounds.placer.time_trial(self._bounds.programs, self._bounds.prefix,
                                                         self._bounds.n, self.breaks)
        return self._trial

    def prefix_after(self) -> TimedPrefix:
        """:func:`_prefix_through` of the timed trial (kept: the look-ahead and the next step both start there)."""
        if self._prefix_after is None:
            self._prefix_after = _prefix_through(self.timed())
        return self._prefix_after


def _in_order(places: list[_Place], limit) -> Iterator[tuple[int, _Trial]]:
    """(index, trial) of ``places`` that meet, timed in the order of their bounds while a bound is within
    ``_BOUND_MARGIN`` of ``limit()`` (asked again after each: the caller lowers it as it finds better). A
    place is bounded cheaply first, then better, then timed: each only when it comes first."""
    heap = [(place.cheap, i, 0) for i, place in enumerate(places)]
    heapq.heapify(heap)
    while heap and heap[0][0] - _BOUND_MARGIN <= limit():
        _, i, stage = heapq.heappop(heap)
        place = places[i]
        if stage == 0 and limit() < math.inf:  # (nothing to beat yet: timing it is what sets the limit)
            heapq.heappush(heap, (place.bound(), i, 1))
            continue
        trial = place.timed()
        if trial is not None:
            yield i, trial


class _HPlacer:
    """The rendezvous of the H passes, placed one at a time in the last stage's forwards' order: the
    programs are pass ids (timing.PassIds), and every trial is timed from the prefix that the H
    passes placed so far make final."""

    def __init__(self, schedule: Schedule, costs: Costs):
        self.num_devices, self.m = schedule.num_devices, schedule.num_microbatches
        last = schedule.num_stages - 1
        self.holder = schedule.placement.device_of(last)
        self.ids = PassIds(schedule.num_stages, self.m)
        self.table = input_table([schedule.placement.device_of(s) for s in range(schedule.num_stages)], self.m,
                                 costs.comm, schedule.fused_backward, self.num_devices)
        self.durations = pass_durations(schedule, costs, vocab_parallel=True)
        self.forwards = [self.ids.of(a) for a in schedule.programs[self.holder]
                         if a.kind is Kind.F and a.stage == last]
        # Each device's H time (the last stage's device's may be longer: VocabWork.holder).
        self.h_times = [self.durations[self.ids.of(Action(VocabKind.H, device, 0)) // self.m]
                        for device in range(self.num_devices)]
        self.h_time = self.h_times[self.holder]
        stage_device = [schedule.placement.device_of(s) for s in range(schedule.num_stages)]
        # The device of every (kind, stage) row of pass ids (a vocabulary pass's stage index is its shard).
        self.row_device = stage_device * 3 + [*range(self.num_devices), *stage_device[self.num_devices:]] * 2
        # Per (kind, stage) row: its inputs' (pass id offset, delay), those it has (the bounds read them at every
        # pass they follow).
        _, first, first_delay, second, second_delay = self.table
        self.row_inputs = [tuple((offset, delay) for offset, delay in ((first[k], first_delay[k]),
                                                                       (second[k], second_delay[k])) if offset)
                           for k in range(len(first))]
        # Each pass's index in its device's program before any H (once n H passes are placed before it, n
        # more), and per device the time of its passes before each index (a run of passes one after another).
        self.position = [-1] * (5 * self.ids.per_kind)
        self.before: list[list[float]] = []
        for program in schedule.programs:
            before = [0.0]
            for i, action in enumerate(program):
                x = self.ids.of(action)
                self.position[x] = i
                before.append(before[-1] + self.durations[x // self.m])
            self.before.append(before)

    def run(self, programs: list[list[int]], prefix: TimedPrefix | None, n: int | None = None,
            solo: int = -1) -> ProgramTimes:
        """The programs timed from ``prefix``; with ``n``, only as far as the n-th rendezvous's trials look:
        to a little past the end of the last stage's next forward (its pace; every pass starting by then).
        ``solo``: an H that runs without its rendezvous (``run_id_programs``' relaxation)."""
        horizon = self.forwards[n + 1] if n is not None and n + 1 < len(self.forwards) else -1
        return run_id_programs(programs, self.ids, self.durations, self.table, self.num_devices, prefix, horizon,
                               solo)

    def trials(self, programs: list[list[int]], times: ProgramTimes, prefix: TimedPrefix | None,
               n: int, later: list[float] | None = None) -> list[_Place]:
        """Every place for the n-th rendezvous that its meeting times give (``_meeting_times``), in the order
        of those times, untimed. Each one's cheap bound: the rendezvous starts once the last device reaches its
        H (no pass before a break moves earlier than it ran without this H), and the last stage's device then
        runs its H and its passes up to its next forward (to its end after the last H) one after another.
        ``later``: the end of every pass when the programs run without this H as far as its places look (no
        place runs a pass earlier: their better bounds start from these times; ``times`` alone otherwise)."""
        forward = self.forwards[n]
        lowest = prefix.cursor if prefix else (0,) * self.num_devices
        free = prefix.free if prefix else (0.0,) * self.num_devices
        holder = programs[self.holder]
        after = holder.index(forward) + 1  # the last stage's H: right after its F
        to = holder.index(self.forwards[n + 1]) + 1 if n + 1 < len(self.forwards) else len(holder)
        busy = self.h_time + self.before[self.holder][to - n] - self.before[self.holder][after - n]
        t_k = times.end[forward]
        bounds = _Bounds(self, programs, times, prefix, n, after, later)
        out, seen = [], set()
        end, cursor = times.end, times.cursor
        at = list(lowest)  # per device, after its passes that end by the meeting time (later meetings: no fewer)
        at[self.holder] = after
        for meet in _meeting_times(programs, times, lowest, t_k, self.holder):
            for device, program in enumerate(programs):
                if device != self.holder:
                    i, timed = at[device], cursor[device]
                    while i < timed and end[program[i]] <= meet + EPS:
                        i += 1
                    at[device] = i
            breaks = tuple(at)
            if breaks in seen:
                continue  # another meeting time gave the same places: the same trial
            seen.add(breaks)
            arrival = t_k
            for device, (program, i) in enumerate(zip(programs, breaks)):
                reach = end[program[i - 1]] if i > lowest[device] else free[device]
                if reach > arrival:
                    arrival = reach
            out.append(_Place(bounds, breaks, arrival + busy))
        return out

    def time_trial(self, programs: list[list[int]], prefix: TimedPrefix | None, n: int,
                   breaks: tuple[int, ...]) -> _Trial | None:
        """The trial of the n-th rendezvous at ``breaks``, timed; None where its H never meets (a device waits,
        before its H, on a pass that follows another's H) or its pace is not timed."""
        k = self.forwards[n] % self.m
        trial = [program.copy() for program in programs]
        for device, (program, at) in enumerate(zip(trial, breaks)):
            program.insert(at, self.ids.of(Action(VocabKind.H, device, k)))
        trial_times = self.run(trial, prefix, n)
        if trial_times.end[trial[self.holder][breaks[self.holder]]] < 0:
            return None
        pace = (trial_times.end[self.forwards[n + 1]] if n + 1 < len(self.forwards)
                else max(trial_times.end[program[-1]] for program in trial))
        return _Trial(pace, breaks, trial, trial_times) if pace >= 0 else None

    def best(self, places: list[_Place], n: int) -> tuple[_Place, list[_Place] | None]:
        """The place whose next rendezvous can come earliest (then the earliest pace itself, then the first in
        meeting order): one step of look-ahead, because a rendezvous that meets late can let the next one meet
        early. The last rendezvous has no next one: the earliest pace wins. Returned with the next rendezvous's
        places after it where the look-ahead made them (the next step starts from them).

        Branch and bound, with the choice of timing every place and looking ahead from every one: a place is
        timed, and looked ahead from, only while a lower bound on its next pace can still beat the best found
        by more than ``_BOUND_MARGIN``. A place's next pace is at least its own pace plus what the last stage's
        device runs in between (the next H included), at least the next pace of the relaxed run, and at least
        its next places' bounds, which are timed in their order only while one can still be the earliest
        (``_earliest_pace``)."""
        if n + 1 == len(self.forwards):
            chosen: list[tuple[float, int]] = []
            for i, trial in _in_order(places, lambda: chosen[0][0] if chosen else math.inf):
                key = (round(trial.pace, 9), i)
                if not chosen or key < chosen[0]:
                    chosen[:] = [key]
            return self._found(places, chosen[0] if chosen else None), None
        busy = self._busy_to_next_pace(places[0]._bounds.programs[self.holder], n)
        best: list = []  # [(key, index), its next pace unrounded, its next places]
        # Best first over every place's lower bound on its next pace, each made better only when it comes
        # first: its pace's bounds plus ``busy`` (cheap, then better), its pace plus ``busy`` once timed, then the
        # pace the next rendezvous has in the relaxed run (``relaxed``: no next place's pace is earlier), then
        # the look-ahead itself; stopped once every bound is later than the best next pace by the margin.
        heap = [(place.cheap + busy, i, 0) for i, place in enumerate(places)]
        heapq.heapify(heap)
        while heap and heap[0][0] - _BOUND_MARGIN <= (best[1] if best else math.inf):
            key, i, stage = heapq.heappop(heap)
            place = places[i]
            if stage == 0 and best:
                heapq.heappush(heap, (place.bound() + busy, i, 1))
            elif stage <= 1:
                trial = place.timed()
                if trial is not None:
                    heapq.heappush(heap, (max(key, trial.pace + busy), i, 2))
            elif stage == 2:
                place.later = self.relaxed(place.timed().programs, place.prefix_after(), n + 1)
                heapq.heappush(heap, (max(key, self._pace_of(place.later, n + 1)), i, 3))
            else:
                trial = place.timed()
                ahead = self.trials(trial.programs, trial.times, place.prefix_after(), n + 1, place.later.end)
                next_pace = self._earliest_pace(ahead, best[1] if best else math.inf)
                choice = ((round(next_pace, 9), round(trial.pace, 9)), i)
                if not best or choice < best[0]:
                    best[:] = [choice, next_pace, ahead]
        return self._found(places, best[0] if best else None), best[2] if best else None

    def relaxed(self, programs: list[list[int]], prefix: TimedPrefix, n: int) -> ProgramTimes:
        """The programs timed from ``prefix`` as far as the n-th rendezvous's places look, with its H on the last
        stage's device alone, run without waiting for the other shards, and on no other device (fewer
        constraints than every place: no pass ends later there; ``run_id_programs``' ``solo_pass``)."""
        forward = self.forwards[n]
        h = self.ids.of(Action(VocabKind.H, self.holder, forward % self.m))
        holder = list(programs[self.holder])
        holder.insert(holder.index(forward) + 1, h)
        relaxed = list(programs)
        relaxed[self.holder] = holder
        return self.run(relaxed, prefix, n, solo=h)

    def _pace_of(self, times: ProgramTimes, n: int) -> float:
        """The n-th rendezvous's pace in ``times`` (the end of the last stage's next forward; after the last
        H, of every device's last pass), or 0 where not timed."""
        if n + 1 < len(self.forwards):
            return max(times.end[self.forwards[n + 1]], 0.0)
        ends = [times.end[program[-1]] for program in times.programs if program]
        return max(ends) if ends and min(ends) >= 0 else 0.0

    @staticmethod
    def _earliest_pace(places: list[_Place], beat: float) -> float:
        """The earliest pace of ``places``' trials (inf where none meets); or, where none can come within
        ``_BOUND_MARGIN`` of ``beat``, some pace later than that (only places bounded that early are timed)."""
        earliest = [math.inf]
        for _, trial in _in_order(places, lambda: min(earliest[0], beat)):
            earliest[0] = min(earliest[0], trial.pace)
        return earliest[0]

    def _found(self, places: list[_Place], best: tuple | None) -> _Place:
        if best is None:
            raise ScheduleError("no place for a vocabulary pass H")
        return places[best[1]]

    def _busy_to_next_pace(self, program: list[int], n: int) -> float:
        """What the last stage's device runs from the end of its forward of rendezvous n + 1 to the end of its
        next one (after the last, to its end): the passes in between, that rendezvous's H and the forward."""
        at = program.index(self.forwards[n + 1])
        to = program.index(self.forwards[n + 2]) + 1 if n + 2 < len(self.forwards) else len(program)
        return sum(self.durations[x // self.m] for x in program[at + 1:to]) + self.h_time


class _Bounds:
    """Lower bounds on the pace of the n-th rendezvous's places (:meth:`pace`), without timing them.

    Every trial holds the passes timed before this H and more, so no pass of a trial ends earlier than it
    did there (nor than in a run of the same programs without this H: ``later``). At a place, the rendezvous starts once the last device reaches its H; a pass after its
    device's H ends no earlier than that H's end plus the passes from there to it, one after another, nor
    than its inputs' bounds plus their delays and its own time. The pace is the last stage's next forward's;
    after the last H, every device's last pass's."""

    def __init__(self, placer: _HPlacer, programs: list[list[int]], times: ProgramTimes,
                 prefix: TimedPrefix | None, n: int, after: int, later: list[float] | None = None):
        self.placer, self.programs, self.prefix, self.n, self.after = placer, programs, prefix, n, after
        self.parent_end = later if later is not None else times.end
        self.lowest = prefix.cursor if prefix else (0,) * placer.num_devices
        self.free = prefix.free if prefix else (0.0,) * placer.num_devices
        self.t_k = times.end[placer.forwards[n]]
        self.h = placer.ids.of(Action(VocabKind.H, placer.holder, placer.forwards[n] % placer.m))
        self.pace_pass = placer.forwards[n + 1] if n + 1 < len(placer.forwards) else -1
        # The last stage's device after this H, to the pace's pass (to its end after the last H): each pass's
        # time and inputs.
        holder = programs[placer.holder]
        to = holder.index(self.pace_pass) + 1 if self.pace_pass >= 0 else len(holder)
        _, first, first_delay, second, second_delay = placer.table
        self.chain = []
        for x in holder[after:to]:
            k = x // placer.m
            inputs = tuple((x - offset, delay) for offset, delay in ((first[k], first_delay[k]),
                                                                     (second[k], second_delay[k])) if offset)
            self.chain.append((placer.durations[k], inputs))

    def _ended(self, x: int) -> float:
        """Pass ``x``'s end before this H (0 where that run did not time it)."""
        end = self.parent_end[x]
        return end if end > 0.0 else 0.0

    def pace(self, breaks: tuple[int, ...]) -> float:
        placer, n = self.placer, self.n
        m, position, durations, row_device = placer.m, placer.position, placer.durations, placer.row_device
        row_inputs, parent_end = placer.row_inputs, self.parent_end
        arrival = self.t_k
        for device, (program, at) in enumerate(zip(self.programs, breaks)):
            if device != placer.holder:
                reach = self._ended(program[at - 1]) if at > self.lowest[device] else self.free[device]
                if reach > arrival:
                    arrival = reach
        ended = [arrival + h for h in placer.h_times]  # no device's H ends earlier
        bound: dict[int, float] = {self.h: ended[placer.holder]}

        def ends(x: int) -> float:
            """``x``'s bound, its inputs' first (a stack, not recursion: the chains run through every stage)."""
            stack = [x]
            while stack:
                y = stack[-1]
                if y in bound:
                    stack.pop()
                    continue
                k = y // m
                device = row_device[k]
                index = position[y] + n if position[y] >= 0 else -1
                got = parent_end[y]  # (``_ended``, inline: the hottest line of the H placement)
                if not got > 0.0:
                    got = 0.0
                if index < breaks[device]:  # before its device's H: timed before this H, or in the prefix
                    bound[stack.pop()] = got
                    continue
                inputs = row_inputs[k]
                waiting = len(stack)
                for offset, _ in inputs:
                    if y - offset not in bound:
                        stack.append(y - offset)
                if len(stack) > waiting:
                    continue
                before = placer.before[device]
                got = max(got, ended[device] + before[index + 1 - n] - before[breaks[device] - n])
                ready = 0.0  # (bounds and delays are >= 0)
                for offset, delay in inputs:
                    at = bound[y - offset] + delay
                    if at > ready:
                        ready = at
                bound[stack.pop()] = max(got, ready + durations[k])
            return bound[x]

        # The last stage's device after its H: each pass after the one before it and after its inputs' bounds.
        chained = ended[placer.holder]
        for duration, inputs in self.chain:
            for y, delay in inputs:
                ready = ends(y) + delay
                if ready > chained:
                    chained = ready
            chained += duration
        if self.pace_pass >= 0:
            return max(chained, ends(self.pace_pass))
        makespan = chained
        for device, program in enumerate(self.programs):
            if len(program) > self.lowest[device]:
                makespan = max(makespan, ends(program[-1]))
        for x, got in bound.items():  # and each bounded pass's device runs its later passes after it
            if position[x] >= 0:
                before = placer.before[row_device[x // m]]
                makespan = max(makespan, got + before[-1] - before[position[x] + 1])
        return makespan


# Floating-point slack of these bounds (times are in units of one pass): a place is passed over only when its
# bound is later than what it must beat by more than this (inf: every place timed and looked ahead from).
_BOUND_MARGIN = 1e-6


def _place_h(schedule: Schedule, costs: Costs) -> tuple[tuple[Action, ...], ...]:
    """The programs with every shard's H placed, one rendezvous at a time in the last stage's forwards'
    order (see the module's docstring)."""
    placer = _HPlacer(schedule, costs)
    programs = [[placer.ids.of(action) for action in program] for program in schedule.programs]
    times, prefix, ahead = placer.run(programs, None), None, None
    for n in range(len(placer.forwards)):
        places = ahead if ahead is not None else placer.trials(programs, times, prefix, n)
        try:
            chosen, ahead = placer.best(places, n)
        except ScheduleError:
            raise ScheduleError(f"{schedule.name}: no place for the vocabulary pass H of microbatch "
                                f"{placer.forwards[n] % placer.m}") from None
        trial = chosen.timed()
        programs, times, prefix = trial.programs, trial.times, chosen.prefix_after()
    return tuple(tuple(placer.ids.action(x) for x in program) for program in programs)


def _meeting_times(programs: list[list[int]], times: ProgramTimes, lowest, t_k: float, holder: int) -> list[float]:
    """Where the rendezvous after the last stage's forward (ending at ``t_k``) may start: at ``t_k`` (every
    other device breaks before its pass running then), or when one device's running pass ends (every
    device that has finished its passes by then breaks after them)."""
    meetings = {t_k}
    for device, program in enumerate(programs):
        if device == holder:
            continue
        for i in range(lowest[device], times.cursor[device]):
            if times.end[program[i]] > t_k + EPS:
                meetings.add(times.end[program[i]])
                break
    return sorted(meetings)


def _prefix_through(trial: _Trial) -> TimedPrefix:
    """``trial``'s times kept up to and including its new H on every device (whose end frees every device
    alike), the rest forgotten (they are timed again with the next H in place)."""
    start, end = list(trial.times.start), list(trial.times.end)
    cursor = [at + 1 for at in trial.breaks]
    for device, program in enumerate(trial.programs):
        for x in program[cursor[device]:trial.times.cursor[device]]:
            end[x] = UNSET
    free = tuple(trial.times.end[program[at - 1]] for program, at in zip(trial.programs, cursor))
    return TimedPrefix(tuple(cursor), free, start, end)


# A deferred G keeps its H's softmax shard and hidden state. G(k) may wait for an idle gap until the H this
# many rendezvous after H(k+1), the first H it may follow (below); a gap further away is not used, and the G
# then runs right after H(k+1).
MAX_DEFERRED_G = 2


def _h_order(programs, holder: int) -> list[int]:
    """The microbatches of the H passes in the order every device meets them (the last stage's device's)."""
    return [a.microbatch for a in programs[holder] if a.kind is VocabKind.H]


def _first_h_before_g(order: list[int]) -> dict[int, int]:
    """{k: n}: G(k) goes after H(n), n the H after H(k) in ``order`` (the last H's G: after it), on every device.

    Every device other than the last stage's needs it so that g(k) rides in H(n)'s broadcast instead of one
    of its own (``lowering/loss_grads.py``, the authors' Algorithm 2). The last stage's device computes g(k)
    in H(k) and could run G(k) before H(n), but it keeps the same order: with its G(k) between H(k) and H(n)
    alone, the other devices would reach H(n) one G earlier than it and wait there (V-ZB's simulated bubble
    1.5 points higher at PP 2, 0.4 at PP 4 with 8 microbatches); with every device alike, none does. The
    cost: every device holds one more microbatch's G inputs (softmax shard and hidden state) from H(k) to
    after H(n), which the memory ledger and the simulator count (H allocates, G frees)."""
    return {**dict(zip(order, order[1:])), order[-1]: order[-1]} if order else {}


def _place_g(schedule: Schedule, costs: Costs, into_gaps: bool) -> Schedule:
    """Every shard's G: after the H of :func:`_first_h_before_g`, into an idle gap before the H
    ``MAX_DEFERRED_G`` rendezvous later (``into_gaps``), else right after that H."""
    _, g_time = vocab_pass_times(costs, schedule.num_devices)
    programs = [list(program) for program in schedule.programs]
    order = _h_order(programs, schedule.placement.device_of(schedule.num_stages - 1))
    after = _first_h_before_g(order)
    if not into_gaps or g_time <= 0:
        return replace(schedule, programs=tuple(map(tuple, _with_g_after_h(programs, order))))
    timing_costs = replace(costs, vocab=replace(costs.vocab, w=0.0))  # G free: time without them
    timeline = simulate(replace(schedule, programs=tuple(map(tuple, _with_g_after_h(programs, order)))),
                        timing_costs).timeline
    position = {k: n for n, k in enumerate(order)}
    for device, program in enumerate(programs):
        gaps = []  # (index of the pass after the gap, room) in program order
        for i in range(1, len(program)):
            room = timeline[program[i]].start - timeline[program[i - 1]].end
            if room > EPS:
                gaps.append([i, room])
        extra: dict[int, list[Action]] = {}
        after_h: dict[int, list[Action]] = {}
        h_index = {a.microbatch: i for i, a in enumerate(program) if a.kind is VocabKind.H}
        for k, n in after.items():
            g = Action(VocabKind.G, device, k)
            # G(k) runs before the H MAX_DEFERRED_G rendezvous after H(n).
            later = position[n] + MAX_DEFERRED_G
            limit = h_index[order[later]] if later < len(order) else len(program) + 1
            gap = next((gap for gap in gaps if h_index[n] < gap[0] <= limit and gap[1] >= g_time - EPS), None)
            if gap is None:
                after_h.setdefault(n, []).append(g)
                continue
            gap[1] -= g_time
            extra.setdefault(gap[0], []).append(g)
        out = []
        for i, action in enumerate(program):
            out.extend(extra.get(i, ()))
            out.append(action)
            if action.kind is VocabKind.H:
                out.extend(after_h.get(action.microbatch, ()))
        out.extend(extra.get(len(program), ()))
        programs[device] = out
    return replace(schedule, programs=tuple(map(tuple, programs)))


def _with_g_after_h(programs: list[list[Action]], order: list[int]) -> list[list[Action]]:
    """Every G right after the H of :func:`_first_h_before_g` (the schedules that fuse their backward, and
    V-Min / V-Half): G(k) right after H(k+1), the last H's two G passes right after it."""
    after_h: dict[int, list[int]] = {}
    for k, n in _first_h_before_g(order).items():
        after_h.setdefault(n, []).append(k)
    out = []
    for device, program in enumerate(programs):
        row = []
        for action in program:
            row.append(action)
            if action.kind is VocabKind.H:
                row.extend(Action(VocabKind.G, device, k) for k in after_h.get(action.microbatch, ()))
        out.append(row)
    return out
