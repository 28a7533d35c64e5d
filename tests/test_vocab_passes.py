"""Vocabulary passes in the schedules (vocabulary parallelism): placed for every schedule, timed with the
rendezvous of their collectives, validated, lowered with their collectives, and checked under NCCL's rules."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_vshape.schedules.core.actions import Action, Kind, VocabKind, parse_action
from megatron_vshape.schedules.core.inputs import InputError
from megatron_vshape.schedules.core.schedule import Costs, Schedule, ScheduleError, VocabWork
from megatron_vshape.schedules.core.simulator import DeadlockError, simulate
from megatron_vshape.schedules.core.vocab_embedding import embedding_slots, held_peak
from megatron_vshape.schedules.generators.registry import SCHEDULES, get_schedule
from megatron_vshape.schedules.lowering.exchange import (
    PAIR_GROUP,
    PIPELINE_GROUP,
    VOCAB_QUEUE,
    Communicator,
    Op,
    OpKind,
    Transfer,
    warmup_program,
)
from megatron_vshape.schedules.lowering.messages import CommError, check_plan, lower
from megatron_vshape.schedules.lowering.nccl_model import (
    NcclDeadlock,
    NcclMismatch,
    check_program,
    run_nccl_model,
)
from megatron_vshape.schedules.lowering.program import lower_program
from megatron_vshape.schedules.lowering.validator import InvalidSchedule, validate

HEAD = VocabWork(f=0.92, b=0.92, w=0.92, memory=0.5)
UNEQUAL = Costs(f=1.0, b=1.3, w=0.8, comm=0.05)
SIZES = [(1, 2), (2, 4), (3, 6), (4, 8), (4, 4)]


def _cells():
    for name in SCHEDULES:
        for d, m in SIZES:
            if SCHEDULES[name].check(d, m) is None:
                yield name, d, m


def test_actions_text_round_trips_with_vocabulary_passes():
    assert parse_action("H2.5") == Action(VocabKind.H, 2, 5)
    assert str(Action(VocabKind.G, 0, 3)) == "G0.3"
    schedule = get_schedule("v-half", 1, 1, Costs(vocab=HEAD))
    assert schedule.to_text() == "F0.0 F1.0 H0.0 G0.0 B1.0 W1.0 B0.0 W0.0"
    again = Schedule.from_text(schedule.to_text(), "x", schedule.placement)
    assert again.vocab_parallel and again.programs == schedule.programs


@pytest.mark.parametrize("name, d, m", list(_cells()))
def test_every_schedule_gets_one_h_and_g_per_device_and_microbatch_and_validates(name, d, m):
    for base in (Costs(), UNEQUAL):
        costs = replace(base, vocab=HEAD)
        schedule = get_schedule(name, d, m, costs)
        assert schedule.vocab_parallel
        validate(schedule)
        for device, program in enumerate(schedule.programs):
            hs = [a.microbatch for a in program if a.kind is VocabKind.H]
            gs = sorted(a.microbatch for a in program if a.kind is VocabKind.G)
            assert sorted(hs) == gs == list(range(m))
            assert all(a.stage == device for a in program if isinstance(a.kind, VocabKind))
        transformer = get_schedule(name, d, m, base)
        stripped = tuple(tuple(a for a in p if not isinstance(a.kind, VocabKind)) for p in schedule.programs)
        assert stripped == transformer.programs  # the generator's order is kept; only H and G are added
        train, evaluate = lower_program(schedule, costs), lower_program(schedule, costs, forward_only_call=True)
        check_program(train, evaluate)  # both queue settings, under NCCL's rules


@pytest.mark.parametrize("name, d, m", [c for c in _cells() if c[1] > 1])
def test_on_uniform_stages_the_head_costs_its_even_share_only(name, d, m):
    """With F, B and W alike the pass boundaries line up and each H column costs its own time: the
    makespan is the transformer schedule's plus every device's share of the head's work."""
    costs = Costs(vocab=HEAD)
    plain = simulate(get_schedule(name, d, m))
    result = simulate(get_schedule(name, d, m, costs), costs)
    share = m * (HEAD.f + HEAD.b + HEAD.w) / d
    assert result.makespan == pytest.approx(plain.makespan + share)
    assert max(result.work_each) == pytest.approx(min(result.work_each))  # the head's work is spread evenly


