"""The p2p programs the runtime issues cannot hang under NCCL's rules (pure Python, no torch).

``schedules.lowering.nccl_model`` runs the per-rank operation lists of the lowering chain (the ones
``runtime/p2p.py`` executes) under lazy pair-communicator creation, one in-order queue per rank
(``CUDA_DEVICE_MAX_CONNECTIONS=1``) or one queue per stream, and rendezvous matching. The old p2p
policy (receives pre-posted two ahead, one process group per direction, no warm-up, a thread that
waits on sends) is rebuilt here from its description and must hang in the same model.
The exhaustive grid (every schedule, PP 2..16, m in {min, d, 2d}) is
``python scripts/nccl_model_check.py``.
"""

from __future__ import annotations

import functools

import pytest

from megatron_vshape.schedules.core.schedule import Costs
from megatron_vshape.schedules.generators.registry import SCHEDULES, get_schedule, schedule_names
from megatron_vshape.schedules.lowering.exchange import (
    Communicator,
    Op,
    OpKind,
    Transfer,
    exchange_programs,
    pipeline_pairs,
    warmup_program,
)
from megatron_vshape.schedules.lowering.messages import CommError, DevicePlan, lower
from megatron_vshape.schedules.lowering.nccl_model import NcclDeadlock, NcclMismatch, check_exchange, run_nccl_model
from megatron_vshape.schedules.lowering.program import forward_only_plan

QUEUE_SETTINGS = pytest.mark.parametrize("single_queue", [True, False], ids=["max-connections-1", "streams"])


