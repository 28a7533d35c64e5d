"""Zero-bubble schedules built by the memory-capped greedy scheduler.

* ZB-H1, ZB-1P, ZB-2P (Qi et al., ICLR 2024) on the looped placement: memory capped at 1x
  (H1, 1P) or 2x (2P) of 1F1B's peak; H1 additionally keeps 1F1B's count of in-flight
  forwards per device, which is what makes it the simple hand-made variant.
* V-ZB on the V placement with 1F1B's peak memory.

Like the authors, we try a few on/off variants of the priority rules and keep the schedule with
the smallest makespan under the given costs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .actions import Kind
from .greedy import Admission, GreedyConfig, greedy_schedule
from .schedule import Costs, Placement, Schedule, ScheduleError
from .simulator import simulate

_KIND_RANK_B_FIRST = {Kind.B: 0, Kind.F: 1, Kind.W: 2}
_KIND_RANK_F_FIRST = {Kind.F: 0, Kind.B: 1, Kind.W: 2}

# Above this many (device x microbatch) cells, variants are compared on a shorter run (the
# steady state decides the winner) and only the winner is built at full size.
_PROXY_CELLS = 2048


def _b_first_deep(a):
    return (_KIND_RANK_B_FIRST[a.kind], -a.stage, a.microbatch)


def _b_first_old(a):
    return (_KIND_RANK_B_FIRST[a.kind], a.microbatch, -a.stage)


def _f_first_deep(a):
    return (_KIND_RANK_F_FIRST[a.kind], -a.stage, a.microbatch)


def _f_first_old(a):
    return (_KIND_RANK_F_FIRST[a.kind], a.microbatch, -a.stage)


@dataclass(frozen=True)
class _Variant:
    priority: Callable
    admission: Admission
    wait_window: float
    inflight_limits: tuple[int, ...] | None = None


def _variants(placement: Placement, costs: Costs, limit_options) -> list[_Variant]:
    """The on/off rule variants worth trying (measured over d=3..12, m=2d..4d, four cost sets).

    With one chunk per device the stage order and the admission modes coincide, so only the
    B-or-F-first rule, the waiting window and the in-flight limit vary. On the V placement the
    winners spread over priority and admission; RESERVE_ALL is kept because it never stalls.
    """
    windows = sorted({costs.comm, costs.comm + 0.5 * min(costs.f, costs.b, costs.w)})
    if placement.chunks_per_device == 1:
        rules = [(_b_first_deep, Admission.RESERVE_ALL), (_f_first_deep, Admission.RESERVE_ALL)]
        windows = sorted({0.0, *windows})
    else:
        rules = [
            (_f_first_old, Admission.NONE),
            (_f_first_deep, Admission.NONE),
            (_f_first_deep, Admission.HEADROOM),
            (_f_first_old, Admission.HEADROOM),
            (_b_first_old, Admission.HEADROOM),
            (_f_first_old, Admission.RESERVE_ALL),
            (_b_first_deep, Admission.RESERVE_ALL),
        ]
    return [_Variant(p, a, w, limits) for p, a in rules for w in windows for limits in limit_options]


def best_greedy(
    name: str,
    placement: Placement,
    num_microbatches: int,
    costs: Costs,
    memory_caps: list[float],
    limit_options: list[tuple[int, ...] | None] = (None,),
) -> Schedule:
    """The lowest-makespan greedy schedule over the rule variants (ties: lower peak memory).

    Large problems rank the variants on a shorter run (the steady state decides the winner)
    and build only the best ones at full size.
    """
    variants = _variants(placement, costs, limit_options)
    num_devices = placement.num_devices
    if num_devices * num_microbatches > _PROXY_CELLS:
        proxy_m = max(2 * num_devices, _PROXY_CELLS // num_devices)
        ranked = _rank(name, placement, proxy_m, costs, memory_caps, variants)
        variants = [variant for _, variant, _ in ranked]
    for variant in variants if num_devices * num_microbatches > _PROXY_CELLS else ():
        ranked = _rank(name, placement, num_microbatches, costs, memory_caps, [variant])
        if ranked:  # the proxy's winner can still stall at full size: then take the next one
            return ranked[0][2]
    ranked = _rank(name, placement, num_microbatches, costs, memory_caps, variants)
    if not ranked:
        raise ScheduleError(f"{name}: no variant of the greedy scheduler fits the memory caps {memory_caps}")
    return ranked[0][2]


def _rank(name, placement, num_microbatches, costs, memory_caps, variants):
    ranked = []
    for index, variant in enumerate(variants):
        config = GreedyConfig(
            memory_caps, variant.priority, variant.inflight_limits, variant.admission, variant.wait_window
        )
        try:
            schedule = greedy_schedule(name, placement, num_microbatches, costs, config)
        except ScheduleError:
            continue  # this variant stalls under the caps
        result = simulate(schedule, costs)
        ranked.append(((round(result.makespan, 9), result.peak_memory_max, index), variant, schedule))
    ranked.sort(key=lambda item: item[0])
    return ranked


def zb_h1(num_devices: int, num_microbatches: int, costs: Costs) -> Schedule:
    placement = Placement.looped(num_devices)
    caps = [float(num_devices)] * num_devices
    inflight = tuple(num_devices - device for device in range(num_devices))
    return best_greedy("zb-h1", placement, num_microbatches, costs, caps, [inflight])


def zb_p(num_devices: int, num_microbatches: int, costs: Costs, factor: int) -> Schedule:
    """ZB-1P / ZB-2P: the best greedy schedule under the memory cap. ZB-H1's 1F1B-like
    in-flight limit is among the variants tried, so ZB-1P is never worse than ZB-H1."""
    placement = Placement.looped(num_devices)
    caps = [float(factor * num_devices)] * num_devices
    limits = [None] + [
        tuple(num_devices - device + extra * num_devices for device in range(num_devices)) for extra in range(factor)
    ]
    return best_greedy(f"zb-{factor}p", placement, num_microbatches, costs, caps, limits)


def v_zb(num_devices: int, num_microbatches: int, costs: Costs) -> Schedule:
    placement = Placement.v_shape(num_devices)
    caps = [float(num_devices)] * num_devices
    return best_greedy("v-zb", placement, num_microbatches, costs, caps)
