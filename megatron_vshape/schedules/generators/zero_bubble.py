"""Zero-bubble schedules: the best of constructive builders and the memory-capped greedy scheduler.

* ZB-H1, ZB-1P, ZB-2P (Qi et al., ICLR 2024) on the looped placement: memory capped at 1x
  (H1, 1P) or 2x (2P) of 1F1B's peak; H1 additionally keeps 1F1B's count of in-flight
  forwards per device, which is what makes it the simple hand-made variant.
* V-ZB on the V placement with 1F1B's peak memory.

Like the authors, we try a few on/off variants of the rules (of the constructive builders in
zb_builder / v_zb_builder, and of the greedy list scheduler) and keep the schedule with the
smallest makespan under the given costs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..core.actions import Kind
from ..core.schedule import Costs, MemoryModel, Placement, Schedule, ScheduleError, one_f_one_b_peak
from . import v_zb_builder, zb_builder
from .greedy import Admission, GreedyConfig, greedy_schedule
from .simulated import simulated

_KIND_RANK_B_FIRST = {Kind.B: 0, Kind.F: 1, Kind.W: 2}
_KIND_RANK_F_FIRST = {Kind.F: 0, Kind.B: 1, Kind.W: 2}

# Above this many (device x microbatch) cells, variants are compared on a shorter run (the
# steady state decides the winner) and only the winner is built at full size.
_FULL_SIZE_RANKING_MAX_CELLS = 2048


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


def _variants(family: GreedyFamily, num_devices: int, costs: Costs) -> list[_Variant]:
    """The on/off rule variants worth trying (measured over d=3..12, m=2d..4d, four cost sets).

    With one chunk per device the stage order and the admission modes coincide, so only the
    B-or-F-first rule, the waiting window and the in-flight limit vary. On the V placement the
    winners spread over priority and admission; RESERVE_ALL is kept because it never stalls.
    """
    placement = family.placement(num_devices)
    limit_options = family.limit_options(num_devices)
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


@dataclass(frozen=True)
class GreedyFamily:
    """A greedy schedule defined for any pipeline size: placement, caps and in-flight limits."""

    name: str
    placement: Callable[[int], Placement]
    memory_caps: Callable[[int, Costs], list[float]]  # (devices, costs) -> per-device cap, memory units
    limit_options: Callable[[int], list[tuple[int, ...] | None]] = lambda d: [None]


# A way to build a schedule for any (num_devices, num_microbatches); None if it cannot.
Candidate = Callable[[int, int], Schedule | None]


def greedy_candidates(family: GreedyFamily, costs: Costs, memory: MemoryModel = MemoryModel()) -> list[Candidate]:
    """One candidate per rule variant of the greedy list scheduler (same count for every d), its
    caps kept under ``memory``."""

    def build(index: int) -> Candidate:
        def candidate(num_devices: int, num_microbatches: int) -> Schedule | None:
            variant = _variants(family, num_devices, costs)[index]
            sized = sized_costs(costs, family.placement(num_devices).num_stages)
            config = GreedyConfig(
                family.memory_caps(num_devices, sized), variant.priority, variant.inflight_limits,
                variant.admission, variant.wait_window, memory,
            )
            try:
                return greedy_schedule(family.name, family.placement(num_devices), num_microbatches, sized, config)
            except ScheduleError:
                return None  # this variant stalls under the caps
        return candidate

    return [build(index) for index in range(len(_variants(family, 2, costs)))]


def best_of(name: str, candidates: Sequence[Candidate], num_devices: int, num_microbatches: int,
            costs: Costs, memory: MemoryModel = MemoryModel(), share: tuple | None = None) -> Schedule:
    """The lowest-makespan schedule among the candidates (ties: lower peak under ``memory``, then
    list order).

    Large problems rank the candidates on a smaller pipeline (at most 16 devices, 4
    microbatches per device: the steady state decides the winner there too) and build only the
    best at full size; a winner that fails at full size hands over to the next.

    ``share``: a key that names the candidate list (the family and its rule set, the costs, the memory
    model); the proxy's ranking is then kept and shared by every size that ranks on the same proxy (the
    planner asks for many sizes of one family at the same costs: d >= 16 and m >= 64 all rank on 16 x 64).
    """
    if num_devices * num_microbatches <= _FULL_SIZE_RANKING_MAX_CELLS:
        ranked = _rank(candidates, num_devices, num_microbatches, costs, memory)
        if not ranked:
            raise ScheduleError(f"{name}: no variant fits the memory caps")
        return ranked[0][2]
    proxy_d = min(num_devices, 16)
    proxy_m = min(num_microbatches, 4 * proxy_d)
    key = None if share is None else (*share, len(candidates), proxy_d, proxy_m, costs, memory)
    order = _PROXY_RANKS.get(key) if key is not None else None
    if order is None:
        order = tuple(index for _, index, _ in _rank(candidates, proxy_d, proxy_m, costs, memory))
        if key is not None:
            _PROXY_RANKS[key] = order
            while len(_PROXY_RANKS) > _PROXY_RANKS_KEPT:
                _PROXY_RANKS.pop(next(iter(_PROXY_RANKS)))
    for index in order:
        schedule = candidates[index](num_devices, num_microbatches)
        if schedule is not None:
            return schedule
    raise ScheduleError(f"{name}: no variant fits the memory caps")


# Proxy rankings kept for best_of's ``share`` (oldest dropped first).
_PROXY_RANKS: dict[tuple, tuple[int, ...]] = {}
_PROXY_RANKS_KEPT = 256


def best_greedy(family: GreedyFamily, num_devices: int, num_microbatches: int, costs: Costs,
                memory: MemoryModel = MemoryModel()) -> Schedule:
    """The lowest-makespan greedy schedule over the rule variants (ties: lower peak memory)."""
    return best_of(family.name, greedy_candidates(family, costs, memory), num_devices, num_microbatches, costs,
                   memory)


def sized_costs(costs: Costs, num_stages: int) -> Costs:
    """``costs`` for a pipeline of ``num_stages`` stages: unchanged when the count matches (or
    stages are uniform); otherwise the per-stage work resampled evenly, first and last stage
    kept, for ranking variants on a smaller proxy pipeline (``best_of``)."""
    count = len(costs.stages)
    if count in (0, num_stages):
        return costs
    if costs.uniform:
        return costs.with_stages(())
    if num_stages == 1:
        return costs.with_stages(costs.stages[:1])
    return costs.with_stages(costs.stages[round(s * (count - 1) / (num_stages - 1))] for s in range(num_stages))


def _rank(candidates, num_devices, num_microbatches, costs, memory=MemoryModel()):
    """(key, candidate index, schedule) for every candidate that builds, best first; stops at
    the first schedule without any bubble (nothing can beat it on makespan)."""
    ranked = []
    for index, candidate in enumerate(candidates):
        schedule = candidate(num_devices, num_microbatches)
        if schedule is None:
            continue
        # Kept (``simulated``): the winner is simulated again by whoever asked (the registry's comparison with the
        # order built for uniform stages, V-Min / V-Half's alternatives).
        result = simulated(schedule, sized_costs(costs, schedule.num_stages), memory)
        ranked.append(((round(result.makespan, 9), result.peak_memory_max, index), index, schedule))
        if result.bubble_rate <= 1e-12:
            break
    ranked.sort(key=lambda item: item[0])
    return ranked


def _one_f_one_b_limits(num_devices: int, extra: int = 0) -> tuple[int, ...]:
    """1F1B's number of forwards in flight on each device (plus ``extra`` pipelines' worth)."""
    return tuple(num_devices - device + extra * num_devices for device in range(num_devices))


def _caps(factor: float) -> Callable[[int, Costs], list[float]]:
    """Every device capped at ``factor`` x 1F1B's peak (its worst device's, under the costs)."""
    return lambda d, costs: [factor * one_f_one_b_peak(d, costs)] * d


ZB_H1 = GreedyFamily("zb-h1", Placement.looped, _caps(1.0), lambda d: [_one_f_one_b_limits(d)])
ZB_1P = GreedyFamily("zb-1p", Placement.looped, _caps(1.0), lambda d: [None, _one_f_one_b_limits(d)])
# ZB-2P's greedy variants leave out ZB-H1's in-flight limit: over d 2..12, m d..6d and four
# cost settings it never beat the other candidates, and at d=64 each variant costs ~0.1 s to rank.
ZB_2P = GreedyFamily(
    "zb-2p",
    Placement.looped,
    _caps(2.0),
    lambda d: [None, _one_f_one_b_limits(d, 1)],
)
V_ZB = GreedyFamily("v-zb", Placement.v_shape, _caps(1.0))


def zb_h1(num_devices: int, num_microbatches: int, costs: Costs, memory: MemoryModel = MemoryModel()) -> Schedule:
    """ZB-H1: 1F1B's memory and in-flight count, W passes moved into the bubbles."""
    candidates = _constructive_zb("zb-h1", 1.0, costs, memory, limited=True) + greedy_candidates(ZB_H1, costs, memory)
    return best_of("zb-h1", candidates, num_devices, num_microbatches, costs, memory, share=("zb-h1",))


