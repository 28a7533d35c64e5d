"""V-Half and V-Min against the paper authors' generator, their memory bounds, and d = 1."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_vshape.schedules.core.actions import Kind
from megatron_vshape.schedules.core.schedule import Costs
from megatron_vshape.schedules.core.simulator import simulate
from megatron_vshape.schedules.generators import slot_reorder
from megatron_vshape.schedules.generators.adaptive import v_auto
from megatron_vshape.schedules.generators.v_schedules import v_half, v_half_block, v_min, v_min_block
from megatron_vshape.schedules.lowering.validator import validate

FIXTURE = Path(__file__).parent / "fixtures" / "reference_targets.json"
BUILDERS = {"v-half": v_half, "v-min": v_min}
BOUNDS = {"v-half": lambda d: (d + 2) // 2, "v-min": lambda d: (d + 4) // 3}  # the paper's peaks, units
UNEQUAL = Costs(f=1, b=1.1, w=0.9, comm=0.05)
QUICK = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _reference():
    data = json.loads(FIXTURE.read_text())
    costs = {name: Costs.parse(text) for name, text in data["cost_settings"].items()}
    cells = [c for c in data["cells"] if c["schedule"] in BUILDERS]
    return [pytest.param(c, costs[c["cost_setting"]], id=f"{c['schedule']}-d{c['p']}-m{c['m']}-{c['cost_setting']}")
            for c in cells]


def _their_bubble(result) -> float:
    """The targets file's definition, computed here from the timeline: 1 - useful work /
    (devices x makespan), each device's makespan from its first start to its last end."""
    spans, work = [], 0.0
    for device in range(result.schedule.num_devices):
        intervals = [iv for iv in result.timeline.values() if iv.device == device]
        spans.append(max(iv.end for iv in intervals) - min(iv.start for iv in intervals))
        work += sum(iv.end - iv.start for iv in intervals)
    return 1.0 - work / (result.schedule.num_devices * max(spans))


@pytest.mark.parametrize(("cell", "costs"), _reference())
def test_as_good_as_the_authors_generator(cell, costs):
    schedule = BUILDERS[cell["schedule"]](cell["p"], cell["m"], costs)
    validate(schedule)
    result = simulate(schedule, costs)
    bubble = _their_bubble(result)
    assert bubble == pytest.approx(result.bubble_rate, abs=1e-9)  # our simulator reports the same
    assert bubble <= cell["bubble_rate"] + 0.001
    assert result.peak_memory_max <= cell["peak_units_max"]


@pytest.mark.slow  # builds up to d = 16, m = 128: seconds; in the README's test command
@QUICK
@given(d=st.integers(2, 16), factor=st.floats(1, 8), equal=st.booleans())
def test_valid_and_within_the_papers_memory(d, factor, equal):
    m = max(d, min(8 * d, round(d * factor)))
    costs = Costs() if equal else UNEQUAL
    for name, build in BUILDERS.items():
        schedule = build(d, m, costs)
        validate(schedule)
        assert simulate(schedule, costs).peak_memory_max <= BOUNDS[name](d)


@pytest.mark.parametrize("m", [1, 2, 5])
def test_one_device_holds_both_chunks(m):
    """d = 1: the V folds onto one device; every schedule runs its passes back to back."""
    for schedule in (v_half(1, m, UNEQUAL), v_min(1, m, UNEQUAL), v_auto(1, m, UNEQUAL)):
        validate(schedule)
        result = simulate(schedule, UNEQUAL)
        assert result.bubble_rate == pytest.approx(0.0, abs=1e-9)
        assert result.peak_memory_max == 1.0


def _naive_lazy_reorder(plan, visit, budget):
    """The cool-down reorder with the whole device replayed for every slot tried."""
    def peak(row):
        level = pending = top = 0
        for action in row:
            if action is None:
                if pending:
                    pending, level = pending - 1, level - 1
            elif action.kind is Kind.F:
                level += 1
            elif action.kind is Kind.B:
                pending += 1
            top = max(top, level)
        return top

    for action in visit:
        row = plan.at[plan.device_of[action.stage]]
        current = plan.slot[action]
        for s in range(slot_reorder._earliest(plan, action), current):
            if row[s] is None:
                plan.move(action, s)
                if peak(row) <= budget:
                    break
                plan.move(action, current)


@pytest.mark.parametrize("d", [3, 4, 6, 8])
def test_incremental_memory_check_equals_a_full_replay(d, monkeypatch):
    """The cool-down reorder bounds memory incrementally (``_LazyMemory``); it must make exactly
    the moves that replaying the whole device for every candidate slot makes."""
    for block in (v_half_block(d), v_min_block(d)):
        for m in (d, 2 * d + 1, 5 * d):
            fast = slot_reorder.slot_schedule(block, m, "x", math.inf)
            with monkeypatch.context() as patch:
                patch.setattr(slot_reorder, "_reorder_lazy", _naive_lazy_reorder)
                slow = slot_reorder.slot_schedule(block, m, "x", math.inf)
            assert fast.programs == slow.programs


@pytest.mark.parametrize("d", [2, 3, 4, 5, 8, 11])
def test_long_runs_spliced_from_a_short_run_equal_the_full_reorder(d, monkeypatch):
    """Long runs insert steady-state periods into a short run; that must give exactly the
    programs of reordering the long run itself."""
    for block in (v_half_block(d), v_min_block(d)):
        short = slot_reorder._short_microbatches(block)
        for m in (short + 1, short + 7, 3 * short):
            spliced = slot_reorder.slot_schedule(block, m, "x", math.inf)
            with monkeypatch.context() as patch:
                patch.setattr(slot_reorder, "_short_microbatches", lambda block: 10**9)
                full = slot_reorder.slot_schedule(block, m, "x", math.inf)
            assert spliced.programs == full.programs


@pytest.mark.parametrize(("name", "d"), [("v-half", 4), ("v-half", 8), ("v-half", 12), ("v-min", 3)])
def test_few_microbatches_reorder_the_cool_down_too(name, d):
    """At m = d the last microbatch enters device 0 before the first leaves it; the cool-down
    then starts right after the warm-up instead of not at all (the authors' phases)."""
    block = {"v-half": v_half_block, "v-min": v_min_block}[name](d)
    assert slot_reorder.has_early_cooldown(block, d)
    ours = simulate(BUILDERS[name](d, d, Costs())).bubble_rate
    no_cooldown = simulate(slot_reorder.slot_schedule(block, d, "x", math.inf, early_cooldown=False)).bubble_rate
    assert ours < no_cooldown - 0.01
