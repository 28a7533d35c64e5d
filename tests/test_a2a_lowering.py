"""Overlapped F&B pairs through the lowering chain, and the expert-parallel all-to-all's queue in the NCCL model
(issue 43, item 1; pure Python).

A pair is one unit of the exchange program (both halves' receives waited before its F, both sends after),
and each F and B of a MoE stage records the all-to-alls Megatron's schedule plan issues for it on the
expert queue; the NCCL model runs the pipeline's programs as expert-parallel replicas and checks that queue's
rules (one order on every member, no cross-queue wait closing a cycle) with the others.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_vshape.schedules.core.actions import Kind
from megatron_vshape.schedules.core.schedule import Costs
from megatron_vshape.schedules.generators.registry import SCHEDULES, get_schedule
from megatron_vshape.schedules.lowering.exchange import (
    EXPERT_GROUP,
    EXPERT_QUEUE,
    PAIR_GROUP,
    Communicator,
    Op,
    OpKind,
    Transfer,
    a2a_labels,
)
from megatron_vshape.schedules.lowering.messages import CommError
from megatron_vshape.schedules.lowering.nccl_model import (
    NcclDeadlock,
    NcclMismatch,
    check_program,
    run_nccl_model,
    with_expert_replicas,
)
from megatron_vshape.schedules.lowering.program import Level, lower_program

A2A = Costs(a2a=1.0)
# The registry's schedules that form pairs at a2a > 0 (pairing.py): every split family and v-auto.
PAIRING = [name for name in SCHEDULES if name not in ("1f1b", "interleaved-1f1b", "gpipe")]


def _programs(name: str, d: int, m: int, layers: int = 1, costs: Costs = A2A):
    schedule = get_schedule(name, d, m, costs)
    expert = (layers,) * schedule.num_stages
    return (schedule, lower_program(schedule, costs, expert_layers=expert),
            lower_program(schedule, costs, forward_only_call=True, expert_layers=expert))


def test_pairs_are_marked_on_their_forward_and_dropped_by_evaluation_calls():
    schedule, train, evaluate = _programs("v-zb", 4, 16)
    assert schedule.pairs  # V-ZB pairs at a2a = 1 (54 pairs at d 4, m 16)
    marked = {(step.action, rank.steps[i + 1].action) for rank in train.ranks
              for i, step in enumerate(rank.steps) if step.overlaps_next}
    assert marked == {(pair.forward, pair.backward) for pair in schedule.pairs}
    assert not any(step.overlaps_next for rank in evaluate.ranks for step in rank.steps)
    messages = lower_program(schedule, A2A, level=Level.MESSAGES)
    assert sum(s.overlaps_next for r in messages.ranks for s in r.steps) == len(schedule.pairs)


@pytest.mark.parametrize("name", ["v-zb", "v-half", "zb-2p"])
def test_a_pair_is_one_unit_of_the_exchange_program(name):
    """Between a pair's two COMPUTE ops only waits for earlier sends; every receive of both halves is waited
    before the F's COMPUTE; nothing either half sends is posted before the B's COMPUTE."""
    schedule, train, _ = _programs(name, 4, 16, layers=0)
    assert schedule.pairs
    for rank in train.ranks:
        ops = rank.exchange
        at = {op.index: i for i, op in enumerate(ops) if op.kind is OpKind.COMPUTE}
        for index, step in enumerate(rank.steps):
            if not step.overlaps_next:
                continue
            f_at, b_at = at[index], at[index + 1]
            between = ops[f_at + 1:b_at]
            assert all(op.kind is OpKind.WAIT for op in between)
            for op in between:  # a wait between the halves is for a send-only batch (the slack's)
                assert all(t.message not in rank.steps[index + 1].recvs for t in ops[op.index].transfers)
            received_before = {t.message for i, op in enumerate(ops[:f_at]) if op.kind is OpKind.WAIT
                               for t in ops[op.index].transfers}
            assert set(step.recvs + rank.steps[index + 1].recvs) <= received_before
            sent_before = {t.message for op in ops[:b_at] if op.kind is OpKind.POST for t in op.transfers}
            assert not (set(step.sends + rank.steps[index + 1].sends) & sent_before)


def test_a2a_labels_follow_megatrons_schedule_plan_order():
    schedule, train, _ = _programs("v-zb", 2, 8, layers=2)
    rank = train.ranks[0]
    i = next(i for i, s in enumerate(rank.steps) if s.overlaps_next)
    f, b = rank.steps[i].action, rank.steps[i + 1].action
    assert a2a_labels(rank, i, (2,) * 4) == (
        f"{b} L1 combine", f"{f} L0 dispatch", f"{b} L1 dispatch", f"{f} L0 combine",
        f"{b} L0 combine", f"{f} L1 dispatch", f"{b} L0 dispatch", f"{f} L1 combine")
    assert a2a_labels(rank, i + 1, (2,) * 4) == ()  # the pair's F recorded them
    lone = next(j for j, s in enumerate(rank.steps) if s.action.kind is Kind.F and not s.overlaps_next)
    assert a2a_labels(rank, lone, (2,) * 4) == tuple(
        f"{rank.steps[lone].action} L{k} {w}" for k in (0, 1) for w in ("dispatch", "combine"))
    w = next(j for j, s in enumerate(rank.steps) if s.action.kind is Kind.W)
    assert a2a_labels(rank, w, (2,) * 4) == ()
    # uneven: a stage without MoE layers records nothing
    assert a2a_labels(rank, lone, (0,) * 4) == ()
    # the exchange program holds them on the expert queue, each waited at once
    expert = [op for op in rank.exchange if op.kind is OpKind.COLLECTIVE]
    assert expert and all(op.queue == EXPERT_QUEUE and op.communicator == Communicator(EXPERT_GROUP, 0, 0)
                          for op in expert)


@pytest.mark.parametrize("name", PAIRING)
def test_every_pairing_schedule_passes_the_nccl_model_with_the_all_to_all_queue(name):
    for d in (2, 3, 4):
        m = max(SCHEDULES[name].min_microbatches(d), 2 * d)
        for layers in (1, 2):
            schedule, train, evaluate = _programs(name, d, m, layers)
            check_program(train, evaluate, (True, False), expert_parallel=2)
        if d == 2:
            check_program(train, evaluate, (True,), expert_parallel=3)


def _replicated(name="v-zb", d=2, m=8):
    _, train, evaluate = _programs(name, d, m)
    return [[t.exchange] for t in train.ranks]


def test_replicas_share_an_expert_group_per_pipeline_rank_and_keep_their_own_p2p():
    programs = with_expert_replicas(_replicated(), 2)
    assert len(programs) == 4
    comms = {op.communicator for rank in programs for ops in rank for op in ops if op.communicator is not None}
    assert {c for c in comms if c.group == EXPERT_GROUP} == {Communicator(EXPERT_GROUP, 0, 2, 2),
                                                            Communicator(EXPERT_GROUP, 1, 3, 2)}
    assert {(c.lo, c.hi) for c in comms if c.group == PAIR_GROUP} == {(0, 1), (2, 3)}
    assert Communicator(EXPERT_GROUP, 1, 3, 2).members == {1, 3}
    run_nccl_model(programs, True)


def test_the_model_catches_replicas_that_order_the_all_to_alls_differently():
    programs = with_expert_replicas(_replicated(), 2)
    ops = list(programs[2][0])  # replica 1's pipeline rank 0: swap the labels of its first two all-to-alls
    first, second = [i for i, op in enumerate(ops) if op.kind is OpKind.COLLECTIVE][:2]
    ops[first], ops[second] = (ops[first]._replace(label=ops[second].label),
                               ops[second]._replace(label=ops[first].label))
    programs[2] = [ops]
    for single_queue in (True, False):
        with pytest.raises(NcclMismatch, match="expert"):
            run_nccl_model(programs, single_queue)


def test_the_model_catches_an_all_to_all_a_replica_never_issues():
    programs = with_expert_replicas(_replicated(), 2)
    ops = list(programs[3][0])
    last = max(i for i, op in enumerate(ops) if op.kind is OpKind.COLLECTIVE)
    programs[3] = [ops[:last]]  # replica 1's rank 1 stops before its last all-to-all
    with pytest.raises(NcclDeadlock, match=r"rank 1: host done, queue heads \[.*collective .* on the expert queue"):
        run_nccl_model(programs, False)


def test_the_model_catches_a_cycle_through_the_expert_queue_and_p2p():
    """Replica 0's rank 0 posts its all-to-all before it sends to rank 1; replica 1's rank 0 waits for a
    receive from its rank 1 first, whose all-to-all waits for replica 0's rank 1, which waits for that send."""
    def a2a(rank):
        return [Op(OpKind.COLLECTIVE, Communicator(EXPERT_GROUP, rank, rank), queue=EXPERT_QUEUE, label="a2a"),
                Op(OpKind.WAIT, index=0)]

    def post(src, dst):
        return Op(OpKind.POST, Communicator(PAIR_GROUP, 0, 1), (Transfer(src, dst, None),))

    r0p0 = a2a(0) + [post(0, 1), Op(OpKind.WAIT, index=2)]
    r0p1 = [post(0, 1), Op(OpKind.WAIT, index=0), *[op._replace(index=2) if op.kind is OpKind.WAIT else op
                                                    for op in a2a(1)]]
    r1p0 = [post(1, 0), Op(OpKind.WAIT, index=0), *[op._replace(index=2) if op.kind is OpKind.WAIT else op
                                                    for op in a2a(0)]]
    r1p1 = a2a(1) + [post(1, 0), Op(OpKind.WAIT, index=2)]
    programs = with_expert_replicas([[r0p0], [r0p1]], 2)
    programs[2], programs[3] = with_expert_replicas([[r1p0], [r1p1]], 2)[2:]
    for single_queue in (True, False):
        with pytest.raises(NcclDeadlock):
            run_nccl_model(programs, single_queue)
    # the same ops with both replicas in one order pass
    run_nccl_model(with_expert_replicas([[r0p0], [r0p1]], 2), True)


