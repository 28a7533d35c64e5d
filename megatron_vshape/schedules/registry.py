"""Schedules by name: the one place that knows every generator and its limits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import adaptive, baselines, v_schedules, zero_bubble
from .schedule import Costs, MemoryModel, PlacementKind, Schedule, ScheduleError


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    placement: PlacementKind
    description: str
    build: Callable[..., Schedule]  # (num_devices, num_microbatches, costs, chunks) -> Schedule
    min_microbatches: Callable[[int], int] = lambda num_devices: 1
    microbatch_rule: str = "m >= 1"  # human-readable form of the size rule, for `vshape list`
    takes_memory_limit: bool = False  # build() accepts memory_limit (a fraction of 1F1B's peak)
    takes_memory_model: bool = False  # build() accepts memory= (caps the schedule under that MemoryModel)
    splits_backward: bool = True  # False: every W directly follows its B (plain backward)


SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("gpipe", PlacementKind.LOOPED, "all forwards, then all backwards",
                     lambda d, m, c, v: baselines.gpipe(d, m), splits_backward=False),
        ScheduleSpec("1f1b", PlacementKind.LOOPED, "one-forward-one-backward (Megatron's default)",
                     lambda d, m, c, v: baselines.one_f_one_b(d, m), splits_backward=False),
        ScheduleSpec("interleaved-1f1b", PlacementKind.LOOPED,
                     "Megatron's virtual pipeline, --chunks model chunks per device",
                     lambda d, m, c, v: baselines.interleaved_one_f_one_b(d, m, v),
                     min_microbatches=lambda d: d, splits_backward=False,
                     microbatch_rule="m a multiple of d (Megatron's rule)"),
        ScheduleSpec("zb-h1", PlacementKind.LOOPED, "zero bubble, 1F1B's memory, 1F1B's in-flight count",
                     lambda d, m, c, v, memory=MemoryModel(): zero_bubble.zb_h1(d, m, c, memory),
                     takes_memory_model=True),
        ScheduleSpec("zb-1p", PlacementKind.LOOPED, "zero bubble, memory capped at 1F1B's peak",
                     lambda d, m, c, v, memory=MemoryModel(): zero_bubble.zb_p(d, m, c, 1, memory),
                     takes_memory_model=True),
        ScheduleSpec("zb-2p", PlacementKind.LOOPED, "zero bubble, memory capped at 2x 1F1B's peak",
                     lambda d, m, c, v, memory=MemoryModel(): zero_bubble.zb_p(d, m, c, 2, memory),
                     takes_memory_model=True),
        ScheduleSpec("v-min", PlacementKind.V, "V placement, about 1/3 of 1F1B's activation memory",
                     lambda d, m, c, v: v_schedules.v_min(d, m, c)),
        ScheduleSpec("v-half", PlacementKind.V, "V placement, about 1/2 of 1F1B's activation memory",
                     lambda d, m, c, v: v_schedules.v_half(d, m, c)),
        ScheduleSpec("v-zb", PlacementKind.V, "V placement, 1F1B's memory, near-zero bubble",
                     lambda d, m, c, v, memory=MemoryModel(): zero_bubble.v_zb(d, m, c, memory),
                     takes_memory_model=True),
        ScheduleSpec("v-auto", PlacementKind.V,
                     "V placement, lowest bubble within --memory-limit X (x 1F1B's peak; default 1)",
                     lambda d, m, c, v, limit=None: adaptive.v_auto(d, m, c, limit),
                     takes_memory_limit=True),
    )
}


def schedule_names() -> list[str]:
    return list(SCHEDULES)


def get_schedule(
    name: str,
    num_devices: int,
    num_microbatches: int,
    costs: Costs = Costs(),
    chunks: int = 2,
    memory_limit: float | None = None,
    memory: MemoryModel | None = None,
) -> Schedule:
    """Build schedule ``name`` for ``num_devices`` pipeline devices and ``num_microbatches``.

    ``memory``: the activation model the schedule's memory cap is kept under (zero-bubble family;
    e.g. ``MemoryModel.for_gpt``, where B frees part, lets ZB-1P keep more forwards in flight).
    Other schedules have a fixed order and ignore it.

    Raises :class:`ScheduleError` with a one-line fix for unknown names and bad sizes.
    """
    spec = SCHEDULES.get(name)
    if spec is None:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of: {', '.join(SCHEDULES)}")
    if num_devices < 1:
        # One device is allowed: both V chunks (or the one looped stage) on it, which is how the
        # B/W split is checked on a single GPU.
        raise ScheduleError(f"{name} needs at least 1 pipeline device; got {num_devices}")
    minimum = spec.min_microbatches(num_devices)
    if num_microbatches < minimum:
        raise ScheduleError(
            f"{name} with {num_devices} devices needs at least {minimum} microbatches; got {num_microbatches}"
        )
    if memory_limit is not None and not spec.takes_memory_limit:
        raise ScheduleError(f"--memory-limit only applies to v-auto; {name} has a fixed memory footprint")
    if spec.takes_memory_limit:
        return spec.build(num_devices, num_microbatches, costs, chunks, memory_limit)
    if spec.takes_memory_model and memory is not None:
        return spec.build(num_devices, num_microbatches, costs, chunks, memory=memory)
    return spec.build(num_devices, num_microbatches, costs, chunks)