def _sizes(name: str, devices: range = range(2, 17)):
    """PP 2..16 with a few microbatch counts: m = 3 everywhere, m = d and 2d on small sizes, m = d at 6, 8, 16."""
    for d in devices:
        counts = {3}
        if d <= 4:
            counts |= {d, 2 * d}
        elif d in (6, 8, 16):
            counts.add(d)
        if SCHEDULES[name].min_microbatches(d) == d:  # interleaved: multiples of d
            counts = {-(-m // d) * d for m in counts}
        for m in sorted(counts):
            yield d, m


@functools.cache
def _plans(name: str, d: int, m: int) -> tuple[DevicePlan, ...]:
    return lower(get_schedule(name, d, m))


# --- the policy the runtime uses --------------------------------------------------------------


@pytest.mark.parametrize("devices", [range(2, 9), pytest.param(range(9, 17), marks=pytest.mark.slow)],
                         ids=["pp2-8", "pp9-16"])  # the fast tier stops at PP 8
@pytest.mark.parametrize("name", [n for n in schedule_names() if n != "v-auto"])
def test_every_schedule_is_nccl_safe_for_pp_2_to_16(name, devices):
    for d, m in _sizes(name, devices):
        check_exchange(_plans(name, d, m), single_queue=(True, False))


@pytest.mark.parametrize("d", [2, 3, 4])
def test_v_auto_is_nccl_safe(d):
    """v-auto takes seconds to build per size, so the test covers PP 2..4; the module's CLI covers 2..16."""
    for m in (3, 2 * d):
        check_exchange(_plans("v-auto", d, m), single_queue=(True, False))


def test_every_step_in_order_and_every_post_waited_once_before_its_message_is_used():
    for name in ("v-half", "zb-2p", "interleaved-1f1b"):
        plans = _plans(name, 4, 8)
        for rank, program in enumerate(exchange_programs(plans)):
            steps = [op.index for op in program if op.kind is OpKind.COMPUTE]
            assert steps == list(range(len(plans[rank].steps)))
            posts = [i for i, op in enumerate(program) if op.kind is OpKind.POST]
            waits = [op.index for op in program if op.kind is OpKind.WAIT]
            assert sorted(waits) == posts
            waited: set = set()
            for op in program:
                if op.kind is OpKind.WAIT:
                    waited.update(t.message for t in program[op.index].transfers if t.dst == rank)
                elif op.kind is OpKind.COMPUTE:
                    assert set(plans[rank].steps[op.index].recvs) <= waited, (rank, op)


def test_eager_waits_keep_one_operation_outstanding():
    plans = _plans("v-half", 4, 8)
    for program in exchange_programs(plans, eager_waits=True):
        for position, op in enumerate(program):
            if op.kind is OpKind.POST:  # waited for before anything else is issued
                assert program[position + 1] == Op(OpKind.WAIT, index=position)
    check_exchange(plans)


def test_waits_move_late_but_posts_keep_their_order():
    """The late waits change only where WAITs sit: the POSTs and passes are the eager program's."""
    for name in ("v-zb", "1f1b"):
        plans = _plans(name, 4, 8)
        late, eager = exchange_programs(plans), exchange_programs(plans, eager_waits=True)
        for a, b in zip(late, eager):
            assert [op for op in a if op.kind is not OpKind.WAIT] == [op for op in b if op.kind is not OpKind.WAIT]
        assert late != eager


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-2p", "v-min", "v-half", "v-zb", "interleaved-1f1b"])
def test_programs_from_measured_costs_are_nccl_safe(name):
    """Costs as a CPU run measures them (B > F > W, a message > 0): the global order G changes with them."""
    for costs, d, m in ((Costs(f=1.0, b=1.45, w=0.55, comm=0.08), 2, 8), (Costs(f=1.0, b=0.6, w=0.35, comm=0.3), 4, 8),
                        (Costs(f=1.0, b=1.2, w=0.8, comm=0.02), 3, 6)):
        plans = lower(get_schedule(name, d, m, costs))
        check_exchange(plans, single_queue=(True, False), costs=costs)


def test_each_channel_is_posted_in_send_order_on_both_sides():
    plans = _plans("v-zb", 4, 8)
    programs = exchange_programs(plans)
    for rank, program in enumerate(programs):
        seen: dict[tuple[int, int], list] = {}
        for op in program:
            for transfer in op.transfers:
                seen.setdefault((transfer.src, transfer.dst), []).append(transfer.message)
        for (src, dst), messages in seen.items():
            assert messages == list(plans[dst].recv_order[src]), (rank, src, dst)


def test_a_send_and_a_receive_at_one_boundary_share_one_batch():
    """1F1B's steady state: send the activation and receive the gradient as one NCCL group."""
    programs = exchange_programs(_plans("1f1b", 3, 6))
    batches = [op.transfers for op in programs[1] if op.kind is OpKind.POST]
    both_ways = [b for b in batches if {(t.src, t.dst) for t in b} == {(1, 2), (2, 1)}]
    assert len(both_ways) >= 3, batches


def test_warmup_connects_every_pair_once_in_one_order():
    d = 5
    for rank in range(d):
        comms = [op.communicator for op in warmup_program(rank, d) if op.kind is OpKind.POST]
        assert comms == sorted(comms)
        assert {(c.lo, c.hi) for c in comms} == {p for p in pipeline_pairs(d) if rank in p}


def test_forward_only_programs_are_safe_and_move_only_activations():
    plans = [forward_only_plan(p) for p in _plans("v-min", 4, 8)]
    for program in exchange_programs(plans):
        assert all(t.message.payload.value == "act" for op in program for t in op.transfers)


# --- the model catches what it must ------------------------------------------------------------


def _legacy_program(plan: DevicePlan, window: int = 2) -> tuple[Op, ...]:
    """The old runtime/p2p.py: per-direction groups, receives posted ``window`` ahead per peer,
    each send waited on by a helper thread right away (``Work.wait`` on NCCL makes the stream wait)."""
    ops: list[Op] = []
    posted = dict.fromkeys(plan.recv_order, 0)
    where: dict = {}
    position = {m: i for order in plan.recv_order.values() for i, m in enumerate(order)}

    def comm(msg):
        return Communicator.of("up" if msg.dst > msg.src else "down", msg.src, msg.dst)

    def post_upto(peer, count):
        order = plan.recv_order[peer]
        while posted[peer] < min(count, len(order)):
            msg = order[posted[peer]]
            ops.append(Op(OpKind.POST, comm(msg), (Transfer(msg.src, msg.dst, msg),)))
            where[msg] = len(ops) - 1
            posted[peer] += 1

    for peer in plan.recv_order:
        post_upto(peer, window)
    for index, step in enumerate(plan.steps):
        for msg in step.recvs:
            post_upto(msg.src, position[msg] + 1)
            ops.append(Op(OpKind.WAIT, index=where[msg]))
            post_upto(msg.src, position[msg] + 1 + window)
        ops.append(Op(OpKind.COMPUTE, index=index))
        for msg in step.sends:
            ops.append(Op(OpKind.POST, comm(msg), (Transfer(msg.src, msg.dst, msg),)))
            ops.append(Op(OpKind.WAIT, index=len(ops) - 1))
    return tuple(ops)


def _legacy_warmup(rank: int, d: int) -> tuple[Op, ...]:
    ops: list[Op] = []
    for group in ("down", "up"):
        for lo, hi in pipeline_pairs(d):
            if rank in (lo, hi):
                ops.append(Op(OpKind.POST, Communicator(group, lo, hi), (Transfer(lo, hi, None), Transfer(hi, lo, None))))
                ops.append(Op(OpKind.WAIT, index=len(ops) - 1))
    return tuple(ops)


@QUEUE_SETTINGS
@pytest.mark.parametrize("name", [n for n in schedule_names() if n != "v-auto"])
def test_old_policy_hangs_at_the_first_exchange(name, single_queue):
    """Defect 1: rank 0 first creates the 'down' communicator of (0, 1), rank 1 the 'up' one."""
    for d in (2, 4):
        plans = _plans(name, d, 2 * d)
        with pytest.raises(NcclDeadlock, match=r"rank 0: host creating Communicator\(group='down', lo=0, hi=1\)"):
            run_nccl_model([[_legacy_program(plan)] for plan in plans], single_queue)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "v-half", "v-zb"])
