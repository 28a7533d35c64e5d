"""The pure parts of re-planning from measured costs (runtime.replan): when it measures, how it
turns seconds into costs, and that it never switches to a schedule predicted to be worse."""

import time

from megatron_vshape.runtime.replan import (
    LOAD,
    CostProfile,
    PassClock,
    ReplanPolicy,
    TimedIterator,
    decide,
    fold_stages,
    relative_costs,
    typical_chunk,
    with_measured_stages,
)
from megatron_vshape.runtime.timeline import simulated_idle
from megatron_vshape.schedules.core.actions import Kind
from megatron_vshape.schedules.core.schedule import Costs, StageWork, VocabWork
from megatron_vshape.schedules.core.simulator import simulate
from megatron_vshape.schedules.generators.registry import get_schedule


def test_profile_skips_one_warm_up_then_measures_then_is_due_once():
    profile = CostProfile(ReplanPolicy(iterations=2))
    seen = []
    for _ in range(5):
        seen.append((profile.measuring(), profile.due()))
        profile.training_calls += 1
        if profile.due():
            seen.append("replan")
            profile.done = True
    assert seen == [(False, False), (True, False), (True, False), "replan", (False, False), (False, False)]


def test_local_table_marks_unseen_stages_and_kinds_for_the_max_over_ranks():
    profile = CostProfile(ReplanPolicy())
    profile.add({(Kind.F, 1): [3.0, 1.0, 2.0], (Kind.W, 1): [0.5], (LOAD, 1): [0.25]})
    assert profile.local_table(2) == [-1.0, -1.0, -1.0, 2.0, -1.0, 0.5, 0.25]


def test_typical_chunk_takes_every_ratio_from_the_same_stages():
    """The embedding stage and the LM-head stage are heavy; the head's B was never deferred. A maximum
    per kind (the old rule) gave f = 5 against b = 1.5: B at 0.3 of F, which no layer has."""
    stages = ((3.0, 1.5, 1.0), (1.0, 1.0, 0.5), (1.2, 1.1, 0.6), (5.0, -1.0, -1.0))
    assert typical_chunk(stages) == {"f": 1.2, "b": 1.1, "w": 0.6}
    assert typical_chunk(((2.0, -1.0, -1.0), (4.0, -1.0, -1.0))) == {"f": 3.0, "b": -1.0, "w": -1.0}


def test_batch_loading_is_timed_apart_from_the_forward():
    def slow_batches():
        while True:
            time.sleep(0.05)
            yield 1

    loader = TimedIterator(slow_batches())
    clock = PassClock(cuda=False, loaders=[loader])
    started = clock.start()
    next(loader)
    time.sleep(0.01)
    clock.stop(Kind.F, 1.0, started, stage=0)
    seconds = clock.seconds()
    (forward,), (load,) = seconds[(Kind.F, 0)], seconds[(LOAD, 0)]
    assert load >= 0.05 and 0.01 <= forward < 0.05


def test_relative_costs_scale_to_f_and_keep_the_fallback_ratio_when_unseen():
    costs = relative_costs({"f": 2.0, "b": 2.2, "w": -1.0, "comm": 0.1}, Costs(f=1, b=1, w=0.9))
    assert (costs.f, round(costs.b, 9), costs.w, round(costs.comm, 9)) == (1.0, 1.1, 0.9, 0.05)


