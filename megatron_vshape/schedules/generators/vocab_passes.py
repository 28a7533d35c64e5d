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
rendezvous meet early. On uniform stages the boundaries of 1F1B's and the V schedules' steady states line
up and H costs its own duration only.

**G.** Right after its H where the schedule fuses its backward, and where it keeps activation memory
low (V-Min, V-Half: a deferred G holds the logits' gradient). Elsewhere (zero-bubble schedules) a G
fills an idle gap of its device after its H, as the zero-bubble schedules' own W passes do, with at most
``MAX_DEFERRED_G`` waiting at a time; what no gap takes runs right after its H.
"""

from __future__ import annotations

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

    def run(self, programs: list[list[int]], prefix: TimedPrefix | None, n: int | None = None,
            solo: int = -1) -> ProgramTimes:
        """The programs timed from ``prefix``; with ``n``, only as far as the n-th rendezvous's trials look:
        to a little past the end of the last stage's next forward (its pace; every pass starting by then).
        ``solo``: an H that runs without its rendezvous (``run_id_programs``' relaxation)."""
        horizon = self.forwards[n + 1] if n is not None and n + 1 < len(self.forwards) else -1
        return run_id_programs(programs, self.ids, self.durations, self.table, self.num_devices, prefix, horizon,
                               solo)

    def relaxed_pace(self, trial: _Trial, prefix: TimedPrefix, n: int) -> float:
        """A lower bound on the pace of every trial of rendezvous n + 1 after ``trial``: the end of the last
        stage's next forward with that rendezvous's H on the last stage's device alone, run without waiting
        for the other shards, and on no other device (fewer constraints: nothing ends later). -1 if that
        forward is not timed."""
        programs = list(trial.programs)
        holder = list(programs[self.holder])
        forward = self.forwards[n + 1]
        h = self.ids.of(Action(VocabKind.H, self.holder, forward % self.m))
        holder.insert(holder.index(forward) + 1, h)
        programs[self.holder] = holder
        return self.run(programs, prefix, n + 1, solo=h).end[self.forwards[n + 2]]

    def trials(self, programs: list[list[int]], times: ProgramTimes, prefix: TimedPrefix | None,
               n: int) -> list[_Trial]:
        """Every place for the n-th rendezvous that its meeting times give (``_meeting_times``)."""
        forward = self.forwards[n]
        k = forward % self.m
        lowest = prefix.cursor if prefix else (0,) * self.num_devices
        after = programs[self.holder].index(forward) + 1  # the last stage's H: right after its F
        out, seen = [], set()
        for meet in _meeting_times(programs, times, lowest, times.end[forward], self.holder):
            breaks = tuple(after if device == self.holder
                           else _passes_by(program, times.end, lowest[device], times.cursor[device], meet)
                           for device, program in enumerate(programs))
            if breaks in seen:
                continue  # another meeting time gave the same places: the same trial
            seen.add(breaks)
            trial = [[*program[:at], self.ids.of(Action(VocabKind.H, device, k)), *program[at:]]
                     for device, (program, at) in enumerate(zip(programs, breaks))]
            trial_times = self.run(trial, prefix, n)
            if trial_times.end[trial[self.holder][after]] < 0:
                continue  # H never meets: a device waits, before its H, on a pass that follows another's H
            pace = (trial_times.end[self.forwards[n + 1]] if n + 1 < len(self.forwards)
                    else max(trial_times.end[program[-1]] for program in trial))
            if pace >= 0:
                out.append(_Trial(pace, breaks, trial, trial_times))
        return out

    def best(self, trials: list[_Trial], n: int) -> tuple[_Trial, list[_Trial] | None]:
        """The trial whose next rendezvous can come earliest (then the earliest pace itself): one step of
        look-ahead, because a rendezvous that meets late can let the next one meet early. Returned with the
        next rendezvous's trials after it where the look-ahead timed them (the next step starts from them)."""
        if len(trials) == 1 or n + 1 == len(self.forwards):
            return min(trials, key=lambda trial: round(trial.pace, 9)), None
        # The same choice as looking ahead from every trial, with fewer runs: trials go in order of their own
        # pace, and one whose next rendezvous cannot come before the best found so far is not looked ahead
        # from. Its next pace (the end of the last stage's forward after next) is at least its own pace plus
        # what the last stage's device runs in between, the next H included (one pass after another), and at
        # least its relaxed pace (``relaxed_pace``: one run).
        busy = self._busy_to_next_pace(trials[0].programs[self.holder], n)
        best: tuple[tuple[float, float], int] | None = None
        best_ahead: list[_Trial] | None = None
        for i in sorted(range(len(trials)), key=lambda i: (round(trials[i].pace, 9), i)):
            trial = trials[i]
            if best is not None and busy is not None and trial.pace + busy - _BOUND_MARGIN > best[0][0]:
                continue
            prefix = _prefix_through(trial)
            if best is not None and busy is not None and self.relaxed_pace(trial, prefix, n) - _BOUND_MARGIN > best[0][0]:
                continue  # one run instead of one per trial of the next rendezvous
            ahead = self.trials(trial.programs, trial.times, prefix, n + 1)
            key = (round(min((t.pace for t in ahead), default=float("inf")), 9), round(trial.pace, 9))
            if best is None or (key, i) < best:
                best, best_ahead = (key, i), ahead
        return trials[best[1]], best_ahead

    def _busy_to_next_pace(self, program: list[int], n: int) -> float | None:
        """What the last stage's device runs from the end of its forward of rendezvous n + 1 to the end of
        its next one: the passes in between, that rendezvous's H and the forward itself (None: no next)."""
        if n + 2 >= len(self.forwards):
            return None
        at, to = program.index(self.forwards[n + 1]), program.index(self.forwards[n + 2])
        h = self.ids.of(Action(VocabKind.H, self.holder, self.forwards[n + 1] % self.m))
        return sum(self.durations[x // self.m] for x in program[at + 1:to + 1]) + self.durations[h // self.m]


# Floating-point slack of that bound (times are in units of one pass): a trial is skipped only when its
# bound is later than the best next pace by more than this.
_BOUND_MARGIN = 1e-6


def _place_h(schedule: Schedule, costs: Costs) -> tuple[tuple[Action, ...], ...]:
    """The programs with every shard's H placed, one rendezvous at a time in the last stage's forwards'
    order (see the module's docstring)."""
    placer = _HPlacer(schedule, costs)
    programs = [[placer.ids.of(action) for action in program] for program in schedule.programs]
    times, prefix, ahead = placer.run(programs, None), None, None
    for n in range(len(placer.forwards)):
        trials = ahead if ahead is not None else placer.trials(programs, times, prefix, n)
        if not trials:
            raise ScheduleError(f"{schedule.name}: no place for the vocabulary pass H of microbatch "
                                f"{placer.forwards[n] % placer.m}")
        chosen, ahead = placer.best(trials, n)
        programs, times, prefix = chosen.programs, chosen.times, _prefix_through(chosen)
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


def _passes_by(program: list[int], end: list[float], lowest: int, timed: int, meet: float) -> int:
    """Index in ``program`` after its passes (from ``lowest`` on, of the first ``timed``) that end by ``meet``."""
    at = lowest
    while at < timed and end[program[at]] <= meet + EPS:
        at += 1
    return at


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


# A deferred G keeps its H's logits' gradient shard and hidden state: at most this many wait on a device
# (a gap further away is not used; the G then runs right after its H).
MAX_DEFERRED_G = 2


def _place_g(schedule: Schedule, costs: Costs, into_gaps: bool) -> Schedule:
    """Every shard's G: into idle gaps after its H (``into_gaps``; at most ``MAX_DEFERRED_G`` waiting at a
    time), else right after its H."""
    _, g_time = vocab_pass_times(costs, schedule.num_devices)
    programs = [list(program) for program in schedule.programs]
    if not into_gaps or g_time <= 0:
        return replace(schedule, programs=tuple(map(tuple, _with_g_after_h(programs))))
    timing_costs = replace(costs, vocab=replace(costs.vocab, w=0.0))  # G free: time without them
    timeline = simulate(replace(schedule, programs=tuple(map(tuple, _with_g_after_h(programs)))),
                        timing_costs).timeline
    for device, program in enumerate(programs):
        gaps = []  # (index of the pass after the gap, room) in program order
        for i in range(1, len(program)):
            room = timeline[program[i]].start - timeline[program[i - 1]].end
            if room > EPS:
                gaps.append([i, room])
        extra: dict[int, list[Action]] = {}
        left: list[Action] = []
        h_end = {a.microbatch: timeline[a].end for a in program if a.kind is VocabKind.H}
        h_index = {a.microbatch: i for i, a in enumerate(program) if a.kind is VocabKind.H}
        order = sorted(h_end, key=h_end.get)
        for n, k in enumerate(order):
            g = Action(VocabKind.G, device, k)
            # At most MAX_DEFERRED_G deferred at a time: G(k) runs before the H that many passes later.
            limit = h_index[order[n + MAX_DEFERRED_G]] if n + MAX_DEFERRED_G < len(order) else len(program) + 1
            gap = next((gap for gap in gaps if h_index[k] < gap[0] <= limit and gap[1] >= g_time - EPS), None)
            if gap is None:
                left.append(g)
                continue
            gap[1] -= g_time
            extra.setdefault(gap[0], []).append(g)
        after_h = {g.microbatch: g for g in left}
        out = []
        for i, action in enumerate(program):
            out.extend(extra.get(i, ()))
            out.append(action)
            if action.kind is VocabKind.H and action.microbatch in after_h:
                out.append(after_h[action.microbatch])
        programs[device] = out
    return replace(schedule, programs=tuple(map(tuple, programs)))


def _with_g_after_h(programs: list[list[Action]]) -> list[list[Action]]:
    """Every G right after its H (the schedules that fuse their backward, and V-Min / V-Half)."""
    out = []
    for device, program in enumerate(programs):
        row = []
        for action in program:
            row.append(action)
            if action.kind is VocabKind.H:
                row.append(Action(VocabKind.G, device, action.microbatch))
        out.append(row)
    return out