def test_old_receive_window_hangs_on_one_queue_even_after_warmup(name):
    """Defect 2: a receive posted ahead blocks the compute its peer waits for, but only on one queue."""
    d = 4
    plans = _plans(name, d, 2 * d)
    programs = [[_legacy_warmup(r, d), _legacy_program(plan)] for r, plan in enumerate(plans)]
    with pytest.raises(NcclDeadlock):
        run_nccl_model(programs, single_queue=True)
    run_nccl_model(programs, single_queue=False)  # the same operations on separate streams finish


@QUEUE_SETTINGS
def test_a_warmup_that_connects_the_successor_first_hangs(single_queue):
    """The one-order rule matters: on a ring (interleaved's wrap pair) 'successor first' is a cycle."""
    d = 4
    plans = _plans("interleaved-1f1b", d, 2 * d)
    train = exchange_programs(plans)
    ring = []
    for rank in range(d):
        ops = list(warmup_program(rank, d))
        pairs = [ops[i:i + 2] for i in range(0, len(ops), 2)]
        successor = (rank + 1) % d
        pairs.sort(key=lambda pair: {pair[0].communicator.lo, pair[0].communicator.hi} != {rank, successor})
        ring.append([op if op.kind is OpKind.POST else Op(OpKind.WAIT, index=i - 1)
                     for i, op in enumerate(o for pair in pairs for o in pair)])
    with pytest.raises(NcclDeadlock, match="host creating"):
        run_nccl_model([[ring[r], train[r]] for r in range(d)], single_queue)
    run_nccl_model([[warmup_program(r, d), train[r]] for r in range(d)], single_queue)


