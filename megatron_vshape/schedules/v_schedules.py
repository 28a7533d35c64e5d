"""V-Min and V-Half: the paper's building blocks on the V placement (interval 6 slots)."""

from __future__ import annotations

from collections.abc import Sequence

from .actions import Kind
from .blocks import BuildingBlock, fill_w, schedule_from_block
from .schedule import Costs, Placement, Schedule

V_INTERVAL = 6  # two chunks x (F, B, W) of one slot each


def v_block(starts: Sequence[tuple[int, int, int, int]]) -> BuildingBlock:
    """The V block with device i's F/B passes at ``starts[i]`` = slots of [F chunk 0, F chunk 1,
    B chunk 1, B chunk 0]; each W goes into a free slot after its B (``fill_w``)."""
    placement = Placement.v_shape(len(starts))
    offsets = {}
    for (f0, f1, b1, b0), (chunk0, chunk1) in zip(starts, placement.stages_per_device):
        offsets.update({(Kind.F, chunk0): f0, (Kind.F, chunk1): f1, (Kind.B, chunk1): b1, (Kind.B, chunk0): b0})
    return fill_w(placement, V_INTERVAL, offsets)


def v_min_block(num_devices: int) -> BuildingBlock:
    d = num_devices
    x = 2 if d % 3 == 0 else 0
    return v_block([(i, 2 * d - 1 - i, 2 * d + x + i, 4 * d + x - 1 - i) for i in range(d)])


def v_half_block(num_devices: int) -> BuildingBlock:
    d = num_devices
    x = 3 if d % 2 == 0 else 0
    return v_block([(2 * i, 3 * d - 2 - i, 3 * d + x + 2 * i - 1, 6 * d + x - 2 - i) for i in range(d)])


def v_min(num_devices: int, num_microbatches: int, costs: Costs) -> Schedule:
    return schedule_from_block(v_min_block(num_devices), num_microbatches, costs, "v-min")


def v_half(num_devices: int, num_microbatches: int, costs: Costs) -> Schedule:
    return schedule_from_block(v_half_block(num_devices), num_microbatches, costs, "v-half")