def test_the_issue_table_v_zb_keeps_its_zero_bubble_with_the_head_spread():
    """Llama-3 8B's head (0.92 of a V chunk's passes) at PP 8, 32 microbatches."""
    stages = (1.0,) * 15 + (1.92,)
    from megatron_vshape.schedules.core.schedule import StageWork

    head_on_stage = Costs().with_stages([StageWork(t, t, t) for t in stages])
    on_stage = simulate(get_schedule("v-zb", 8, 32, head_on_stage), head_on_stage)
    spread = simulate(get_schedule("v-zb", 8, 32, Costs(vocab=HEAD)), Costs(vocab=HEAD))
    uniform = simulate(get_schedule("v-zb", 8, 32))
    assert uniform.bubble_rate == 0.0 and spread.bubble_rate == pytest.approx(0.0, abs=1e-9)
    assert on_stage.bubble_rate > 0.2
    assert spread.makespan < on_stage.makespan


def test_every_h_of_a_microbatch_starts_at_once():
    costs = replace(UNEQUAL, vocab=HEAD)
    schedule = get_schedule("v-zb", 4, 8, costs)
    timeline = simulate(schedule, costs).timeline
    for k in range(8):
        starts = {round(timeline[Action(VocabKind.H, r, k)].start, 9) for r in range(4)}
        assert len(starts) == 1
        last_f = timeline[Action(Kind.F, schedule.num_stages - 1, k)]
        assert starts.pop() >= last_f.end - 1e-9
        assert timeline[Action(Kind.B, schedule.num_stages - 1, k)].start >= timeline[Action(VocabKind.H, 0, k)].end - 1e-9


def test_memory_counts_what_h_holds_until_g():
    costs = Costs(vocab=HEAD)
    plain = simulate(get_schedule("v-half", 2, 4))
    result = simulate(get_schedule("v-half", 2, 4, costs), costs)
    held = HEAD.memory / 2 / 2  # per shard, in units of one microbatch over L/d layers (a V chunk F is 1/2)
    # two microbatches' worth: G(k) runs after H(k+1) (its g rides in that H's broadcast), so H(k+1) allocates
    # before G(k) frees (one, with G right after its H, before issue 42's move)
    assert max(result.peak_memory) == pytest.approx(max(plain.peak_memory) + 2 * held)


@pytest.mark.parametrize("name", ["v-half", "v-zb", "1f1b"])
def test_memory_counts_the_embeddings_buffers_bounded_whatever_m(name):
    """The first stage's device holds embeddings (E to F(0, k)) and their gradients (B(0, k) to D) and every
    device the tokens (T(k) to D(k)): the simulator's memory timeline counts them (VocabWork.embedding and
    .tokens), by the runtime's slots, and the same at m = 16 and 64."""
    embedding, tokens = 0.4, 0.01
    rises = []
    for m in (16, 64):
        costs = Costs(vocab=HEAD)
        schedule = get_schedule(name, 4, m, costs)
        first = schedule.placement.device_of(0)
        base = simulate(schedule, costs).peak_memory
        with_embedding = simulate(schedule, replace(costs, vocab=replace(HEAD, embedding=embedding))).peak_memory
        with_tokens = simulate(schedule, replace(costs, vocab=replace(HEAD, tokens=tokens))).peak_memory
        held = held_peak(schedule.programs[first], training=True)
        rise = with_embedding[first] - base[first]
        # some of the first stage's embeddings are held at its peak, never more than the most it holds at once
        assert 0 < rise <= held * embedding / 2 + 1e-9, (name, m, rise, held)
        assert [a == b for a, b in zip(with_embedding, base)] == [d != first for d in range(4)]
        assert all(0 < t - b <= 12 * tokens / 2 + 1e-9 for t, b in zip(with_tokens, base)), (name, m)  # a few, every device
        rises.append((round(rise, 9), tuple(round(t - b, 9) for t, b in zip(with_tokens, base))))
    assert rises[0] == rises[1], (name, rises)


