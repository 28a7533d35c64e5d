"""runtime/p2p.py on real ranks (gloo): warm-up, then every message lands in the buffer meant for it.

Each sent tensor encodes its message, so a receive that got another message's tensor (an
activation swapped with a gradient) fails the comparison. No megatron: only the exchange.
"""

from __future__ import annotations

import pytest

from megatron_vshape.testing import spawn

pytestmark = pytest.mark.slow  # launches processes: not in the fast tier (-m "not slow")

MESSAGE_WIDTH = 5


def _encode(msg):
    import torch

    kind = 1.0 if msg.payload.value == "act" else 2.0
    return torch.tensor([kind, msg.src_stage, msg.microbatch, msg.src, msg.dst], dtype=torch.float32)


def _run_plan(plans, program, groups, rank) -> int:
    import torch

    from megatron_vshape.runtime.p2p import PlanExchange

    exchange = PlanExchange(program, groups, lambda msg: torch.full((MESSAGE_WIDTH,), -1.0))
    received = 0
    for index, step in enumerate(plans[rank].steps):
        exchange.advance(index)
        for msg in step.recvs:
            got = exchange.recv(msg)
            if not torch.equal(got, _encode(msg)):
                raise AssertionError(f"rank {rank}: {msg} received {got.tolist()}")
            received += 1
        for msg in step.sends:
            exchange.send(msg, _encode(msg))
    exchange.finish()
    return received


def _exchange_worker(rank, world_size, cases):
    import torch.distributed as dist

    from megatron_vshape.runtime.p2p import PairGroups
    from megatron_vshape.schedules.generators.registry import get_schedule
    from megatron_vshape.schedules.lowering.exchange import exchange_programs
    from megatron_vshape.schedules.lowering.messages import lower
    from megatron_vshape.schedules.lowering.program import forward_only_plan

    counts = {}
    for name, pp, microbatches in cases:
        pipelines = [list(range(start, start + pp)) for start in range(0, world_size, pp)]
        made = [dist.new_group(ranks) for ranks in pipelines]  # every rank creates every group
        pp_group = made[rank // pp]
        groups = PairGroups.create(pp_group)
        plans = lower(get_schedule(name, pp, microbatches))
        train = _run_plan(plans, exchange_programs(plans)[groups.rank], groups, groups.rank)
        evaluation = [forward_only_plan(p) for p in plans]
        evaluate = _run_plan(evaluation, exchange_programs(evaluation)[groups.rank], groups, groups.rank)
        counts[f"{name}/pp{pp}"] = (train, evaluate)
    return counts


@pytest.mark.timeout(240)
def test_programs_deliver_every_message_to_its_receive_on_gloo():
    cases = [("v-half", 4, 8), ("interleaved-1f1b", 4, 8), ("zb-2p", 4, 5), ("v-zb", 2, 4), ("1f1b", 2, 3)]
    from megatron_vshape.schedules.generators.registry import get_schedule
    from megatron_vshape.schedules.lowering.messages import lower
    from megatron_vshape.schedules.lowering.program import forward_only_plan

    results = spawn(_exchange_worker, 4, (cases,), timeout=200)
    for name, pp, m in cases:
        plans = lower(get_schedule(name, pp, m))
        expected = []
        for rank in range(4):
            plan = plans[rank % pp]
            expected.append((sum(len(s.recvs) for s in plan.steps),
                             sum(len(s.recvs) for s in forward_only_plan(plan).steps)))
        assert [r[f"{name}/pp{pp}"] for r in results] == expected, name
        assert all(train > 0 for train, _ in expected)


def _swap_worker(rank, world_size):
    """A receiver whose program expects the two messages of one batch the other way round."""
    import torch
    import torch.distributed as dist

    from megatron_vshape.runtime.p2p import PairGroups, PlanExchange
    from megatron_vshape.schedules.lowering.exchange import Communicator, Op, OpKind, Transfer
    from megatron_vshape.schedules.lowering.messages import Message, Payload

    groups = PairGroups.create(dist.group.WORLD)
    act = Message(Payload.ACTIVATION, 0, 0, 0, 1)
    grad = Message(Payload.GRADIENT, 3, 0, 0, 1)
    sent = (Transfer(0, 1, act), Transfer(0, 1, grad))
    order = sent if rank == 0 else sent[::-1]
    program = (Op(OpKind.POST, Communicator("pair", 0, 1), order), Op(OpKind.WAIT, index=0), Op(OpKind.COMPUTE, index=0))
    exchange = PlanExchange(program, groups, lambda msg: torch.zeros(MESSAGE_WIDTH))
    if rank == 0:
        exchange.send(act, _encode(act))
        exchange.send(grad, _encode(grad))
    exchange.advance(0)
    got = None
    if rank == 1:
        got = exchange.recv(act).tolist()
        exchange.recv(grad)
    exchange.finish()
    return got


@pytest.mark.timeout(120)
def test_a_program_with_swapped_receives_swaps_tensors():
    """What the NCCL model reports as a mismatch is a real, silent swap: NCCL and gloo match by position."""
    from megatron_vshape.schedules.lowering.messages import Message, Payload

    results = spawn(_swap_worker, 2, timeout=100)
    grad = Message(Payload.GRADIENT, 3, 0, 0, 1)
    assert results[1] == _encode(grad).tolist()