def test_expert_collectives_from_two_queues_are_refused():
    programs = with_expert_replicas(_replicated(), 2)
    ops = list(programs[0][0])
    first = next(i for i, op in enumerate(ops) if op.kind is OpKind.COLLECTIVE)
    ops[first] = ops[first]._replace(queue="compute-side")
    programs[0] = [ops]
    with pytest.raises(CommError, match="two queues"):
        run_nccl_model(programs, False)


def test_programs_without_experts_are_unchanged_by_the_expert_option():
    schedule = get_schedule("v-half", 4, 8)
    assert lower_program(schedule) == lower_program(schedule, expert_layers=())
    plain, zero = lower_program(schedule), lower_program(schedule, expert_layers=(0,) * 8)
    assert [r.exchange for r in plain.ranks] == [r.exchange for r in zero.ranks]
    # and a schedule without pairs gets only the collectives (same p2p ops in the same order)
    moe = lower_program(schedule, expert_layers=(1,) * 8)
    def p2p_and_compute(ops):
        return [op for op in ops if op.kind in (OpKind.POST, OpKind.COMPUTE)]

    for p, e in zip(plain.ranks, moe.ranks):
        assert p2p_and_compute(e.exchange) == p2p_and_compute(p.exchange)
        assert len(e.exchange) > len(p.exchange)
    assert replace(plain, ranks=moe.ranks) == moe
