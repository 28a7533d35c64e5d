"""Reordering a repeated building block in *slot* time, before any real cost is known.

A building block gives every F and B pass an integer start slot (one slot per pass of one V
chunk). Repeating it leaves empty slots in the warm-up and the cool-down, where a device waits for
its input. The reorder moves passes of the warm-up and the cool-down into earlier empty slots, in
seven phases, each one function named after what it does (as DeepSeek's DualPipe names its steps),
its pattern in its docstring:

1. ``_repeat_f_and_b``: F and B of microbatch k at the block's slots + k * interval.
2. ``_w_into_idle_slots``: every slot no F or B holds runs the oldest pending W (FIFO).
3. ``_pull_warmup_and_cooldown``: visited in slot order (then device, then kind), each pass of the
   warm-up (before the first microbatch's last B on device 0) or of the cool-down (after the last
   microbatch's first F on a given device: ``cooldown_starts``) moves to the earliest free slot
   after its inputs where the device's peak stays within the **largest peak over all devices**
   (not only the device's own: a device with a low peak may spend its spare memory to start
   earlier); W is explicit. The steady state stays.
4. ``_squeeze_slots``: every pass as early as its order and inputs allow, one slot each, so that
   the free slots left are real waits.
5. ``_lift_w``: the W passes come out.
6. ``_pull_cooldown_lazily``: the cool-down's F and B are pulled earlier once more, W implicit
   (it runs whenever a slot is idle), within the largest peak over all devices.
7. ``_w_into_idle_slots`` again, into the new free slots.

Costs enter only afterwards: the order of each device (by slot) is what the simulator squeezes.
Peaks are counted in slot order, which is also program order, with the shared ledger's changes
under the given memory model (``slot_memory``), so the simulated peak is the same.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import partial
from itertools import chain, repeat

from ..core.actions import Action, Kind
from ..core.inputs import EPS
from ..core.schedule import MemoryModel, Schedule
from .block import BuildingBlock
from .slot_memory import LazyMemory, SlotDeltas, explicit_levels, slot_deltas

# Action from a (kind, stage, microbatch) tuple without NamedTuple's Python-level __new__.
_new_action = partial(tuple.__new__, Action)
# Visiting order among passes of one slot on one device never matters (one pass per slot); across
# devices it decides which move sees which, so it is fixed: F chunk 0, F chunk 1, B chunk 1, B chunk 0, W.
_F_UP, _F_DOWN, _B_DOWN, _B_UP, _W = range(5)


@dataclass
class _Plan:
    """Slot of every pass, and per device which pass holds each slot."""

    num_stages: int
    device_of: tuple[int, ...]
    first_stage: tuple[int, ...]  # per device, its chunk-0 stage
    slot: dict[Action, int]
    at: list[list[Action | None]]
    deltas: tuple[SlotDeltas, ...]  # per device: the ledger's F/B/W change in chunk activations

    def rank(self, action: Action) -> int:
        device = self.device_of[action.stage]
        up = action.stage == self.first_stage[device]
        if action.kind is Kind.F:
            return _F_UP if up else _F_DOWN
        if action.kind is Kind.B:
            return _B_UP if up else _B_DOWN
        return _W

    def move(self, action: Action, new_slot: int) -> None:
        device = self.device_of[action.stage]
        old = self.slot[action]
        self.at[device][old] = None
        self.at[device][new_slot] = action
        self.slot[action] = new_slot

    def visit_order(self, actions) -> list[Action]:
        return sorted(actions, key=lambda a: (self.slot[a], self.device_of[a.stage], self.rank(a), a.microbatch))


def slot_schedule(
    block: BuildingBlock, num_microbatches: int, name: str, max_peak: float, cooldown_after: int | None = 0,
    memory: MemoryModel = MemoryModel(),
) -> Schedule | None:
    """Repeat ``block``, reorder its warm-up and cool-down in slot time, and return the programs;
    None if W placed lazily needs more than ``max_peak`` memory units on some device.
    ``cooldown_after``: see ``_warmup_and_cooldown`` (and ``cooldown_starts``). Memory is counted
    under ``memory`` (the simulator's count).

    Long runs are built from a short one: the reorder leaves the steady state untouched, and
    there every device repeats the same slots every interval, one microbatch later each time.
    So the run of ``m`` microbatches is the short run with ``m - short`` periods inserted in its
    steady state (``_splice``); the short run is checked to be periodic where it is cut.
    """
    placement = block.placement
    peak, programs = _reordered(block, num_microbatches, cooldown_after, memory)
    if peak * placement.layer_scale / 2 > max_peak + EPS:
        return None
    return Schedule(name, placement, num_microbatches, programs)


def block_key(block: BuildingBlock) -> tuple:
    """What the slot reorder reads of ``block``: two blocks with equal keys reorder into the same programs."""
    offsets = tuple(sorted((kind.value, stage, slot) for (kind, stage), slot in block.offsets.items()))
    durations = tuple(sorted((kind.value, length) for kind, length in block.durations.items()))
    return block.placement, block.interval, offsets, durations


# The reorder works in slot time: its programs depend on the block, the size, the cool-down start and the memory
# model, never on the pass costs. The planner builds the same block and size for many layouts (their costs
# differ, and each stage-cost set is its own generation), and V-Min / V-Half / v-auto try several cool-down
# starts per build, so the programs are kept (the peak bound too) and shared by every such build.
def _reordered(block: BuildingBlock, num_microbatches: int, cooldown_after: int | None,
               memory: MemoryModel) -> tuple[float, tuple[tuple[Action, ...], ...]]:
    """The reordered programs and the peak bound of both reorders (chunk activations), kept in ``_REORDERED``."""
    key = (block_key(block), num_microbatches, cooldown_after, memory)
    found = _REORDERED.pop(key, None)
    if found is None:
        found = _reorder(block, num_microbatches, cooldown_after, memory)
    _REORDERED[key] = found  # the most recently used last
    while len(_REORDERED) > 1 and sum(_size(programs) for _, programs in _REORDERED.values()) > _REORDERED_PASSES:
        _REORDERED.pop(next(iter(_REORDERED)))
    return found


def _size(programs: tuple[tuple[Action, ...], ...]) -> int:
    return sum(map(len, programs))


_REORDERED: dict[tuple, tuple[float, tuple[tuple[Action, ...], ...]]] = {}
# Passes kept in all (the oldest dropped first): the planner's sizes (m about 1.5 d) take a few thousand each;
# one d = 64, m = 512 run takes 200k.
_REORDERED_PASSES = 1_000_000


def _reorder(block: BuildingBlock, num_microbatches: int, cooldown_after: int | None,
             memory: MemoryModel) -> tuple[float, tuple[tuple[Action, ...], ...]]:
    short = _short_microbatches(block)
    built = _slot_rows(block, min(short, num_microbatches), cooldown_after, memory)
    rows = None
    if num_microbatches > short:
        rows = _splice(block, built.rows, num_microbatches - short, short)
    else:
        rows = [[a for a in row if a is not None] for row in built.rows]
    if rows is None:
        rows = [[a for a in row if a is not None] for row in _slot_rows(block, num_microbatches, cooldown_after, memory).rows]
    return built.peak, tuple(map(tuple, rows))


def _short_microbatches(block: BuildingBlock) -> int:
    """Microbatches of a run whose steady state has two untouched periods past ``_cut``:
    the warm-up ends within one block span, and a cool-down pass moves back at most one span."""
    return 2 * _span_periods(block) + 4


def _span_periods(block: BuildingBlock) -> int:
    span = max(block.offsets.values()) - min(block.offsets.values()) + 1
    return -(-span // block.interval)


def _splice(block: BuildingBlock, rows, extra: int, short: int):
    """Per device: the short run's slots before the cut, ``extra`` copies of the period at the cut
    (one microbatch later each), then the rest of the short run ``extra`` microbatches later.
    None if the short run is not periodic around the cut."""
    interval = block.interval
    cut = interval * (_span_periods(block) + 2)
    out = []
    for row in rows:
        windows = [row[cut + k * interval: cut + (k + 1) * interval] for k in (-1, 0, 1)]
        if _shifted(windows[0], 1) != windows[1] or _shifted(windows[1], 1) != windows[2]:
            return None
        program = [a for a in row[:cut] if a is not None]
        program.extend(_repeated([a for a in windows[1] if a is not None], extra))
        program.extend(_shifted([a for a in row[cut:] if a is not None], extra))
        out.append(program)
    return out


def _shifted(actions, by: int) -> list:
    if not by:
        return list(actions)
    return [None if a is None else _new_action((a.kind, a.stage, a.microbatch + by)) for a in actions]


def _repeated(period: list[Action], times: int) -> list[Action]:
    """``period`` then the same passes ``1 .. times - 1`` microbatches later (built column-wise
    in C: hundreds of thousands of actions at d=64)."""
    columns = [
        map(_new_action, zip(repeat(a.kind), repeat(a.stage), range(a.microbatch, a.microbatch + times)))
        for a in period
    ]
    return list(chain.from_iterable(zip(*columns)))


@dataclass(frozen=True)
class _Built:
    rows: list[list[Action | None]]
    peak: float  # bound on every device's peak, in chunk activations (the budgets of both reorders)


def _slot_rows(block: BuildingBlock, num_microbatches: int, cooldown_after: int | None,
               memory: MemoryModel = MemoryModel()) -> _Built:
    """Each device's slots after the seven phases (module docstring), W placed lazily."""
    plan = _repeat_f_and_b(block, num_microbatches, memory)
    _w_into_idle_slots(plan)
    warmup, cooldown = _warmup_and_cooldown(plan, num_microbatches, cooldown_after)
    first_budget = _pull_warmup_and_cooldown(plan, warmup + cooldown)
    _squeeze_slots(plan)
    _lift_w(plan)
    budget = _pull_cooldown_lazily(plan, num_microbatches, cooldown_after)
    _w_into_idle_slots(plan)
    return _Built(plan.at, max(first_budget, budget))


def _repeat_f_and_b(block: BuildingBlock, num_microbatches: int, memory: MemoryModel) -> _Plan:
    """Phase 1, pattern ``F0 F1 B1 B0`` of microbatch k at the block's slots + k * interval, no W yet
    (the row is long enough for every W after the device's last F or B)."""
    placement = block.placement
    interval = block.interval
    slot: dict[Action, int] = {}
    length = max(block.offsets.values()) + interval * num_microbatches + 1
    # Room for every W after the last F/B of a device: at most 2m of them.
    length += 2 * num_microbatches * placement.chunks_per_device
    at: list[list[Action | None]] = [[None] * length for _ in range(placement.num_devices)]
    for device, stages in enumerate(placement.stages_per_device):
        row = at[device]
        for stage in stages:
            for kind in (Kind.F, Kind.B):
                base = block.offsets[(kind, stage)]
                for mb in range(num_microbatches):
                    action = Action(kind, stage, mb)
                    s = base + mb * interval
                    slot[action] = s
                    row[s] = action
    device_of = tuple(placement.device_of(s) for s in range(placement.num_stages))
    first = tuple(min(stages) for stages in placement.stages_per_device)
    return _Plan(placement.num_stages, device_of, first, slot, at, slot_deltas(placement, memory))


def _w_into_idle_slots(plan: _Plan) -> None:
    """Phases 2 and 7, pattern ``W`` in every idle slot: each device keeps a FIFO of its finished B
    passes and every slot that no F or B holds runs the oldest pending W."""
    end = _used_slots(plan)
    for device in range(len(plan.at)):
        row = plan.at[device]
        pending: deque[Action] = deque()
        for s in range(end):
            action = row[s]
            if action is None:
                if pending:
                    w = pending.popleft()
                    row[s] = w
                    plan.slot[w] = s
            elif action.kind is Kind.B:
                pending.append(Action(Kind.W, action.stage, action.microbatch))
        if len(pending) > len(row) - end:  # cannot happen: _repeat_f_and_b leaves room for every W
            raise AssertionError("no room left for W")
        for s, w in enumerate(pending, start=end):  # past every F and B: each slot is idle
            row[s] = w
            plan.slot[w] = s


def _used_slots(plan: _Plan) -> int:
    """One past the last slot any pass holds (the rows are longer: room for every W)."""
    return max(plan.slot.values()) + 1


def _lift_w(plan: _Plan) -> None:
    """Phase 5: every W leaves its slot (phase 6 counts W implicitly, phase 7 puts them back)."""
    for row in plan.at:
        for s, action in enumerate(row):
            if action is not None and action.kind is Kind.W:
                row[s] = None
                del plan.slot[action]


def _warmup_and_cooldown(plan: _Plan, num_microbatches: int,
                         cooldown_after: int | None) -> tuple[list[Action], list[Action]]:
    """Passes of the warm-up and of the cool-down, in visiting order.

    The warm-up ends where device 0 finishes the first microbatch (its chunk-0 B). The cool-down
    holds the passes visited after device ``cooldown_after`` starts the last microbatch (its
    chunk-0 F), and after the warm-up; in between the block repeats as is. None: no cool-down.
    """
    warm_end = plan.slot[Action(Kind.B, 0, 0)]
    if cooldown_after is None:
        cool_key = (len(plan.at[0]), 0)
    else:
        last_f = Action(Kind.F, plan.first_stage[cooldown_after], num_microbatches - 1)
        cool_key = max((plan.slot[last_f], cooldown_after), (warm_end, 0))
    warmup, cooldown = [], []
    end = _used_slots(plan)
    for device, row in enumerate(plan.at):
        for s in range(min(warm_end, end)):
            if row[s] is not None:
                warmup.append((s, device, plan.rank(row[s]), row[s].microbatch, row[s]))
        first = cool_key[0] if device > cool_key[1] else cool_key[0] + 1
        for s in range(first, end):
            if row[s] is not None:
                cooldown.append((s, device, plan.rank(row[s]), row[s].microbatch, row[s]))
    warmup.sort()
    cooldown.sort()
    return [item[-1] for item in warmup], [item[-1] for item in cooldown]


def cooldown_starts(block: BuildingBlock, num_microbatches: int) -> list[int]:
    """Where the cool-down may start (``cooldown_after``): after the last microbatch's first F on
    device 0 (the default; right after the warm-up when that comes first), and on the first and on
    the last device that starts it after both.

    Which is best depends on the cell: a later start leaves more of the block as it is, and the
    greedy pulls of the passes right after the warm-up can take the slots that later, more critical
    passes need (V-Half d = 12, m = 12, equal costs: 0.308 bubble from device 0, 0.287 from device
    4 on; d = 15, m = 13: 125 -> 119 slots from device 9 on). Measured on d = 2..16, m = d - 3 ..
    d + 2, 2d, 4d: trying every device gains nothing more, and no cool-down at all (None) is never
    better than all three.
    """
    stages = block.placement.stages_per_device
    warm_end = block.offsets[(Kind.B, stages[0][0])]
    last_f = [block.offsets[(Kind.F, first)] + block.interval * (num_microbatches - 1) for first, *_ in stages]
    default = max((last_f[0], 0), (warm_end, 0))
    later = [device for device in range(1, len(stages)) if (last_f[device], device) > default]
    return [0, *dict.fromkeys(later[:1] + later[-1:])]


def cooldown_follows_warmup(block: BuildingBlock, num_microbatches: int) -> bool:
    """Whether device 0 starts the last microbatch before it finishes the first (about m <= d): the
    default cool-down then starts right after the warm-up (``_warmup_and_cooldown``)."""
    first_stage = block.placement.stages_per_device[0][0]
    last_start = block.offsets[(Kind.F, first_stage)] + block.interval * (num_microbatches - 1)
    return last_start < block.offsets[(Kind.B, first_stage)]


def _earliest(plan: _Plan, action: Action) -> int:
    """First slot after the passes ``action`` depends on, and after its predecessor of the same
    kind and stage (passes of one kind and stage keep their microbatch order).

    Keys are plain tuples: they hash and compare equal to the Action keys, and are cheaper to make.
    """
    kind, stage, mb = action
    slot = plan.slot
    if kind is Kind.F:
        ready = slot[(Kind.F, stage - 1, mb)] if stage > 0 else -1
    elif kind is Kind.B:
        ready = slot[(Kind.F, stage, mb)]
        if stage < plan.num_stages - 1:
            ready = max(ready, slot[(Kind.B, stage + 1, mb)])
    else:
        ready = slot[(Kind.B, stage, mb)]
    if mb > 0:
        ready = max(ready, slot[(kind, stage, mb - 1)])
    return ready + 1


def _pull_warmup_and_cooldown(plan: _Plan, visit: list[Action]) -> float:
    """Phase 3, pattern: each visited pass (warm-up, then cool-down, F, B and W) to the earliest free
    slot after its inputs that keeps the device's peak within the largest peak over all devices.
    W is explicit: an F moved from t to s adds its change to the levels of [s, t); a B or W (which
    free) never raises them. Returns that budget."""
    levels = [explicit_levels(plan.at[d], plan.deltas[d]) for d in range(len(plan.at))]
    budget = max(max(level) for level in levels)
    for action in visit:
        device = plan.device_of[action.stage]
        row, level, deltas = plan.at[device], levels[device], plan.deltas[device]
        current = plan.slot[action]
        start = _earliest(plan, action)
        if start >= current:
            continue
        # The levels an earlier F would raise must stay below the budget (max() first: in C, and
        # it almost always passes).
        if action.kind is Kind.F and max(level[start:current]) + deltas.f > budget:
            for s in range(current - 1, start - 1, -1):
                if level[s] + deltas.f > budget:
                    start = s + 1
                    break
        try:
            target = row.index(None, start, current)
        except ValueError:  # no free slot before the pass
            continue
        plan.move(action, target)
        step = deltas.f if action.kind is Kind.F else deltas.w if action.kind is Kind.W else deltas.b
        if step:
            level[target:current] = [value + step for value in level[target:current]]
    return budget


def _squeeze_slots(plan: _Plan) -> None:
    """Phase 4, pattern: every pass (F, B and W) at the first slot after its device's previous pass
    and after its inputs, one slot per pass, no comm: the squeeze in slot time.

    The pulls move passes into *free* slots. Before this squeeze many free slots are not waits at
    all, only slots the squeeze removes anyway; a pass pulled there gains nothing while the real
    waits stay empty. Squeezed, every free slot is a wait, so the cool-down pull that follows fills
    those. (V-Min d = 6, m = 6, equal costs: 0.333 -> 0.321 bubble; V-Half d = 10, m = 10: 0.318 ->
    0.294; never worse on d = 2..16, m = d..8d, three cost settings.) Each device keeps its order
    and W stays explicit, so no peak changes.
    """
    at = plan.at
    squeezed: list[list[Action | None]] = [[None] * len(row) for row in at]
    free = [0] * len(at)
    slot = plan.slot
    last_stage = plan.num_stages - 1
    # Slot order across all devices is an order of inputs first (every input has an earlier slot),
    # so each pass's inputs already hold their squeezed slots when it is placed.
    end = _used_slots(plan)
    for column in zip(*(row[:end] for row in at)):
        for device, action in enumerate(column):
            if action is None:
                continue
            kind, stage, mb = action
            start = free[device]
            if kind is Kind.F:
                if stage > 0:
                    start = max(start, slot[(Kind.F, stage - 1, mb)] + 1)
            elif kind is Kind.B:
                start = max(start, slot[(Kind.F, stage, mb)] + 1)
                if stage < last_stage:
                    start = max(start, slot[(Kind.B, stage + 1, mb)] + 1)
            else:
                start = max(start, slot[(Kind.B, stage, mb)] + 1)
            slot[action] = start
            squeezed[device][start] = action
            free[device] = start + 1
    at[:] = squeezed


def _lazy_peak(plan: _Plan, device: int) -> float:
    return LazyMemory(plan.at[device], 0.0, plan.deltas[device]).peak()


def _pull_cooldown_lazily(plan: _Plan, num_microbatches: int, cooldown_after: int | None) -> float:
    """Phase 6, pattern: each F and B of the cool-down to the first free slot after its inputs whose
    device peak, W implicit, stays within the largest such peak over all devices. Returns it."""
    _, cooldown = _warmup_and_cooldown(plan, num_microbatches, cooldown_after)
    budget = max(_lazy_peak(plan, d) for d in range(len(plan.at)))
    _reorder_lazy(plan, [a for a in cooldown if a.kind is not Kind.W], budget)
    return budget


def _reorder_lazy(plan: _Plan, visit: list[Action], budget: int) -> None:
    """As :func:`_pull_warmup_and_cooldown`, with W implicit: try the free slots after the inputs in
    order and keep the first whose device peak stays within ``budget``."""
    memories: dict[int, LazyMemory] = {}
    for action in visit:
        device = plan.device_of[action.stage]
        row = plan.at[device]
        current = plan.slot[action]
        s = _earliest(plan, action) - 1
        while True:  # the free slots before the pass, in order (row.index finds each in C)
            try:
                s = row.index(None, s + 1, current)
            except ValueError:
                break
            memory = memories.get(device)
            if memory is None:
                memory = memories[device] = LazyMemory(row, budget, plan.deltas[device])
            plan.move(action, s)
            if memory.accept(action, s, current):
                break
            plan.move(action, current)
