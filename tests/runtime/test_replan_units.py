"""The pure parts of re-planning from measured costs (runtime.replan): when it measures, how it
turns seconds into costs, and that it never switches to a schedule predicted to be worse."""

from megatron_vshape.runtime.replan import CostProfile, PassClock, ReplanPolicy, decide, relative_costs
from megatron_vshape.schedules import Costs, Kind, get_schedule, simulate


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


def test_local_medians_mark_unseen_kinds_for_the_max_over_ranks():
    profile = CostProfile(ReplanPolicy())
    profile.add({Kind.F: [3.0, 1.0, 2.0], Kind.B: [], Kind.W: [0.5]})
    assert profile.local_medians() == [2.0, -1.0, 0.5]


def test_relative_costs_scale_to_f_and_keep_the_fallback_ratio_when_unseen():
    costs = relative_costs({"f": 2.0, "b": 2.2, "w": -1.0, "comm": 0.1}, Costs(f=1, b=1, w=0.9))
    assert (costs.f, round(costs.b, 9), costs.w, round(costs.comm, 9)) == (1.0, 1.1, 0.9, 0.05)


def test_cpu_clock_divides_by_the_layer_scale():
    clock = PassClock(cuda=False)
    clock.stop(Kind.F, 2.0, clock.start())
    (value,) = clock.seconds()[Kind.F]
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