@pytest.mark.parametrize("name", ["v-half", "1f1b", "v-zb"])
def test_the_last_stages_h_is_longer_and_the_other_devices_g_waits_for_its_end(name):
    """What runs per rank (runtime/vocab_h.py): every H starts at the rendezvous; the last stage's device's H
    also runs the loss function and waits for the reduce (VocabWork.holder), the others post and leave; their
    G(k) needs the loss gradient, which that H broadcasts at its end."""
    base = Costs(f=1.0, b=1.3, w=0.8, comm=0.05, vocab=HEAD)
    schedule = get_schedule(name, 4, 8, base)  # built with every H alike, as training builds it
    costs = replace(base, vocab=replace(HEAD, holder=0.5))
    result = simulate(schedule, costs)
    holder = schedule.placement.device_of(schedule.num_stages - 1)
    for k in range(8):
        spans = {d: result.timeline[Action(VocabKind.H, d, k)] for d in range(4)}
        assert len({round(iv.start, 9) for iv in spans.values()}) == 1  # one rendezvous
        others = {round(iv.end - iv.start, 9) for d, iv in spans.items() if d != holder}
        assert others == {round(spans[holder].end - spans[holder].start - 0.5, 9)}
        for d in range(4):
            assert result.timeline[Action(VocabKind.G, d, k)].start >= spans[holder].end - 1e-9, (d, k)
    assert result.makespan_total >= simulate(schedule, base).makespan_total


def _swap_h(schedule: Schedule, device: int, a: int, b: int) -> Schedule:
    """Device ``device`` runs the vocabulary passes of microbatches ``a`` and ``b`` in each other's places."""
    swap = {a: b, b: a}
    program = tuple(Action(x.kind, x.stage, swap.get(x.microbatch, x.microbatch)) if isinstance(x.kind, VocabKind) else x
                    for x in schedule.programs[device])
    programs = list(schedule.programs)
    programs[device] = program
    return replace(schedule, programs=tuple(programs))


def test_collectives_in_another_order_on_one_device_are_refused_and_hang_under_nccl():
    costs = Costs(vocab=HEAD)
    schedule = get_schedule("1f1b", 2, 4, costs)
    broken = _swap_h(schedule, 0, 1, 2)  # device 0 does not hold the last stage: only the order breaks
    with pytest.raises(InvalidSchedule, match="another order"):
        validate(broken)
    with pytest.raises((CommError, DeadlockError)):
        check_plan(lower(broken))
    # The exchange of the good schedule, with one rank's collectives of two H swapped: NCCL would pair one
    # rank's broadcast with another's all-gather; with one collective skipped, the others wait forever.
    train = lower_program(schedule, costs)
    ops = [list(rank.exchange) for rank in train.ranks]
    collective = [i for i, op in enumerate(ops[1]) if op.kind is OpKind.COLLECTIVE]
    swapped = [list(o) for o in ops]
    i, j = collective[4], collective[8]  # the first collective of H1 and of H2
    swapped[1][i], swapped[1][j] = swapped[1][j], swapped[1][i]
    with pytest.raises(NcclMismatch):
        run_nccl_model([[tuple(o)] for o in swapped], single_queue=False)
    skipped = [list(o) for o in ops]
    gone = collective[-1]  # rank 1 skips the last loss-gradient broadcast (and its wait)
    skipped[1] = [Op(OpKind.COMPUTE) if i == gone or (op.kind is OpKind.WAIT and op.index == gone) else op
                  for i, op in enumerate(skipped[1])]
    for single_queue in (True, False):
        with pytest.raises(NcclDeadlock):
            run_nccl_model([[tuple(o)] for o in skipped], single_queue)


