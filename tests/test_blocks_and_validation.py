"""The building-block API, the simulator's accounting and the validator's negative cases."""

from __future__ import annotations

import pytest

from megatron_vshape.schedules.core.actions import Action, Kind
from megatron_vshape.schedules.core.schedule import Costs, Placement, Schedule, ScheduleError
from megatron_vshape.schedules.core.simulator import simulate
from megatron_vshape.schedules.generators.block import BuildingBlock, fill_w
from megatron_vshape.schedules.generators.block_schedule import schedule_from_block
from megatron_vshape.schedules.generators.registry import get_schedule
from megatron_vshape.schedules.generators.v_schedules import v_half_block, v_min_block
from megatron_vshape.schedules.lowering.messages import CommError, DevicePlan, check_plan, lower
from megatron_vshape.schedules.lowering.validator import validate


def my_block(d: int) -> BuildingBlock:
    """The README example: a V block whose forward and backward advance one slot per device."""
    placement = Placement.v_shape(d)
    offsets = {}
    for i, (chunk0, chunk1) in enumerate(placement.stages_per_device):
        offsets[(Kind.F, chunk0)] = i
        offsets[(Kind.F, chunk1)] = 2 * d - 1 - i
        offsets[(Kind.B, chunk1)] = 2 * d + i
        offsets[(Kind.B, chunk0)] = 4 * d - 1 - i
    return fill_w(placement, interval=6, fb_offsets=offsets)


@pytest.mark.parametrize("d", [2, 4, 5, 7])
def test_user_block_gives_a_valid_schedule(d):
    block = my_block(d)
    assert block.collisions() == []
    schedule = schedule_from_block(block, num_microbatches=3 * d, costs=Costs(), name="mine")
    validate(schedule)
    result = simulate(schedule)
    assert result.peak_memory_max <= max(block.memory_bound())


def test_collisions_are_reported():
    block = my_block(3)  # d % 3 == 0: the plain V-Min offsets collide (the paper adds x = 2)
    assert any("collides" in p for p in block.collisions())
    with pytest.raises(ScheduleError, match="building block is invalid"):
        block.repeat(4, "bad")


def test_broken_dependency_in_block_is_reported():
    block = v_min_block(4)
    offsets = dict(block.offsets)
    offsets[(Kind.B, 0)] = 0  # B before its own F
    broken = BuildingBlock(block.placement, 6, offsets)
    assert any("starts before" in p for p in broken.collisions())


@pytest.mark.parametrize("d", range(2, 9))
def test_lifespans_and_bound_of_paper_blocks(d):
    for block, fraction in ((v_min_block(d), 3), (v_half_block(d), 2)):
        spans = block.lifespans()
        assert all(span > 0 for span in spans.values())
        assert max(block.steady_peak()) <= max(block.memory_bound())
        # the bound is within one unit of 1F1B's peak divided by the fraction
        assert max(block.memory_bound()) <= d / fraction + 1.5


def test_comm_is_charged_only_between_devices():
    d, f, comm = 4, 1.0, 0.25
    schedule = get_schedule("v-half", d, 1)
    result = simulate(schedule, Costs(f=f, b=1, w=1, comm=comm))
    last_forward = result.timeline[Action(Kind.F, 2 * d - 1, 0)]
    # 2d forward chunks, 2d - 2 device hops (the tip of the V is local)
    assert last_forward.end == pytest.approx(2 * d * f + (2 * d - 2) * comm)


def test_memory_model_b_release():
    from megatron_vshape.schedules.core.schedule import MemoryModel

    schedule = get_schedule("1f1b", 4, 8)
    simple = simulate(schedule).peak_memory_max
    finer = simulate(schedule, memory=MemoryModel(b_release=0.5)).peak_memory_max
    assert finer <= simple
    gpt = MemoryModel.for_gpt(hidden=4096, heads=32, seq_length=2048)
    assert 0 < gpt.b_release < 1


def _programs(schedule):
    return [list(p) for p in schedule.programs]


def test_validator_catches_missing_action():
    s = get_schedule("1f1b", 2, 2)
    programs = _programs(s)
    programs[0].pop()
    with pytest.raises(ScheduleError, match="missing"):
        validate(Schedule(s.name, s.placement, 2, tuple(map(tuple, programs))))


def test_validator_catches_local_order_violation():
    s = get_schedule("1f1b", 2, 2)
    programs = _programs(s)
    i = programs[1].index(Action(Kind.B, 1, 0))
    programs[1][i], programs[1][i + 1] = programs[1][i + 1], programs[1][i]  # W before B
    with pytest.raises(ScheduleError, match="before its dependency"):
        validate(Schedule(s.name, s.placement, 2, tuple(map(tuple, programs))))


def test_validator_catches_cross_device_deadlock():
    s = get_schedule("gpipe", 2, 2)
    programs = _programs(s)
    # Device 1 runs microbatch 1's backward first: it needs F1.1, whose input F0.1 device 0
    # only produces after B0.0, which waits for B1.0, which device 1 runs after B1.1: a cycle.
    programs[0] = [Action(Kind.F, 0, 0), Action(Kind.B, 0, 0), Action(Kind.W, 0, 0),
                   Action(Kind.F, 0, 1), Action(Kind.B, 0, 1), Action(Kind.W, 0, 1)]
    programs[1] = [Action(Kind.F, 1, 0), Action(Kind.F, 1, 1), Action(Kind.B, 1, 1), Action(Kind.W, 1, 1),
                   Action(Kind.B, 1, 0), Action(Kind.W, 1, 0)]
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(Schedule(s.name, s.placement, 2, tuple(map(tuple, programs))))


def test_p2p_check_catches_swapped_receive_order():
    plans = lower(get_schedule("v-half", 2, 4))
    device = 1
    src, order = next(iter(plans[device].recv_order.items()))
    swapped = (order[1], order[0]) + order[2:]
    bad = list(plans)
    bad[device] = DevicePlan(plans[device].steps, {**plans[device].recv_order, src: swapped})
    with pytest.raises(CommError, match="different order"):
        check_plan(tuple(bad))


def test_v_tip_is_local():
    d = 4
    plans = lower(get_schedule("v-zb", d, 2))
    tip = plans[d - 1]
    for step in tip.steps:
        for msg in step.sends + step.recvs:
            assert {msg.src_stage, msg.dst_stage} != {d - 1, d}
