"""A memory-capped list scheduler: the engine behind the zero-bubble schedules and the
warm-up/cool-down reordering of building-block schedules.

Time advances event by event. Whenever a device is idle it starts, among the passes whose inputs
have arrived, the one with the smallest priority key, provided an F does not push the device's
activation memory above its cap (and, optionally, its count of F-without-B above a limit).

Admission control: a microbatch enters a device through the F of the device's first stage, and
at that moment reserves memory for the F of every stage the device holds. Without the
reservation a V device fills its memory with chunk-0 forwards and can never run the chunk-1
forward that unlocks the backward: the scheduler would stall.
Costs are real inputs: the resulting order adapts to F/B/W/comm times.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from ..core.actions import Action, Kind
from ..core.inputs import EPS as _EPS
from ..core.ledger import MemoryLedger
from ..core.ready import ready_rule
from ..core.schedule import Costs, MemoryModel, Placement, Schedule, ScheduleError
from ..core.timing import KINDS, UNSET, PassIds


class Admission(enum.Enum):
    """How an F of a device's first stage (a microbatch entering the device) is admitted."""

    RESERVE_ALL = "all"  # reserve the device's later-chunk F of every admitted microbatch: never stalls
    HEADROOM = "one"  # keep room for one later-chunk F only: packs tighter, may stall (then discarded)
    NONE = "none"  # plain memory cap on every F: may stall


@dataclass(frozen=True)
class GreedyConfig:
    memory_caps: Sequence[float]  # per device, in memory units, counted under ``memory``
    priority: Callable[[Action], tuple]
    inflight_limits: Sequence[int] | None = None  # per device: max F whose B has not run
    admission: Admission = Admission.RESERVE_ALL
    # Stay idle rather than start a lower-priority pass when a higher-priority one arrives within
    # this time (e.g. a gradient still in flight for ``comm``): starting a W there would delay
    # the backward chain by a whole W.
    wait_window: float = 0.0
    # The activation model the caps are kept under (the simulator's ledger): where B frees part,
    # the freed memory admits more forwards.
    memory: MemoryModel = MemoryModel()


@dataclass
class _DeviceState:
    """Per-device admission bookkeeping of one greedy run (local to that run); the memory
    itself is counted by the shared ledger."""

    ledger: MemoryLedger
    activation: tuple[float, ...]  # per stage: one F's allocation (the ledger's F deltas)
    entry: list[float]  # per device: what admitting a microbatch reserves (all its stages' F)
    headroom: list[float]  # per device: room kept for one later-chunk F (HEADROOM admission)
    first_stage: list[int]
    reserved: list[float]
    inflight: list[int]

    @classmethod
    def start(cls, placement: Placement, costs: Costs, memory: MemoryModel) -> _DeviceState:
        n = placement.num_devices
        ledger = MemoryLedger(placement, costs, memory)
        activation = ledger.deltas[: placement.num_stages]
        later = [[activation[s] for s in stages if s != min(stages)] for stages in placement.stages_per_device]
        return cls(
            ledger=ledger,
            activation=activation,
            entry=[sum(activation[s] for s in stages) for stages in placement.stages_per_device],
            headroom=[max(stages, default=0.0) for stages in later],
            first_stage=[min(stages) for stages in placement.stages_per_device],
            reserved=[0.0] * n,
            inflight=[0] * n,
        )


