"""Zero-bubble schedules built by the memory-capped greedy scheduler.

* ZB-H1, ZB-1P, ZB-2P (Qi et al., ICLR 2024) on the looped placement: memory capped at 1x
  (H1, 1P) or 2x (2P) of 1F1B's peak; H1 additionally keeps 1F1B's count of in-flight
  forwards per device, which is what makes it the simple hand-made variant.
* V-ZB on the V placement with 1F1B's peak memory.

Like the authors, we try a few on/off variants of the priority rules and keep the schedule with
the smallest makespan under the given costs.
"""

from __future__ import annotations

from .actions import Kind
from .greedy import GreedyConfig, greedy_schedule
from .schedule import Costs, Placement, Schedule, ScheduleError
from .simulator import simulate

_KIND_RANK_B_FIRST = {Kind.B: 0, Kind.F: 1, Kind.W: 2}
_KIND_RANK_F_FIRST = {Kind.F: 0, Kind.B: 1, Kind.W: 2}


def _priorities():
    """Variants: B before F or F before B; among a kind, deeper stage first or oldest microbatch first."""
    for ranks in (_KIND_RANK_B_FIRST, _KIND_RANK_F_FIRST):
        yield lambda a, r=ranks: (r[a.kind], -a.stage, a.microbatch)
        yield lambda a, r=ranks: (r[a.kind], a.microbatch, -a.stage)


def best_greedy(
    name: str,
    placement: Placement,
    num_microbatches: int,
    costs: Costs,
    memory_caps: list[float],
    inflight_limits: list[int] | None = None,
) -> Schedule:
    best, best_key = None, None
    variants = [(p, r) for p in _priorities() for r in (True, False)]
    for priority, reserve in variants:
        config = GreedyConfig(memory_caps, priority, inflight_limits, reserve)
        try:
            schedule = greedy_schedule(name, placement, num_microbatches, costs, config)
        except ScheduleError:
            continue
        result = simulate(schedule, costs)
        key = (round(result.makespan, 9), result.peak_memory_max)
        if best_key is None or key < best_key:
            best, best_key = schedule, key
    if best is None:
        raise ScheduleError(f"{name}: no variant of the greedy scheduler fits the memory caps {memory_caps}")
    return best


def zb_h1(num_devices: int, num_microbatches: int, costs: Costs) -> Schedule:
    placement = Placement.looped(num_devices)
    caps = [float(num_devices)] * num_devices
    inflight = [num_devices - device for device in range(num_devices)]
    return best_greedy("zb-h1", placement, num_microbatches, costs, caps, inflight)


def zb_p(num_devices: int, num_microbatches: int, costs: Costs, factor: int) -> Schedule:
    placement = Placement.looped(num_devices)
    caps = [float(factor * num_devices)] * num_devices
    return best_greedy(f"zb-{factor}p", placement, num_microbatches, costs, caps)


def v_zb(num_devices: int, num_microbatches: int, costs: Costs) -> Schedule:
    placement = Placement.v_shape(num_devices)
    caps = [float(num_devices)] * num_devices
    return best_greedy("v-zb", placement, num_microbatches, costs, caps)


