"""Overlapped F&B pairs formed in a generated order: the transform the registry applies when ``costs.a2a`` > 0.

An F or a B alone exposes its expert-parallel all-to-all; paired with a B (an F) of another microbatch on the
same device, each all-to-all runs under the other pass's compute (:meth:`Costs.pair_time`). The generators
know nothing of pairs. This takes a family's order as each device's priority list and re-times it as a list
schedule (devices decide in the order of their next start):

* the device's next pass X in its order runs as soon as the device is free and X's inputs are there;
* if X is an F or a B and, among the next ``WINDOW`` passes of the same device, a partner of the other kind
  (another microbatch: passes of one microbatch depend on each other) already has its inputs by then, the
  partner is pulled forward and the two run as one pair, forward first;
* a partner F pulled forward allocates its activation earlier: it is pulled only where every level the device
  passes through until the F's old place stays within the device's cap (the family's bound,
  :func:`family_caps`). A B pulled forward only releases earlier; W passes never move.

Nothing waits for a partner: a pair forms only from passes that are both ready, so the device starts no later
than it would with X alone. The paired order is kept only if it simulates no slower than the family's own
order under the same costs (and then it is the family's order again, with its memory).

Which family order to pair: the registry pairs two, the order built for the passes' compute alone and the one
built with each pass's all-to-all inside it (:func:`a2a_inside`: the order the same run without the flag would
build), and keeps the faster (:func:`faster`). Built for compute alone, the order can lose to the other by up to
5 % where the all-to-all is large or unequal over the stages (2 to 8.7 x F, shares 0.5 / 1.5); so the flag never
makes a run slower than the same schedule without it.
"""

from __future__ import annotations

import dataclasses
import heapq

from ..core.actions import Action, Kind, Pair
from ..core.inputs import EPS
from ..core.ledger import pass_deltas
from ..core.ready import UNSET, ready_rule
from ..core.schedule import Costs, MemoryModel, Schedule, one_f_one_b_peak
from ..core.simulator import DeadlockError, pass_durations, simulate
from ..core.timing import PassIds
from .simulated import simulated

# How far ahead in a device's order a partner is looked for: a V device's steady state cycles through
# F and B of two chunks with their W between (6 passes per microbatch), so two cycles cover every partner
# the order offers without reordering far.
WINDOW = 12


def family_caps(schedule: Schedule, costs: Costs, memory: MemoryModel, factor: float | None) -> list[float]:
    """Each device's memory cap for pairing: ``factor`` x 1F1B's peak (the zero-bubble families, v-auto's
    limit), never below what the unpaired order already holds; with ``factor`` None (V-Min, V-Half: the
    block's memory) the unpaired order's own worst peak on every device."""
    peaks = simulate(schedule, dataclasses.replace(costs, a2a=0.0), memory).peak_memory
    if factor is None:
        return [max(peaks) + EPS] * len(peaks)
    bound = factor * one_f_one_b_peak(schedule.num_devices, costs) + EPS
    return [max(bound, peak + EPS) for peak in peaks]


def paired(schedule: Schedule, costs: Costs, memory: MemoryModel, factor: float | None) -> Schedule:
    """The registry's hook: ``schedule`` with pairs within its family's memory bound (see the module)."""
    if costs.a2a <= 0 or schedule.fused_backward or schedule.vocab_parallel or schedule.pairs:
        return schedule
    return with_pairs(schedule, costs, memory, family_caps(schedule, costs, memory, factor))


def a2a_inside(costs: Costs) -> Costs:
    """``costs`` with each F's and each B's all-to-all inside the pass (``Costs.a2a_time``, each stage's share
    ``StageWork.a2a``) and ``a2a`` 0: what an F or a B alone costs, the timing the run without pairs builds for."""
    if costs.a2a <= 0:
        return costs
    extra = costs.a2a * costs.f
    f, b = costs.f + extra, costs.b + extra
    stages = tuple(dataclasses.replace(work, f=(costs.f * work.f + extra * work.a2a) / f,
                                       b=(costs.b * work.b + extra * work.a2a) / b, a2a=1.0)
                   for work in costs.stages)
    return dataclasses.replace(costs, f=f, b=b, a2a=0.0, stages=stages)


def faster(first: Schedule, second: Schedule, costs: Costs, memory: MemoryModel) -> Schedule:
    """The one of two orders that ends sooner under ``costs`` (``first`` on a tie). Each is what
    :func:`with_pairs` returned, so its simulation under these costs is kept already (``simulated``)."""
    return second if simulated(second, costs, memory).makespan < simulated(first, costs, memory).makespan - EPS \
        else first


