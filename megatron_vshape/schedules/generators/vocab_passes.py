"""Placing the vocabulary passes into a schedule (vocabulary parallelism: Yeung et al., MLSys 2025).

Under vocabulary parallelism the output layer and the loss are spread over every pipeline device, so
the transformer schedule is generated for the layers alone (any generator, unchanged) and this pass
adds, for every microbatch k, one H pass on every device (the shard's output layer and loss, forward
and input gradient: a collective pass, every device's H of k runs together) and one G pass (the
shard's weight gradient).

**H.** Time the transformer schedule. Let t_k be the end of the last stage's F(k). On the last
stage's device H(k) goes right after F(k) (B(k) needs it). On every other device it goes before its
first pass still running at t_k, or after that pass, whichever makes the rendezvous wait less in
total: breaking before costs this device the time from that pass's start to t_k; breaking after costs
every other device the rest of that pass. Each H column then shifts what follows on every device
alike, so the transformer timeline places all of them. On uniform stages the boundaries of 1F1B's and
the V schedules' steady states line up and H costs its own duration only. Every device meets the H
passes in one order (the last stage's forwards'), which the collectives need.

**G.** Right after its H where the schedule fuses its backward, and where it keeps activation memory
low (V-Min, V-Half: a deferred G holds the logits' gradient). Elsewhere (zero-bubble schedules) a G
fills an idle gap of its device after its H, as the zero-bubble schedules' own W passes do, with at most
``MAX_DEFERRED_G`` waiting at a time; what no gap takes runs right after its H.
"""

from __future__ import annotations

import bisect
from dataclasses import replace

from ..core.actions import Action, Kind, VocabKind
from ..core.inputs import EPS
from ..core.schedule import Costs, Schedule, vocab_pass_times
from ..core.simulator import simulate


def with_vocab_passes(schedule: Schedule, costs: Costs, gaps_for_g: bool) -> Schedule:
    """``schedule`` (transformer passes only) with every shard's H and G of every microbatch placed.

    ``costs.vocab``: the vocabulary work; ``gaps_for_g``: G passes may wait for idle gaps (zero-bubble
    schedules) instead of running right after their H.
    """
    if schedule.vocab_parallel:
        return schedule
    d, m = schedule.num_devices, schedule.num_microbatches
    last = schedule.num_stages - 1
    holder = schedule.placement.device_of(last)
    timeline = simulate(schedule, costs.without_vocab()).timeline
    order = sorted(range(m), key=lambda k: timeline[Action(Kind.F, last, k)].end)
    programs = []
    for device, program in enumerate(schedule.programs):
        ends = [timeline[action].end for action in program]
        where: dict[int, list[int]] = {}  # index in the transformer program -> the H placed before it
        lowest = 0
        for k in order:
            if device == holder:
                at = program.index(Action(Kind.F, last, k)) + 1
            else:
                at = _break_point(program, ends, timeline, timeline[Action(Kind.F, last, k)].end, lowest, d)
            lowest = max(at, lowest)
            where.setdefault(lowest, []).append(k)
        row: list[Action] = []
        for i in range(len(program) + 1):
            row.extend(Action(VocabKind.H, device, k) for k in where.get(i, ()))
            if i < len(program):
                row.append(program[i])
        programs.append(tuple(row))
    with_h = replace(schedule, programs=tuple(programs), vocab_parallel=True,
                     meta={**schedule.meta, "vocab_parallel": True})
    return _place_g(with_h, costs, gaps_for_g and not schedule.fused_backward)


def _break_point(program, ends: list[float], timeline, t: float, lowest: int, devices: int) -> int:
    """Where a device that does not hold the last stage joins the rendezvous at ``t``: before its first
    pass still running at ``t`` (ending after it), or after that pass when that waits less in total."""
    running = bisect.bisect_right(ends, t + EPS, lo=lowest)  # first pass ending after t
    if running >= len(program):
        return len(program)
    span = timeline[program[running]]
    if span.start >= t - EPS:
        return running  # idle or at a boundary at t: join there
    wait_here = t - span.start  # it breaks before the pass and idles until the others arrive
    wait_others = (span.end - t) * (devices - 1)
    return running if wait_here <= wait_others else running + 1


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