def test_swapped_receive_order_is_a_mismatch():
    """A receiver that expects an activation where its peer sends a gradient (Megatron's swap)."""
    plans = list(_plans("v-half", 2, 4))
    order = list(plans[1].recv_order[0])
    i = next(k for k in range(len(order) - 1) if order[k].payload is not order[k + 1].payload)
    order[i], order[i + 1] = order[i + 1], order[i]
    plans[1] = DevicePlan(plans[1].steps, {**plans[1].recv_order, 0: tuple(order)})
    with pytest.raises(NcclMismatch, match="expects"):
        check_exchange(plans, single_queue=(True,))


def test_a_receive_that_is_never_sent_is_refused():
    plans = list(_plans("1f1b", 2, 2))
    plans[1] = DevicePlan(plans[1].steps, {0: plans[1].recv_order[0][:-1]})
    with pytest.raises(CommError, match="expects 1 messages from 0, which sends 2"):
        exchange_programs(plans)


# --- the model's rules, one at a time ----------------------------------------------------------

A, B = Communicator("pair", 0, 1), Communicator("other", 0, 1)


def _post(comm, *transfers):
    return Op(OpKind.POST, comm, tuple(Transfer(s, d, m) for s, d, m in transfers))


def _wait(index):
    return Op(OpKind.WAIT, index=index)


def _compute(index):
    return Op(OpKind.COMPUTE, index=index)


@QUEUE_SETTINGS
def test_rule_lazy_creation_in_crossed_order_hangs(single_queue):
    rank0 = [_post(A, (0, 1, "x")), _wait(0), _post(B, (0, 1, "y")), _wait(2)]
    rank1 = [_post(B, (0, 1, "y")), _wait(0), _post(A, (0, 1, "x")), _wait(2)]
    with pytest.raises(NcclDeadlock, match="host creating"):
        run_nccl_model([[rank0], [rank1]], single_queue)
    run_nccl_model([[rank0], [rank0]], single_queue)  # the same order on both ranks: fine


@QUEUE_SETTINGS
def test_rule_send_completes_only_when_the_peer_receives(single_queue):
    """Both ranks send first, in separate operations: each send waits for a receive that is queued behind it."""
    rank0 = [_post(A, (0, 1, "x")), _wait(0), _post(A, (1, 0, "y")), _wait(2)]
    rank1 = [_post(A, (1, 0, "y")), _wait(0), _post(A, (0, 1, "x")), _wait(2)]
    with pytest.raises(NcclDeadlock):
        run_nccl_model([[rank0], [rank1]], single_queue)
    batched0 = [_post(A, (0, 1, "x"), (1, 0, "y")), _wait(0)]
    batched1 = [_post(A, (0, 1, "x"), (1, 0, "y")), _wait(0)]
    run_nccl_model([[batched0], [batched1]], single_queue)


def test_rule_one_queue_a_posted_receive_blocks_later_compute():
    """Rank 0 pre-posts a receive, then computes what rank 1 waits for: fine on streams, a hang on one queue."""
    C = Communicator("pair", 0, 1)  # noqa: N806
    D = Communicator("more", 0, 1)  # noqa: N806
    rank0 = [_post(C, (1, 0, "y")), _compute(0), _post(D, (0, 1, "x")), _wait(2), _wait(0)]
    rank1 = [_post(D, (0, 1, "x")), _wait(0), _compute(0), _post(C, (1, 0, "y")), _wait(3)]
    warm = [[_post(C, (0, 1, "w")), _wait(0), _post(D, (0, 1, "w")), _wait(2)]] * 2
    programs = [[warm[0], rank0], [warm[1], rank1]]
    run_nccl_model(programs, single_queue=False)
    with pytest.raises(NcclDeadlock):
        run_nccl_model(programs, single_queue=True)


def test_rule_positional_matching_reports_a_swap():
    rank0 = [_post(A, (0, 1, "act"), (0, 1, "grad")), _wait(0)]
    rank1 = [_post(A, (0, 1, "grad"), (0, 1, "act")), _wait(0)]
    with pytest.raises(NcclMismatch, match="rank 1 expects grad and receives act"):
        run_nccl_model([[rank0], [rank1]], single_queue=True)