def with_pairs(schedule: Schedule, costs: Costs, memory: MemoryModel, caps: list[float]) -> Schedule:
    """``schedule`` re-timed with pairs (module text), or ``schedule`` itself where that is not faster."""
    if costs.a2a <= 0 or schedule.fused_backward or schedule.vocab_parallel:
        return schedule
    programs, pairs = _list_schedule(schedule, costs, memory, caps)
    candidate = dataclasses.replace(schedule, programs=programs, pairs=frozenset(pairs),
                                    meta={**schedule.meta, "pairs": "a2a overlap"})
    try:
        mine = simulated(candidate, costs, memory)
    except DeadlockError:  # cannot happen (pairs form from ready passes); the family's order is the fallback
        return schedule
    theirs = simulated(schedule, costs, memory)
    if mine.makespan >= theirs.makespan or any(p > cap for p, cap in zip(mine.peak_memory, caps)):
        return schedule
    return candidate


def _list_schedule(schedule: Schedule, costs: Costs, memory: MemoryModel, caps: list[float]):
    """(programs, pairs): ``schedule``'s order re-timed as a list schedule that pairs ready passes (module text)."""
    placement, m = schedule.placement, schedule.num_microbatches
    ids = PassIds(schedule.num_stages, m)
    durations = pass_durations(schedule, costs)
    scale = placement.layer_scale
    compute = [costs.of(kind, stage) * scale for kind in (Kind.F, Kind.B) for stage in range(schedule.num_stages)]
    deltas = pass_deltas(placement, costs, memory)
    ready = ready_rule([placement.device_of(s) for s in range(schedule.num_stages)], m, costs.comm)
    end = [UNSET] * (3 * ids.per_kind)
    queues = [[ids.of(a) for a in program] for program in schedule.programs]
    heads, free, level = [0] * len(queues), [0.0] * len(queues), [0.0] * len(queues)
    taken = [set() for _ in queues]  # pulled-forward pass ids, skipped when their old place comes
    out: list[list[Action]] = [[] for _ in queues]
    pairs: list[Pair] = []

    def head(device: int) -> int:
        queue, h = queues[device], heads[device]
        while h < len(queue) and queue[h] in taken[device]:
            taken[device].discard(queue[h])  # its old place is passed: only pulled passes ahead stay in the set
            h += 1
        heads[device] = h
        return h

    def start_of(device: int) -> float | None:
        h = head(device)
        if h == len(queues[device]):
            return None
        at = ready(queues[device][h], end)
        return None if at < 0 else max(at, free[device])

    def partner(device: int, x: int, at: float) -> int | None:
        """The first pass among the device's next WINDOW that pairs with ``x`` and is ready by ``at``."""
        queue, h = queues[device], heads[device]
        want = 1 - x // ids.per_kind  # F (0) <-> B (1)
        later = [y for y in queue[h + 1:h + 1 + WINDOW + len(taken[device])] if y not in taken[device]][:WINDOW]
        for j, y in enumerate(later):
            if y // ids.per_kind == want and y % m != x % m and 0 <= ready(y, end) <= at:
                return y if want == 1 or _fits(level[device], deltas[y // m], deltas[x // m],
                                               [deltas[z // m] for z in later[:j]], caps[device]) else None
        return None

    # Devices decide in the order of their next start: every pass that ends by then is already placed, so
    # "ready by then" is exact. A device whose next pass waits for an input nobody has placed yet waits aside.
    order: list[tuple[float, int]] = []
    waiting: set[int] = set(range(len(queues)))

    def wake() -> None:
        for device in list(waiting):
            at = start_of(device)
            if at is not None:
                waiting.discard(device)
                heapq.heappush(order, (at, device))
            elif head(device) == len(queues[device]):
                waiting.discard(device)

    wake()
    while order:
        at, device = heapq.heappop(order)
        x = queues[device][heads[device]]
        y = partner(device, x, at) if x < 2 * ids.per_kind else None
        heads[device] += 1
        if y is None:
            end[x] = at + durations[x // m]
            out[device].append(ids.action(x))
            level[device] += deltas[x // m]
        else:
            taken[device].add(y)
            forward, backward = (x, y) if x < ids.per_kind else (y, x)
            end[x] = end[y] = at + costs.pair_time(compute[forward // m], compute[backward // m], scale,
                                                   ((forward // m) % ids.num_stages, (backward // m) % ids.num_stages))
            pair = Pair(ids.action(forward), ids.action(backward))
            out[device] += [pair.forward, pair.backward]
            pairs.append(pair)
            level[device] += deltas[x // m] + deltas[y // m]
        free[device] = end[x]
        waiting.add(device)
        wake()
    if any(heads[d] < len(queues[d]) for d in range(len(queues))):
        raise DeadlockError(f"{schedule.name}: pairing found no next pass")  # the order itself deadlocks
    return tuple(tuple(program) for program in out), pairs


def _fits(level: float, forward: float, backward: float, between: list[float], cap: float) -> bool:
    """Whether a partner F (allocating ``forward``), pulled forward to pair with the B now due (releasing
    ``backward``) ahead of the passes ``between`` (their level changes), keeps every level within ``cap``:
    the pair counts the F first; after the F's old place the levels are the order's own again."""
    level += forward
    if level > cap:
        return False
    level += backward
    for delta in between:
        level += delta
        if level > cap:
            return False
    return True