def zb_p(num_devices: int, num_microbatches: int, costs: Costs, factor: int,
         memory: MemoryModel = MemoryModel()) -> Schedule:
    """ZB-1P / ZB-2P: memory capped at 1x / 2x 1F1B's peak. Candidates: the constructive
    builder's variants and the greedy scheduler's (ZB-H1's in-flight limit among them, so
    ZB-1P is never worse than ZB-H1).

    Every candidate keeps the cap under ``memory`` with the simulator's ledger (with B freeing
    part, more forwards fit).
    """
    family = ZB_1P if factor == 1 else ZB_2P
    candidates = _constructive_zb(family.name, float(factor), costs, memory) + greedy_candidates(family, costs, memory)
    return best_of(family.name, candidates, num_devices, num_microbatches, costs, memory, share=(family.name,))


def _constructive_zb(name: str, factor: float, costs: Costs, memory: MemoryModel = MemoryModel(),
                     limited: bool = False) -> list[Candidate]:
    """The constructive builder's variants; ``limited``: with 1F1B's forwards in flight (ZB-H1)."""

    def build(variant: zb_builder.ZbVariant) -> Candidate:
        def candidate(d: int, m: int) -> Schedule | None:
            limits = _one_f_one_b_limits(d) if limited else None
            sized = sized_costs(costs, d)
            return zb_builder.build_zb(d, m, sized, factor * one_f_one_b_peak(d, sized), variant, name, memory, limits)
        return candidate

    return [build(variant) for variant in zb_builder.VARIANTS]


