"""Per-stage costs (issue 13): uniform costs give today's schedules, non-uniform ones stay valid.

``python tests/test_stage_costs.py --record`` rewrites tests/fixtures/uniform_schedules.json from
the current code; it was run once before per-stage costs reached any generator, so the fixture
is "today's" schedules and the comparison below is the guard that uniform costs change nothing.
Issue 44 rewrote fifteen V-Min / V-Half entries, each faster at the same peak: six at d = 8 (the late
block of ``v_schedules.v_min_late_block``, e.g. m = 16, equal costs: makespan 123 -> 122) and nine at
d = 4 and 8 (the local search of ``v_schedules._polished``, e.g. V-Min d = 4, m = 4, skewed: 43.1 -> 42.1);
and six v-auto entries at d = 2 have another order at the same makespan and peak (v-auto's V-Min and
V-Half candidates are those generators' own schedules now, and win the ties as the first candidates).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
from pathlib import Path

import pytest

from megatron_vshape import cli
from megatron_vshape.schedules.core.actions import Kind
from megatron_vshape.schedules.core.schedule import (
    Costs,
    ScheduleError,
    StageWork,
    looped_stage_work,
    one_f_one_b_peak,
    parse_stage_work,
)
from megatron_vshape.schedules.core.simulator import simulate
from megatron_vshape.schedules.generators.registry import get_schedule, schedule_names
from megatron_vshape.schedules.generators.v_schedules import v_half_block, v_min_block
from megatron_vshape.schedules.lowering.validator import validate

FIXTURE = Path(__file__).parent / "fixtures" / "uniform_schedules.json"
COST_SETTINGS = {
    "equal": Costs(),
    "skewed": Costs(f=1.0, b=1.5, w=0.7),
    "comm": Costs(f=1.2, b=1.0, w=0.9, comm=0.1),
}
GRID = [(d, m) for d in (2, 4, 8) for m in (d, 2 * d, 4 * d)]


def _is_slow(name: str, d: int, m: int) -> bool:
    """The fast tier re-checks every schedule at d = 2 and at d = m = 4 (v-auto: d = 2 only);
    the slow test the rest of the grid."""
    return d > 4 or (d == 4 and (m > 4 or name == "v-auto"))


def _key(name: str, d: int, m: int, setting: str) -> str:
    return f"{name} d={d} m={m} {setting}"


def _fingerprint(name: str, d: int, m: int, setting: str) -> dict:
    costs = COST_SETTINGS[setting]
    schedule = get_schedule(name, d, m, costs)
    result = simulate(schedule, costs)
    return {
        "actions_sha256": hashlib.sha256(schedule.to_text().encode()).hexdigest(),
        "makespan": round(result.makespan, 9),
        "peak_memory": [round(p, 9) for p in result.peak_memory],
    }


def _cells(slow: bool):
    for name in schedule_names():
        for d, m in GRID:
            if _is_slow(name, d, m) != slow:
                continue
            for setting in COST_SETTINGS:
                yield name, d, m, setting


def record() -> None:
    table = {_key(*cell): _fingerprint(*cell) for slow in (False, True) for cell in _cells(slow)}
    FIXTURE.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(table)} fingerprints to {FIXTURE}")


def _compare(slow: bool) -> None:
    expected = json.loads(FIXTURE.read_text())
    changed = [
        _key(*cell) for cell in _cells(slow) if _fingerprint(*cell) != expected[_key(*cell)]
    ]
    assert not changed, f"uniform-cost schedules changed: {changed[:5]} ({len(changed)} in all)"


def test_uniform_schedules_unchanged_fast_cells():
    _compare(slow=False)


@pytest.mark.slow
def test_uniform_schedules_unchanged_large_cells():
    _compare(slow=True)


# ---------------------------------------------------------------- the API


def _ends(num_stages: int, time: float = 2.0, memory: float = 1.0, last_memory: float = 3.0):
    """First and last stage ``time`` x heavier (embedding; head and loss), the last holding
    ``last_memory`` x the activations (logits), the rest plain layers."""
    return tuple(
        StageWork(f=time, b=time, w=time, memory=last_memory if s == num_stages - 1 else memory)
        if s in (0, num_stages - 1) else StageWork()
        for s in range(num_stages)
    )


def test_costs_of_stage_scales_the_base_time():
    costs = Costs(f=1.0, b=2.0, w=0.5).with_stages([StageWork(f=3.0, b=1.5, memory=4.0), StageWork()])
    assert (costs.of(Kind.F, 0), costs.of(Kind.B, 0), costs.of(Kind.W, 0)) == (3.0, 3.0, 0.5)
    assert costs.of(Kind.F, 1) == 1.0 and costs.of(Kind.B) == 2.0  # no stage: the base time
    assert (costs.memory_of(0), costs.memory_of(1)) == (4.0, 1.0)
    assert not costs.uniform and Costs().uniform and Costs().memory_of(5) == 1.0
    assert Costs().with_stages([StageWork()] * 4).uniform  # all ones is the uniform model


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_bad_multipliers_are_refused(bad):
    with pytest.raises(ScheduleError, match="finite numbers > 0"):
        StageWork(f=bad)
    with pytest.raises(ScheduleError, match="finite numbers > 0"):
        StageWork(memory=bad)


@pytest.mark.parametrize("name, given, wanted", [("v-half", 4, 8), ("1f1b", 8, 4), ("zb-1p", 3, 4), ("v-zb", 4, 8)])
def test_a_stage_count_that_does_not_match_is_refused(name, given, wanted):
    costs = Costs().with_stages(_ends(given))
    with pytest.raises(ScheduleError, match=f"give {given} stages but {name} on 4 devices has {wanted}"):
        get_schedule(name, 4, 8, costs)


def test_parse_stage_work():
    work = parse_stage_work("time=2,1,1,2; memory=1,1,1,3", 4)
    assert work == _ends(4)
    assert parse_stage_work("f=1.5,1", 2) == (StageWork(f=1.5), StageWork())
    for text, fragment in [("f=1,2", "f has 2 values but the schedule has 4 stages"),
                           ("x=1,1,1,1", "bad group"), ("f=1,1,1,0", "f[3]: must be in"),
                           ("time=1,1,1,1;f=1,1,1,1", "f is given twice"), ("", "empty")]:
        with pytest.raises(ValueError, match=re.escape(f"--stage-costs: {fragment}")):
            parse_stage_work(text, 4)


def test_looped_stage_work_folds_v_stages_pairwise():
    folded = looped_stage_work(Costs().with_stages(_ends(8)), 4)
    assert folded[0] == StageWork(f=1.5, b=1.5, w=1.5, memory=1.0)
    assert folded[3] == StageWork(f=1.5, b=1.5, w=1.5, memory=2.0)
    assert folded[1] == folded[2] == StageWork()
    assert one_f_one_b_peak(4, Costs().with_stages(_ends(8))) == 4.0  # device 0: 4 x 1.0 > device 3: 1 x 2.0
    assert one_f_one_b_peak(4, Costs().with_stages(_ends(8, memory=3.0))) == 8.0  # 4 x (3 + 1) / 2
    assert one_f_one_b_peak(4) == 4.0


# ---------------------------------------------------------------- the simulator, by hand


def test_simulator_per_stage_timing_by_hand():
    """1F1B, 2 devices, 1 microbatch: a looped stage is two V chunks, so every time doubles.

    F0 [0,2] F1 [2,8] B1 [8,12] W1 [12,14] (fused: B0 waits for W1) B0 [14,16] W0 [16,18].
    """
    costs = Costs().with_stages([StageWork(), StageWork(f=3.0, b=2.0, memory=4.0)])
    result = simulate(get_schedule("1f1b", 2, 1, costs), costs)
    timeline = {str(action): (iv.start, iv.end) for action, iv in result.timeline.items()}
    assert timeline == {"F0.0": (0, 2), "B0.0": (14, 16), "W0.0": (16, 18),
                        "F1.0": (2, 8), "B1.0": (8, 12), "W1.0": (12, 14)}
    assert result.makespan == 18 and result.work_each == (6, 12) and result.work_per_device == 12
    # Idle share of both devices' time: the lighter device's idle time (imbalance) counts, not only the
    # busiest device's (that would read 1 - 12/18 and say 0 % for any pipeline paced by one heavy device).
    assert result.bubble_rate == pytest.approx(1 - (6 + 12) / 2 / 18)
    assert result.peak_memory == (1.0, 4.0)  # stage 1's activations weigh 4


@pytest.mark.parametrize("name", ["1f1b", "zb-1p", "v-half", "v-zb"])
def test_heavier_stages_take_longer(name):
    d, m = 4, 8
    stages = 2 * d if name.startswith("v") else d
    spans = []
    for time in (1.0, 1.5, 2.5):
        costs = Costs().with_stages(_ends(stages, time=time, last_memory=1.0))
        spans.append(simulate(get_schedule(name, d, m, costs), costs).makespan)
    assert spans[0] < spans[1] < spans[2]
    assert spans[0] == simulate(get_schedule(name, d, m)).makespan  # all ones: today's schedule


# ---------------------------------------------------------------- validity and memory bounds

HEAVY_V = Costs(f=1.0, b=1.2, w=0.8, comm=0.05).with_stages(_ends(8))
HEAVY_LOOPED = HEAVY_V.with_stages(looped_stage_work(HEAVY_V, 4))


@pytest.mark.parametrize("name, factor", [("zb-h1", 1), ("zb-1p", 1), ("zb-2p", 2), ("v-zb", 1)])
def test_zero_bubble_caps_hold_under_per_stage_memory(name, factor):
    costs = HEAVY_V if name.startswith("v") else HEAVY_LOOPED
    schedule = get_schedule(name, 4, 12, costs)
    validate(schedule)
    peak = simulate(schedule, costs).peak_memory_max
    one_f_one_b = simulate(get_schedule("1f1b", 4, 12, HEAVY_LOOPED), HEAVY_LOOPED).peak_memory_max
    assert one_f_one_b == one_f_one_b_peak(4, costs)
    assert peak <= factor * one_f_one_b + 1e-9


def test_v_zb_builder_handles_unequal_stages():
    """The constructive V-ZB builder (not only the greedy one) completes with a slow first and
    last stage; before it skipped unready passes it failed every variant here."""
    from megatron_vshape.schedules.generators import v_zb_builder

    built = [v_zb_builder.build_v_zb(4, 16, HEAVY_V, variant) for variant in v_zb_builder.VARIANTS]
    assert all(schedule is not None for schedule in built)
    for schedule in built:
        validate(schedule)
        assert simulate(schedule, HEAVY_V).peak_memory_max <= one_f_one_b_peak(4, HEAVY_V) + 1e-9


def test_sized_costs_keep_the_ends_for_proxy_pipelines():
    from megatron_vshape.schedules.generators.zero_bubble import sized_costs

    costs = Costs().with_stages(_ends(16))
    small = sized_costs(costs, 8)
    assert small.stages[0] == costs.stages[0] and small.stages[-1] == costs.stages[-1]
    assert small.stages[1:-1] == (StageWork(),) * 6
    assert sized_costs(costs, 16) is costs and sized_costs(Costs(), 8) == Costs()
    assert sized_costs(Costs().with_stages([StageWork()] * 16), 8) == Costs()


@pytest.mark.slow
def test_large_zero_bubble_schedules_rank_on_a_proxy_with_per_stage_costs():
    """Above 2048 cells the variants are ranked on a 16-device proxy: its costs must fit it."""
    d, m = 18, 120
    costs = Costs().with_stages(_ends(2 * d))
    schedule = get_schedule("v-zb", d, m, costs)
    validate(schedule)
    assert simulate(schedule, costs).peak_memory_max <= one_f_one_b_peak(d, costs) + 1e-9


@pytest.mark.parametrize("name", ["v-min", "v-half"])
def test_v_blocks_stay_within_their_weighted_bound(name):
    block = {"v-min": v_min_block, "v-half": v_half_block}[name](4)
    schedule = get_schedule(name, 4, 12, HEAVY_V)
    validate(schedule)
    peak = simulate(schedule, HEAVY_V).peak_memory_max
    assert peak <= max(block.steady_peak(HEAVY_V)) + 1e-9 <= max(block.memory_bound(HEAVY_V)) + 1e-9
    # The weights matter: device 0 holds the heavy last stage, so the bound is above the uniform one.
    assert max(block.steady_peak(HEAVY_V)) > max(block.steady_peak())


def test_v_auto_respects_a_memory_limit_under_per_stage_memory():
    limit = 0.6
    schedule = get_schedule("v-auto", 4, 8, HEAVY_V, memory_limit=limit)
    validate(schedule)
    peak = simulate(schedule, HEAVY_V).peak_memory_max
    assert peak <= limit * one_f_one_b_peak(4, HEAVY_V) + 1e-9
    assert schedule.meta["memory_limit_units"] == pytest.approx(limit * one_f_one_b_peak(4, HEAVY_V))
    # Only a low greedy cap fits here (device 0 holds the heavy last stage); its name gives the
    # cap under the per-stage memory (2: one microbatch on both chunks, (1 + 3) / 2), not today's 1.
    assert schedule.meta["candidate"] == "greedy cap 2" == f"greedy cap {schedule.meta['greedy_cap_units']:g}"


@pytest.mark.parametrize("name", ["gpipe", "interleaved-1f1b"])
def test_fixed_orders_simulate_with_per_stage_costs(name):
    stages = 8 if name == "interleaved-1f1b" else 4
    costs = Costs().with_stages(_ends(stages))
    schedule = get_schedule(name, 4, 8, costs)
    validate(schedule)
    result = simulate(schedule, costs)
    assert result.work_each[0] > result.work_each[1]  # device 0 holds the heavy first stage


# ---------------------------------------------------------------- the command line


def test_cli_simulate_stage_costs(capsys):
    code = cli.main(["simulate", "-s", "v-half", "-d", "2", "-m", "8", "--stage-costs", "time=2,1,1,2;memory=1,1,1,3"])
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    assert "stage memory  1,1,1,3" in out and "work          per device: 96 48" in out
    code = cli.main(["simulate", "-s", "v-half", "-d", "2", "-m", "8", "--stage-costs", "f=1,2,1,1", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["stage_costs"][1] == {"f": 2.0, "b": 1.0, "w": 1.0, "memory": 1.0}
    assert data["work_each_device"] == [48.0, 56.0]


def test_cli_simulate_stage_costs_error_is_one_line(capsys):
    code = cli.main(["simulate", "-s", "v-half", "-d", "4", "-m", "8", "--stage-costs", "f=1,2"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--stage-costs: f has 2 values but the schedule has 8 stages" in err


if __name__ == "__main__" and "--record" in sys.argv:
    record()
