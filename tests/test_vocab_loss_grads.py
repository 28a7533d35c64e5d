"""The loss gradient in the next H's broadcast (``schedules/lowering/loss_grads.py``, issue 42: the authors'
Algorithm 2): which microbatches' g ride, the lowered collectives, and the NCCL model, pure Python."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_vshape.schedules.core.actions import Action, VocabKind
from megatron_vshape.schedules.core.schedule import Costs, VocabWork
from megatron_vshape.schedules.generators.registry import SCHEDULES, get_schedule
from megatron_vshape.schedules.lowering.exchange import OpKind
from megatron_vshape.schedules.lowering.loss_grads import carried_loss_grads
from megatron_vshape.schedules.lowering.nccl_model import NcclMismatch, check_program, run_nccl_model
from megatron_vshape.schedules.lowering.program import lower_program
from megatron_vshape.schedules.lowering.validator import validate
from megatron_vshape.testing.g_after_next_h import g_after_next_h

COSTS = Costs(vocab=VocabWork(f=0.92, b=0.92, w=0.92, memory=0.5))


def _holder(schedule) -> int:
    return schedule.placement.device_of(schedule.num_stages - 1)


def _collectives(program) -> list[list[str]]:
    return [[op.label for op in rank.exchange if op.kind is OpKind.COLLECTIVE] for rank in program.ranks]


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_each_g_after_the_next_h_lets_every_loss_gradient_but_the_last_ride_and_the_programs_stay_nccl_safe(name):
    """Every rank's G(k) after H(k+1): g(k) rides in H(k+1)'s broadcast for all k but the last H's, so a call has
    one loss-gradient broadcast instead of m; each rank issues the same collectives in one order, and the
    NCCL model runs them (one queue and per-stream queues; the evaluation call has no G and carries nothing)."""
    for d in (2, 4):
        low = SCHEDULES[name].min_microbatches(d)
        m = max(low, 2 * d)
        schedule = g_after_next_h(get_schedule(name, d, m, COSTS))
        validate(schedule)
        order = [a.microbatch for a in schedule.programs[_holder(schedule)] if a.kind is VocabKind.H]
        assert carried_loss_grads(schedule.programs, _holder(schedule)) == dict(zip(order, order[1:]))
        train, evaluate = lower_program(schedule, COSTS), lower_program(schedule, COSTS, forward_only_call=True)
        every = _collectives(train)
        assert all(labels == every[0] for labels in every), (name, d)
        assert [x for x in every[0] if x.endswith("loss gradient")] == [f"H{order[-1]} loss gradient"], (name, d)
        assert f"H{order[1]} hidden state and labels, loss gradient of {order[0]}" in every[0], (name, d)
        per_h = [x for x in every[0] if x.startswith("H")]
        assert len(per_h) == 3 * m + 1, (name, d)  # broadcast, all-gather, reduce per H; one g per call
        check_program(train, evaluate, (True, False))
        assert not any("loss gradient" in x for labels in _collectives(evaluate) for x in labels)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_the_generators_run_each_g_after_the_next_h_so_every_loss_gradient_but_the_last_rides(name):
    """The placement (vocab_passes.py) runs G(k) after H(k+1) on every rank (the last stage's, which computes g(k)
    in H(k), too: see ``_first_h_before_g``): on the schedules as built, m - 1 of the m loss gradients ride in the next H's broadcast and a
    call lowers 3m + 1 pipeline collectives in H instead of 4m (before issue 42's placement change: G right
    after its H, or in a gap before a later H, so none rode: 4m), with every rank issuing the same ones."""
    for d in (2, 4):
        m = max(SCHEDULES[name].min_microbatches(d), 2 * d)
        schedule = get_schedule(name, d, m, COSTS)
        holder = _holder(schedule)
        order = [a.microbatch for a in schedule.programs[holder] if a.kind is VocabKind.H]
        assert carried_loss_grads(schedule.programs, holder) == dict(zip(order, order[1:])), (name, d)
        every = _collectives(lower_program(schedule, COSTS))
        assert all(labels == every[0] for labels in every), (name, d)
        assert [x for x in every[0] if x.endswith("loss gradient")] == [f"H{order[-1]} loss gradient"], (name, d)
        assert len([x for x in every[0] if x.startswith("H")]) == 3 * m + 1, (name, d)
        for program in schedule.programs:  # every rank, the last stage's too (no rendezvous waits a G for it)
            at = {(a.kind, a.microbatch): i for i, a in enumerate(program) if isinstance(a.kind, VocabKind)}
            assert all(at[(VocabKind.G, k)] > at[(VocabKind.H, n)] for k, n in zip(order, order[1:])), (name, d)


@pytest.mark.parametrize("name", ["v-half", "v-zb"])
def test_the_schedules_as_built_ride_at_pp_2_and_4_and_pass_the_nccl_model(name):
    for d in (2, 4):
        for m in (d, 2 * d, 4 * d):
            m = max(m, SCHEDULES[name].min_microbatches(d))
            schedule = get_schedule(name, d, m, COSTS)
            validate(schedule)
            assert len(carried_loss_grads(schedule.programs, _holder(schedule))) == m - 1, (name, d, m)
            train, evaluate = lower_program(schedule, COSTS), lower_program(schedule, COSTS, forward_only_call=True)
            assert sum(x.startswith("H") for x in _collectives(train)[0]) == 3 * m + 1
            check_program(train, evaluate, (True, False))


def test_a_rank_that_expects_g_in_the_next_broadcast_when_another_does_not_is_a_mismatch_under_nccl():
    """The ranks must agree which g ride: the rule reads every rank's program. Lowered from two schedules that
    differ on one rank only (its G(0) before H(1)), the ranks' collectives differ and the NCCL model refuses."""
    plain = get_schedule("v-half", 2, 4, COSTS)
    holder = _holder(plain)
    other = 1 - holder
    order = [a.microbatch for a in plain.programs[holder] if a.kind is VocabKind.H]
    programs = [list(p) for p in plain.programs]
    g = Action(VocabKind.G, other, order[0])
    programs[other].remove(g)
    programs[other].insert(programs[other].index(Action(VocabKind.H, other, order[0])) + 1, g)
    early = replace(plain, programs=tuple(map(tuple, programs)))
    train_plain, train_early = lower_program(plain, COSTS), lower_program(early, COSTS)
    mixed = [None, None]
    mixed[holder], mixed[other] = train_plain.ranks[holder].exchange, train_early.ranks[other].exchange
    with pytest.raises(NcclMismatch):
        run_nccl_model([[tuple(ops)] for ops in mixed], True)


def test_a_g_before_the_next_h_on_one_rank_keeps_its_own_broadcast_on_every_rank():
    schedule = g_after_next_h(get_schedule("v-zb", 2, 4, COSTS))
    programs = [list(p) for p in schedule.programs]
    other = 1 - _holder(schedule)
    order = [a.microbatch for a in programs[_holder(schedule)] if a.kind is VocabKind.H]
    g = Action(VocabKind.G, other, order[0])
    programs[other].remove(g)
    programs[other].insert(programs[other].index(Action(VocabKind.H, other, order[0])) + 1, g)
    carried = carried_loss_grads(programs, _holder(schedule))
    assert order[0] not in carried and len(carried) == len(order) - 2