def test_h_posts_its_collectives_on_the_vocabulary_queue_and_waits_only_where_needed():
    """Per H: three collectives on the vocabulary queue in one order on every rank, and the loss gradient of
    the H before in its broadcast (G(k) runs after H(k+1) on every rank); only the last H's loss gradient has
    a broadcast of its own. The last stage's rank waits for the reduce in H, the others at their next H (the
    send buffer let go there, not at G(k) after it; the last H's at its G), and nobody waits for a loss
    gradient before G but in the broadcast it rides in (or, for the last, right before its G)."""
    costs = Costs(vocab=HEAD)
    schedule = get_schedule("v-half", 2, 4, costs)
    train = lower_program(schedule, costs)
    every = [[op.label for op in rank.exchange if op.kind is OpKind.COLLECTIVE] for rank in train.ranks]
    assert every[0] == every[1]  # one order on every rank, the embedding's collectives included
    labels = [[x for x in rank if x.startswith("H")] for rank in every]
    assert labels[0][:4] == ["H0 hidden state and labels", "H0 statistics", "H0 hidden gradient",
                             "H1 hidden state and labels, loss gradient of 0"]
    assert [x for x in labels[0] if x.endswith("loss gradient")] == ["H3 loss gradient"]
    # the embedding per microbatch: one lookup reduce (E) and one gradient broadcast (D) each, and its tokens (T)
    assert sorted(x for x in every[0] if x[0] in "ED") == sorted(f"{w}{k} embedding" for w in "ED" for k in range(4))
    assert sorted(x for x in every[0] if x[0] == "T") == sorted(f"T{k} tokens" for k in range(4))
    assert {op.queue for rank in train.ranks for op in rank.exchange if op.kind is OpKind.COLLECTIVE} == {VOCAB_QUEUE}
    for r, rank in enumerate(train.ranks):
        ops = rank.exchange
        waited = {op.index for op in ops if op.kind is OpKind.WAIT}
        by_label = {op.label: i for i, op in enumerate(ops) if op.kind is OpKind.COLLECTIVE}
        holder = r == 0  # the V's last stage is on device 0
        assert (by_label["H0 hidden state and labels"] in waited) is not holder
        assert (by_label["H1 hidden state and labels, loss gradient of 0"] in waited) is not holder
        assert by_label["H0 statistics"] in waited
        g_step = next(i for i, op in enumerate(ops) if op.kind is OpKind.COMPUTE
                      and rank.steps[op.index].action == Action(VocabKind.G, r, 0))
        h1 = by_label["H1 hidden state and labels, loss gradient of 0"]
        reduce_waits = [i for i, op in enumerate(ops) if op.kind is OpKind.WAIT and op.index == by_label["H0 hidden gradient"]]
        if holder:  # in H0, before its B
            assert len(reduce_waits) == 1 and reduce_waits[0] < h1
        else:  # at H1, its broadcast posted (the send buffer let go before H1 makes its own), not at G(0)
            assert reduce_waits == [h1 + 1] and ops[h1 + 2].kind is OpKind.WAIT and ops[h1 + 2].index == h1
            assert ops[g_step - 1].kind is not OpKind.WAIT  # g(0) came in H1's broadcast: G(0) waits for nothing
        loss_wait = next(i for i, op in enumerate(ops) if op.kind is OpKind.WAIT and op.index == by_label["H3 loss gradient"])
        last_g = next(i for i, op in enumerate(ops) if op.kind is OpKind.COMPUTE
                      and rank.steps[op.index].action == Action(VocabKind.G, r, 3))
        assert loss_wait == last_g - 1  # right before G(3): the broadcast (after the last reduce's send: no H after)
        if not holder:
            assert ops[last_g - 2].kind is OpKind.WAIT and ops[last_g - 2].index == by_label["H3 hidden gradient"]
    evaluate = lower_program(schedule, costs, forward_only_call=True)
    assert {op.label.split(" ", 1)[1] for rank in evaluate.ranks for op in rank.exchange
            if op.kind is OpKind.COLLECTIVE} == {"hidden state and labels", "statistics", "embedding", "tokens"}


def test_the_first_stage_holds_a_bounded_number_of_embeddings_whatever_m():
    """The embedding's collectives go at the H passes (schedules/core/vocab_embedding.py): the first
    stage's rank holds embeddings and their gradients for a few microbatches, the same at m = 16 and 64
    (the call-wide prologue held all m)."""
    costs = Costs(vocab=HEAD)
    for name in ("1f1b", "v-half", "v-zb", "v-min", "zb-1p"):
        peaks = []
        for m in (16, 64):
            schedule = get_schedule(name, 4, m, costs)
            actions = schedule.programs[schedule.placement.device_of(0)]
            slots = embedding_slots(actions, training=True)
            assert sorted(k for ks in slots.lookups for k in ks) == list(range(m))
            assert sorted(k for ks in slots.grads for k in ks) == list(range(m))
            peaks.append(held_peak(actions, training=True))
        assert peaks[0] == peaks[1] <= 8, (name, peaks)


def test_a_wait_across_queues_that_closes_a_cycle_deadlocks():
    """Rank 1 posts its collective only after waiting for a message that rank 0 sends only after waiting
    for that collective: the model's cross-queue rule finds the cycle on separate queues too."""
    whole = Communicator(PIPELINE_GROUP, 0, 1)
    pair = Communicator(PAIR_GROUP, 0, 1)
    collective = Op(OpKind.COLLECTIVE, whole, queue=VOCAB_QUEUE, label="c")
    rank0 = (collective, Op(OpKind.WAIT, index=0), Op(OpKind.POST, pair, (Transfer(0, 1, None),)), Op(OpKind.WAIT, index=2))
    rank1 = (Op(OpKind.POST, pair, (Transfer(0, 1, None),)), Op(OpKind.WAIT, index=0), collective, Op(OpKind.WAIT, index=2))
    def connected(r, ops):  # both communicators created first, in one order (no lazy-creation hang)
        return [warmup_program(r, 2), (Op(OpKind.COLLECTIVE, whole, queue=VOCAB_QUEUE, label="create"),
                                       Op(OpKind.WAIT, index=0)), ops]

    for single_queue in (True, False):
        with pytest.raises(NcclDeadlock):
            run_nccl_model([connected(0, rank0), connected(1, rank1)], single_queue)
    fine = (Op(OpKind.POST, pair, (Transfer(0, 1, None),)), collective, Op(OpKind.WAIT, index=1), Op(OpKind.WAIT, index=0))
    run_nccl_model([connected(0, rank0), connected(1, fine)], single_queue=False)


