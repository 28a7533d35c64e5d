"""The lowering chain (schedules/lowering/program.py): named passes, explicit levels, one program for the
executor, the NCCL model and the timeline's replay."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_vshape.schedules.core.actions import Kind
from megatron_vshape.schedules.core.schedule import Costs
from megatron_vshape.schedules.generators.registry import get_schedule
from megatron_vshape.schedules.lowering.exchange import exchange_programs
from megatron_vshape.schedules.lowering.messages import lower
from megatron_vshape.schedules.lowering.nccl_model import NcclDeadlock, check_program
from megatron_vshape.schedules.lowering.program import (
    Level,
    deferred_backwards,
    forward_only_plan,
    lower_program,
)

UNEQUAL = Costs.parse("f=1,b=1.1,w=0.9,comm=0.05")
CELLS = [("1f1b", 4, 8), ("zb-h1", 3, 6), ("v-half", 4, 8), ("v-zb", 2, 8), ("interleaved-1f1b", 2, 4)]


@pytest.mark.parametrize("name, d, m", CELLS)
def test_each_pass_adds_its_part_and_keeps_the_levels_below(name, d, m):
    schedule = get_schedule(name, d, m, UNEQUAL)
    plans = lower(schedule)
    program = lower_program(schedule, UNEQUAL)
    assert program.level is Level.EXCHANGE and not program.forward_only
    for device, (plan, rank) in enumerate(zip(plans, program.ranks)):
        # messages: the same steps, receives, sends and receive order as the messages pass alone
        assert [(s.action, s.recvs, s.sends) for s in rank.steps] == [tuple(s) for s in plan.steps]
        assert rank.recv_order == plan.recv_order
        # fused backward pairs: the rule, read once
        assert rank.deferred() == deferred_backwards(schedule, plan)
        # chunk marks: every local chunk gathers before its first F and reduces after its last backward pass
        for chunk, stage in enumerate(schedule.placement.stages_per_device[device]):
            indices = [i for i, s in enumerate(rank.steps) if s.action.stage == stage]
            first_f = min(i for i in indices if rank.steps[i].action.kind is Kind.F)
            last_backward = max(i for i in indices if rank.steps[i].action.kind is not Kind.F)
            assert [i for i, s in enumerate(rank.steps) if chunk in s.gathers_params_of] == [first_f]
            assert [i for i, s in enumerate(rank.steps) if chunk in s.reduces_grads_of] == [last_backward]
    # exchange: what exchange_programs gives for the same plans and costs
    assert [r.exchange for r in program.ranks] == list(exchange_programs(plans, UNEQUAL))


def test_a_lower_level_stops_the_chain_there():
    schedule = get_schedule("v-half", 4, 8)
    marked = lower_program(schedule, level=Level.MARKED)
    assert marked.level is Level.MARKED and all(r.exchange == () for r in marked.ranks)
    assert any(s.reduces_grads_of for s in marked.ranks[0].steps)
    messages = lower_program(schedule, level=Level.MESSAGES)
    assert not any(s.defers_w or s.gathers_params_of for r in messages.ranks for s in r.steps)


def test_forward_only_calls_keep_forwards_and_defer_nothing():
    schedule = get_schedule("v-zb", 4, 8)
    evaluate = lower_program(schedule, forward_only_call=True, defer_every_w=True)
    for plan, rank in zip(lower(schedule), evaluate.ranks):
        assert all(s.action.kind is Kind.F and not s.defers_w for s in rank.steps)
        assert [(s.action, s.recvs, s.sends) for s in rank.steps] == [tuple(s) for s in forward_only_plan(plan).steps]


def test_defer_every_w_captures_every_b_even_a_fused_pair():
    schedule = get_schedule("v-zb", 2, 4)  # V-ZB has B directly followed by its W on device 0
    plain, every = lower_program(schedule), lower_program(schedule, defer_every_w=True)
    fused_somewhere = False
    for a, b in zip(plain.ranks, every.ranks):
        all_b = {s.action for s in a.steps if s.action.kind is Kind.B}
        assert b.deferred() == all_b and a.deferred() <= all_b
        fused_somewhere |= a.deferred() < all_b
    assert fused_somewhere


def test_the_executors_program_is_the_one_the_nccl_model_checks():
    from megatron_vshape.runtime.executor import build_forward_backward_func

    executor = build_forward_backward_func("v-half", UNEQUAL)
    train, evaluate = executor.program(4, 8), executor.program(4, 8, forward_only=True)
    schedule = executor.schedule(4, 8)
    assert train == lower_program(schedule, UNEQUAL)
    assert evaluate == lower_program(schedule, UNEQUAL, forward_only_call=True)
    check_program(train, evaluate)
    # and the model reads that program: a rank whose program posts nothing hangs the pipeline
    ranks = list(train.ranks)
    ranks[1] = replace(ranks[1], exchange=())
    with pytest.raises(NcclDeadlock):
        check_program(replace(train, ranks=tuple(ranks)), evaluate, single_queue=(True,))
