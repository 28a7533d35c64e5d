"""Reordering the warm-up and cool-down of a squeezed schedule without raising any peak.

A repeated building block leaves idle time where a device waits for an input (mostly in the
warm-up and the cool-down). This pass replays each device's order in time and, whenever the
next pass is not ready, starts instead the first pass within a short look-ahead that *is*
ready, provided that running it early keeps every prefix of the device's remaining order at or
below the device's original peak. In the steady state nothing waits, so nothing moves there.
Memory is the shared ledger's count under the given :class:`MemoryModel` (the simulator's), and
ready times follow the timing core's rule (``ready.ready_rule``).
"""

from __future__ import annotations

import heapq

from ..core.actions import Action
from ..core.inputs import EPS as _EPS
from ..core.ledger import MemoryLedger
from ..core.ready import ready_rule
from ..core.schedule import Costs, MemoryModel, Schedule
from ..core.timing import KINDS, UNSET, PassIds


def fill_idle(
    schedule: Schedule, costs: Costs, peaks: list[float], lookahead: int, memory: MemoryModel = MemoryModel()
) -> tuple[Schedule, float, list[float]]:
    """A new order for ``schedule`` (same passes) that fills waits with ready passes, keeping
    each device within ``peaks`` counted under ``memory``.

    Returns the new schedule with the makespan and per-device peak of the replay that built it
    (the replay starts every pass as soon as its device and inputs allow, like the simulator; the
    peak is what ``simulate(..., memory=memory)`` reports).
    """
    placement = schedule.placement
    num_stages = schedule.num_stages
    ledger = MemoryLedger(placement, costs, memory)
    level = ledger.level
    ids = PassIds(num_stages, schedule.num_microbatches)
    stage_device = [placement.device_of(s) for s in range(num_stages)]
    remaining = [list(program) for program in schedule.programs]
    # Each pass's flat id and memory change, computed once (the look-ahead reads them again and again).
    remaining_ids = [[ids.of(action) for action in program] for program in remaining]
    # Each (kind, stage)'s time (``pass_cost``), read per pass id // microbatches (a call per pass cost more).
    row_cost = [schedule.pass_cost(Action(kind, stage, 0), costs) for kind in KINDS for stage in range(num_stages)]
    m = schedule.num_microbatches
    remaining_deltas = [[ledger.delta(action.kind, action.stage) for action in program] for program in remaining]
    end_time = [UNSET] * (3 * ids.per_kind)
    ready_of = ready_rule(stage_device, schedule.num_microbatches, costs.comm)
    free_at = [0.0] * schedule.num_devices
    order: list[list[Action]] = [[] for _ in schedule.programs]
    first_start: list[float | None] = [None] * schedule.num_devices
    events = [0.0]
    now = 0.0
    left = sum(len(p) for p in remaining)
    # A device whose look-ahead found nothing to start stays so until ``now`` reaches the earliest ready time
    # it saw, or the end of a pass placed since that may feed it (a pass is ready no earlier than its inputs
    # end): ``wake``. Only then is it scanned again (the same choices as scanning at every event, without the
    # repeated scans: its look-ahead, level and inputs change only with those).
    wake = [0.0] * schedule.num_devices
    inf = float("inf")

    # Per pass id: its ready time once every input is placed (it never changes after), else UNSET; and the
    # input it last waited for (-1: none seen), so that a scan asks the rule again only once that one is placed.
    known = [UNSET] * len(end_time)
    waits_on = [-1] * len(end_time)

    def pick(device: int) -> int | None:
        todo_ids, todo_deltas = remaining_ids[device], remaining_deltas[device]
        running = 0.0  # cumulative memory change of the passes a pulled pass would jump over
        worst = 0.0
        earliest = inf
        # Read once per scan (none of them changes during it; the same sums as written out in the loop).
        limit, held, cap = now + _EPS, level[device], peaks[device] + _EPS
        for index in range(min(lookahead + 1, len(todo_ids))):
            x = todo_ids[index]
            ready = known[x]
            if ready < 0:
                missing = waits_on[x]
                if missing < 0 or end_time[missing] >= 0:
                    ready = ready_of(x, end_time)  # < 0: an input is missing
                    if ready >= 0:
                        known[x] = ready
                    else:
                        waits_on[x] = int(-1.0 - ready)
            change = todo_deltas[index]
            if 0 <= ready <= limit:
                if index == 0 or held + change + worst <= cap:
                    return index
            elif ready >= 0 and ready < earliest:
                earliest = ready
            running += change
            if running > worst:
                worst = running
        # Only the earliest ready time is an event for this device: it is scanned no sooner (``wake``), and
        # that scan pushes the next one. (Pushing every ready time it saw, as before, gave the same scans at the
        # same instants: a device is scanned only at its own wake or when it becomes free, both events either
        # way; the heap held each pass's ready time once per scan.)
        wake[device] = earliest
        if earliest < inf:
            heapq.heappush(events, earliest)
        return None

    while left:
        limit = now + _EPS
        for device in range(schedule.num_devices):
            if free_at[device] > limit or not remaining[device] or limit < wake[device]:
                continue
            index = pick(device)
            if index is None:
                continue
            action = remaining[device].pop(index)
            x = remaining_ids[device].pop(index)
            remaining_deltas[device].pop(index)
            end = now + row_cost[x // m]
            end_time[x] = end
            free_at[device] = end
            ledger.apply(device, action.kind, action.stage)
            if first_start[device] is None:
                first_start[device] = now
            order[device].append(action)
            heapq.heappush(events, end)
            heapq.heappush(events, end + costs.comm)
            left -= 1
            # The passes this one feeds are on the devices of its stage and the stages beside it.
            stage = action.stage
            for neighbour in (stage - 1, stage, stage + 1):
                if 0 <= neighbour < num_stages and end < wake[stage_device[neighbour]]:
                    wake[stage_device[neighbour]] = end
        while events and events[0] <= now + _EPS:
            heapq.heappop(events)
        if left and not events:  # cannot happen for a valid input order; fail loudly if it does
            raise RuntimeError(f"{schedule.name}: reorder stalled")
        if events:
            now = events[0]
    reordered = Schedule(schedule.name, placement, schedule.num_microbatches, tuple(map(tuple, order)),
                         dict(schedule.meta), schedule.fused_backward)
    makespan = max(free_at[d] - (first_start[d] or 0.0) for d in range(schedule.num_devices))
    return reordered, makespan, list(ledger.peak)