def greedy_schedule(
    name: str, placement: Placement, num_microbatches: int, costs: Costs, config: GreedyConfig
) -> Schedule:
    """Run the list scheduler; raise ScheduleError if the caps make it stall."""
    num_devices, num_stages = placement.num_devices, placement.num_stages
    scale = placement.layer_scale
    device_of = placement.device_of
    stage_device = [device_of(s) for s in range(num_stages)]
    ids = PassIds(num_stages, num_microbatches)
    end_time = [UNSET] * (3 * ids.per_kind)
    ready_of = ready_rule(stage_device, num_microbatches, costs.comm)
    m, per_kind = num_microbatches, ids.per_kind
    waiting: dict[int, int] = {}  # pass id of a two-input B -> the inputs it still lacks
    heaps: list[list] = [[] for _ in range(num_devices)]
    free_at = [0.0] * num_devices
    # Future (instant, device) at which that device's choice may change: it becomes free, or a
    # pass is offered to it or becomes ready there. Only those devices are looked at then (a
    # scan of every device at every instant made large pipelines quadratic).
    events: list[tuple[float, int]] = []
    state = _DeviceState.start(placement, costs, config.memory)
    programs: list[list[Action]] = [[] for _ in range(num_devices)]
    priority = config.priority

    # Each (kind, stage)'s time, read once per run by pass id // microbatches (the loop below asks for it at
    # every pass).
    duration = [costs.of(kind, stage) * scale for kind in KINDS for stage in range(num_stages)]
    push, kind_f, kind_b, kind_w = heapq.heappush, Kind.F, Kind.B, Kind.W

    def offer(action: Action, x: int) -> None:
        """Offer ``action`` (pass id ``x``) to its device once every input has ended."""
        device = stage_device[action[1]]
        ready = ready_of(x, end_time)  # >= 0: every input has ended
        push(heaps[device], (priority(action), action, ready))
        push(events, (ready, device))

    def fed_twice(action: Action, x: int) -> None:
        """One input of ``action`` (a B before the last stage: two inputs, core.dependencies) has ended: offer it
        once both have. Every other pass has one input and is offered at once."""
        left = waiting.pop(x, 2) - 1
        if left:
            waiting[x] = left
        else:
            offer(action, x)

    # Stage-0 forwards have no inputs; offering them one at a time (in microbatch order) keeps
    # the first device's heap small instead of holding every microbatch from the start.
    offer(Action(Kind.F, 0, 0), 0)
    last_stage = num_stages - 1
    remaining = 3 * num_stages * num_microbatches
    now = 0.0
    while remaining:
        for device in _due_devices(now, events):
            if free_at[device] > now + _EPS:
                continue
            chosen = _pick(heaps[device], now, device, state, config)
            if chosen is None:
                continue
            kind, stage, microbatch = chosen
            x = (_ROW[kind] * num_stages + stage) * m + microbatch  # ids.of(chosen), in range here
            end = now + duration[x // m]
            end_time[x] = end
            free_at[device] = end
            push(events, (end, device))
            programs[device].append(chosen)
            remaining -= 1
            _account(chosen, device, state)
            # What ``chosen`` feeds (core.dependencies, read backwards): an F the next stage's F and its own B,
            # a B its W and the previous stage's B; a W nothing.
            if kind is kind_f:
                if stage == 0 and microbatch + 1 < num_microbatches:
                    offer(_new_action((kind_f, 0, microbatch + 1)), x + 1)
                if stage < last_stage:
                    offer(_new_action((kind_f, stage + 1, microbatch)), x + m)
                    fed_twice(_new_action((kind_b, stage, microbatch)), x + per_kind)
                else:
                    offer(_new_action((kind_b, stage, microbatch)), x + per_kind)
            elif kind is kind_b:
                offer(_new_action((kind_w, stage, microbatch)), x + per_kind)
                if stage > 0:
                    fed_twice(_new_action((kind_b, stage - 1, microbatch)), x - m)
        now = events[0][0] if events else None
        if now is None and remaining:
            raise ScheduleError(f"{name}: greedy scheduler stalled (memory caps {list(config.memory_caps)} too low)")
    return Schedule(name, placement, num_microbatches, tuple(tuple(p) for p in programs))


# Pass id rows of the kinds (timing.KIND_INDEX's), and an Action from a (kind, stage, microbatch) tuple without
# the named tuple's Python-level __new__ (the loop makes one per pass offered).
_ROW = {Kind.F: 0, Kind.B: 1, Kind.W: 2}
_new_action = partial(tuple.__new__, Action)


def _pick(heap, now, device, state, config):
    """Pop the highest-priority pass that can start now (or None to wait); restore the others. The heap holds
    (priority, action, ready time): the ready time rides along (never compared: no two actions are equal)."""
    skipped = []
    chosen = None
    worth_waiting = False
    while heap:
        item = heapq.heappop(heap)
        skipped.append(item)
        _, action, ready = item
        if action.kind is Kind.F and not _allowed(action, device, state, config):  # only an F can be held back
            continue
        if ready <= now + _EPS:
            chosen = item
            skipped.pop()
            break
        worth_waiting = worth_waiting or ready <= now + config.wait_window + _EPS
    for item in skipped:
        heapq.heappush(heap, item)
    if chosen is not None and worth_waiting:
        heapq.heappush(heap, chosen)
        return None
    return chosen[1] if chosen is not None else None


def _allowed(action, device, state: _DeviceState, config) -> bool:
    if action.kind is not Kind.F:
        return True
    cap = config.memory_caps[device] + _EPS
    entering = action.stage == state.first_stage[device]
    if config.admission is Admission.RESERVE_ALL:
        if not entering:
            return True  # admitted earlier: its memory is reserved
        if state.ledger.level[device] + state.reserved[device] + state.entry[device] > cap:
            return False
    else:
        headroom = state.headroom[device]
        if config.admission is Admission.NONE or not entering:
            headroom = 0.0
        if state.ledger.level[device] + state.activation[action.stage] + headroom > cap:
            return False
    limits = config.inflight_limits
    return limits is None or state.inflight[device] < limits[device]


def _account(action, device, state: _DeviceState) -> None:
    state.ledger.apply(device, action.kind, action.stage)
    if action.kind is Kind.F:
        if action.stage == state.first_stage[device]:
            state.reserved[device] += state.entry[device]
        state.reserved[device] -= state.activation[action.stage]
        state.inflight[device] += 1
    elif action.kind is Kind.B:
        state.inflight[device] -= 1


def _due_devices(now: float, events: list[tuple[float, int]]) -> list[int]:
    """Pop every event up to ``now``; the devices they concern, in device order."""
    due = set()
    while events and events[0][0] <= now + _EPS:
        due.add(heapq.heappop(events)[1])
    return sorted(due)