def test_relative_costs_keep_what_the_clock_does_not_measure_so_the_rebuilt_schedule_runs_the_same_passes():
    """--pipeline-costs auto with --pipeline-vocab-parallel rebuilt a schedule without H and G passes and failed in
    ``decide`` (ScheduleError); with --overlap-moe-expert-parallel-comm it dropped the pairs; under an uneven
    layout it dropped the layout's per-stage work."""
    stages = (StageWork(f=1.2, b=1.1, w=1.0, memory=1.3), StageWork()) * 2
    start = Costs(vocab=VocabWork(0.9, 0.9, 0.9, 0.5), a2a=0.6).with_stages(stages)
    costs = relative_costs({"f": 2.0, "b": 2.4, "w": 1.6, "comm": 0.2}, start)
    assert (costs.f, costs.b, costs.w, costs.comm) == (1.0, 1.2, 0.8, 0.1)
    assert (costs.vocab, costs.a2a, costs.stages) == (start.vocab, start.a2a, start.stages)
    current = get_schedule("v-half", 2, 4, start)
    replan, chosen = decide(current, get_schedule("v-half", 2, 4, costs), costs, 4, {})
    assert chosen.vocab_parallel and replan.bubble_before >= 0
    paired = Costs(a2a=1.0)
    assert get_schedule("v-zb", 4, 16, relative_costs({"f": 1.0, "b": 1.0, "w": 1.0, "comm": 0.0}, paired)).pairs


def test_cpu_clock_divides_by_the_layer_scale():
    clock = PassClock(cuda=False)
    clock.stop(Kind.F, 2.0, clock.start())
    (value,) = clock.seconds()[(Kind.F, -1)]
    assert 0 <= value < 1.0


def test_decide_keeps_the_running_schedule_when_the_rebuilt_one_is_worse():
    costs = Costs(f=1, b=1.1, w=0.9, comm=0.05)
    good = get_schedule("v-zb", 4, 8, costs)
    worse = get_schedule("v-min", 4, 8, costs)
    assert simulate(worse, costs).bubble_rate > simulate(good, costs).bubble_rate
    replan, chosen = decide(good, worse, costs, 4, {})
    assert chosen is good and not replan.switched
    replan, chosen = decide(worse, good, costs, 4, {})
    assert chosen is good and replan.switched and replan.bubble_after < replan.bubble_before


def test_each_stage_keeps_its_measured_work_and_shows_the_idle_equal_stages_hide():
    """The embedding stage and the LM head's stage (both on device 0 of a V) are heavier than the
    typical chunk: the costs keep each stage's ratio (a stage whose W never ran deferred takes its F's
    ratio for B and W; memory keeps the layout's). Simulated under them, V-ZB's other devices wait for
    device 0, which the typical chunk's costs (the ones the schedule is built for) do not show."""
    stages = ((1.5, 1.2, 0.8), (1.0, 1.0, 0.8), (1.0, 1.0, 0.8), (2.0, -1.0, -1.0))
    seconds = {**typical_chunk(stages), "comm": 0.0}
    base = Costs().with_stages([StageWork(memory=m) for m in (1.0, 1.0, 1.0, 3.0)])
    costs = with_measured_stages(relative_costs(seconds, Costs()), seconds, stages, base)
    assert [(w.f, w.b, w.w, w.memory) for w in costs.stages] == [
        (1.5, 1.2, 1.0, 1.0), (1.0, 1.0, 1.0, 1.0), (1.0, 1.0, 1.0, 1.0), (2.0, 2.0, 2.0, 3.0)]
    assert with_measured_stages(Costs(), {"f": 1.0, "b": -1.0, "w": -1.0}, stages, base) == Costs()
    typical = relative_costs(seconds, Costs())
    v_zb = get_schedule("v-zb", 2, 8, typical)
    equal, measured = simulated_idle(simulate(v_zb, typical)), simulated_idle(simulate(v_zb, costs))
    assert measured[1] > equal[1] + 0.1  # device 1 waits for the heavy device 0


def test_fold_stages_gives_a_looped_stage_the_mean_of_its_two_v_chunks():
    v = Costs().with_stages([StageWork(f=f) for f in (2.0, 1.0, 1.0, 3.0)])
    assert [w.f for w in fold_stages(v, 2).stages] == [1.5, 2.0]
    assert fold_stages(v, 4) is v and fold_stages(Costs(), 2) == Costs()