def test_an_h_before_what_the_last_stage_needs_first_deadlocks_everywhere():
    """Device 1 joins H(0) before its own F of microbatch 0, which the last stage needs for its F(0)."""
    costs = Costs(vocab=HEAD)
    schedule = get_schedule("1f1b", 2, 2, costs)
    program = [a for a in schedule.programs[0] if a != Action(VocabKind.H, 0, 0)]
    program.insert(0, Action(VocabKind.H, 0, 0))  # device 0 holds stage 0: the last stage (1) waits for its F
    bad = replace(schedule, programs=(tuple(program), schedule.programs[1]))
    with pytest.raises(DeadlockError):
        simulate(bad, costs)
    with pytest.raises(CommError, match="collective"):
        check_plan(lower(bad))
    with pytest.raises(ScheduleError, match="collective"):
        validate(bad)


def test_lowering_puts_h_on_the_pipeline_communicator_and_keeps_it_for_evaluation():
    costs = replace(UNEQUAL, vocab=HEAD)
    schedule = get_schedule("v-zb", 3, 6, costs)
    train = lower_program(schedule, costs)
    evaluate = lower_program(schedule, costs, forward_only_call=True)
    whole = Communicator(PIPELINE_GROUP, 0, 2)
    for t, e in zip(train.ranks, evaluate.ranks):
        steps = {i: s.action for i, s in enumerate(t.steps)}
        collective = [steps[op.index] for op in t.exchange if op.kind is OpKind.COMPUTE
                      and steps[op.index].kind is VocabKind.H]
        assert collective == [s.action for s in t.steps if s.action.kind is VocabKind.H]
        assert {op.communicator for op in t.exchange if op.kind is OpKind.COLLECTIVE} == {whole}
        assert not any(s.sends or s.recvs for s in t.steps if isinstance(s.action.kind, VocabKind))
        assert {s.action.kind for s in e.steps} == {Kind.F, VocabKind.H}
        # the shard's parameters are the first chunk's: its gradient reduction waits for the last G
        last_g = max(i for i, s in enumerate(t.steps) if s.action.kind is VocabKind.G)
        marked = max(i for i, s in enumerate(t.steps) if 0 in s.reduces_grads_of)
        assert marked >= last_g
        first_h = min(i for i, s in enumerate(t.steps) if s.action.kind is VocabKind.H)
        gathered = min(i for i, s in enumerate(t.steps) if 0 in s.gathers_params_of)
        assert gathered <= first_h


def test_zero_bubble_schedules_put_g_into_idle_gaps_and_memory_schedules_right_after_h():
    """On the memory schedules G(k) runs right after H(k+1) on every device (g(k) rides in that H's broadcast:
    lowering/loss_grads.py; the last H's G right after the G before it); the zero-bubble ones put some G
    into idle gaps after those H passes."""
    costs = replace(UNEQUAL, vocab=HEAD)
    for name, after in (("v-half", True), ("v-min", True), ("1f1b", True), ("v-zb", False)):
        schedule = get_schedule(name, 4, 8, costs)
        holder = schedule.placement.device_of(schedule.num_stages - 1)
        order = [a.microbatch for a in schedule.programs[holder] if a.kind is VocabKind.H]
        follows = {**dict(zip(order, order[1:])), order[-1]: order[-1]}
        right_after = True
        for program in schedule.programs:
            at = {(a.kind, a.microbatch): i for i, a in enumerate(program) if isinstance(a.kind, VocabKind)}
            for k, n in follows.items():
                assert at[(VocabKind.G, k)] > at[(VocabKind.H, n)], (name, k)
                right_after &= at[(VocabKind.G, k)] == at[(VocabKind.H, n)] + 1 + (k == n != order[0])
        assert right_after is after, name