def v_zb(num_devices: int, num_microbatches: int, costs: Costs, memory: MemoryModel = MemoryModel()) -> Schedule:
    """V-ZB: V placement, memory capped at 1F1B's peak (d units).

    Candidates: the constructive builder's variants (see v_zb_builder; the authors' method) and
    the greedy list scheduler's. Over d 2..12, m in {d, d+1, 2d, 4d} and six cost settings the
    greedy ones won only with m = d (large comm or B/W ratio) or d = 2, by up to 6 %, and they
    cost seconds from d*m ~ 2000 on (3.8 s CPU at d=16, m=128), so only there do they compete.
    """

    def build(variant: v_zb_builder.VzbVariant) -> Candidate:
        return lambda d, m: v_zb_builder.build_v_zb(d, m, sized_costs(costs, 2 * d), variant, memory=memory)

    candidates = [build(variant) for variant in v_zb_builder.VARIANTS]
    # Unequal stages: the greedy scheduler always competes too. Measured over four per-stage
    # settings (d 4/8, m 2d/4d, with and without comm) each won about half the cells, by up to 8 %.
    if num_microbatches < 2 * num_devices or num_devices <= 2 or not costs.uniform:
        candidates += greedy_candidates(V_ZB, costs, memory)
    return best_of("v-zb", candidates, num_devices, num_microbatches, costs, memory, share=("v-zb",))