def test_vocabulary_costs_parse_and_refuse_in_one_line():
    assert VocabWork.parse("time=0.92") == VocabWork(0.92, 0.92, 0.92, 0.0)
    assert VocabWork.parse("f=1,b=2,w=3,memory=0.5") == VocabWork(1, 2, 3, 0.5)
    for bad in ("time=0.9,f=1", "x=1", "f=-1", "f=nan"):
        with pytest.raises(InputError, match="--vocab-parallel"):
            VocabWork.parse(bad)
    with pytest.raises(ScheduleError, match="no vocabulary passes"):
        simulate(get_schedule("v-half", 2, 4), Costs(vocab=HEAD))
    with pytest.raises(ScheduleError, match="vocabulary passes"):
        simulate(get_schedule("v-half", 2, 4, Costs(vocab=HEAD)), Costs())


def test_deferred_g_passes_wait_at_most_the_cap_on_every_device():
    """A G(k) in a gap runs after H(k+1) and before the H MAX_DEFERRED_G rendezvous after it: at most 4 G's
    inputs held on a device (the cap's 2, the H just run, and one more since G(k) waits for H(k+1): before
    issue 42's move, 3)."""
    from megatron_vshape.schedules.generators.vocab_passes import MAX_DEFERRED_G

    costs = replace(UNEQUAL, vocab=VocabWork(f=0.5, b=0.5, w=0.1, memory=1.0))  # small G: many gaps fit one
    for name in ("v-zb", "zb-1p", "zb-2p"):
        schedule = get_schedule(name, 4, 16, costs)
        in_gaps = 0  # G passes after a layer's pass: they waited for a gap
        for program in schedule.programs:
            waiting, most = [], 0
            for before, action in zip((None, *program), program):
                if action.kind is VocabKind.H:
                    waiting.append(action.microbatch)
                elif action.kind is VocabKind.G:
                    in_gaps += not isinstance(before.kind, VocabKind)  # after a layer's pass: in its gap
                    waiting.remove(action.microbatch)
                most = max(most, len(waiting))
            assert most <= 4, (name, program)
        assert in_gaps > 0, name  # some G did wait for a gap
    assert MAX_DEFERRED_G == 2


@pytest.mark.slow  # matplotlib
def test_vshape_plot_draws_the_vocabulary_passes(tmp_path, capsys):
    from megatron_vshape.cli import main

    out = tmp_path / "vocab.svg"
    assert main(["plot", "-s", "v-zb", "--stages", "4", "--microbatches", "8", "--vocab-parallel", "time=0.92",
                 "-o", str(out)]) == 0
    svg = out.read_text()
    assert "H (vocabulary" in svg and "G (vocabulary weight grad)" in svg


@pytest.mark.parametrize("name", ["v-zb", "1f1b", "v-half"])
def test_a_timing_run_with_a_horizon_times_every_pass_that_starts_by_it_as_the_full_run_does(name):
    """The H placement's trials time only a little past the pace they are judged by (timing.run_id_programs
    with ``horizon_pass``): every pass they do time has the full run's times, and every pass starting by the
    horizon pass's end plus the longest pass and message is timed."""
    from megatron_vshape.schedules.core.ready import UNSET, input_table
    from megatron_vshape.schedules.core.simulator import pass_durations
    from megatron_vshape.schedules.core.timing import PassIds, run_id_programs

    costs = replace(UNEQUAL, vocab=VocabWork(0.9, 0.9, 0.9))
    schedule = get_schedule(name, 4, 12, costs)
    ids = PassIds(schedule.num_stages, 12)
    table = input_table([schedule.placement.device_of(s) for s in range(schedule.num_stages)], 12, costs.comm,
                        schedule.fused_backward, 4)
    durations = pass_durations(schedule, costs)
    programs = [[ids.of(a) for a in program] for program in schedule.programs]
    full = run_id_programs(programs, ids, durations, table, 4)
    last = schedule.num_stages - 1
    horizon_pass = ids.of(Action(Kind.F, last, 4))
    part = run_id_programs(programs, ids, durations, table, 4, horizon_pass=horizon_pass)
    horizon = full.end[horizon_pass] + max(durations) + costs.comm
    every = [x for program in programs for x in program]
    timed = [x for x in every if part.end[x] != UNSET]
    assert all((part.start[x], part.end[x]) == (full.start[x], full.end[x]) for x in timed)
    assert all(part.end[x] != UNSET for x in every if full.start[x] <= horizon)
    assert len(timed) < len(every)  # it did stop early
