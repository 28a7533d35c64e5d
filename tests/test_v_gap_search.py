"""scripts/v_gap_search.py: the stronger searches that look for the generators' gaps (issues 34 and 44)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import v_gap_search  # noqa: E402

from megatron_vshape.schedules.core.simulator import simulate  # noqa: E402
from megatron_vshape.schedules.generators.v_schedules import v_half_block, v_min_block  # noqa: E402
from megatron_vshape.schedules.lowering.validator import validate  # noqa: E402


def _plain_repeat(block_of):
    """A generator without any reorder: the block repeated (its warm-up and cool-down full of waits)."""
    return lambda d, m, costs: block_of(d).repeat(m, "plain")


@pytest.mark.parametrize("name,block_of", [("v-half", v_half_block), ("v-min", v_min_block)])
def test_a_planted_gap_is_seen(monkeypatch, name, block_of):
    """With the reorder taken out of the generator, the searches find the gap at the same peak."""
    monkeypatch.setitem(v_gap_search.GENERATORS, name, (_plain_repeat(block_of), block_of))
    row = v_gap_search.search_cell(name, 4, 4, "c_unequal_comm", seconds=60.0, cpsat_seconds=0, cpsat_max_passes=0,
                                   evaluations=100)
    assert row.gain > 0.02 and row.found_by
    assert row.best_peak <= row.peak


def test_the_order_search_keeps_the_peak_and_the_passes():
    block = v_half_block(4)
    plain = block.repeat(8, "plain")
    costs = v_gap_search.COSTS["b_unequal"]
    cap = simulate(plain, costs).peak_memory_max
    found = v_gap_search.order_search(plain, costs, cap, v_gap_search.Budget(60.0, 200))
    assert found is not None
    validate(found)
    result = simulate(found, costs)
    assert result.peak_memory_max <= cap
    assert result.makespan < simulate(plain, costs).makespan


def test_the_offsets_search_stays_within_the_cap():
    costs = v_gap_search.COSTS["a_equal"]
    cap = 2.0  # V-Min's peak at d = 4: V-Half's block (3 units) and most neighbours do not fit
    found = v_gap_search.offsets_search(v_min_block(4), 8, costs, cap, v_gap_search.Budget(60.0, 100))
    validate(found)
    assert simulate(found, costs).peak_memory_max <= cap


def test_the_table_and_its_markdown(tmp_path, capsys):
    out = tmp_path / "gaps.json"
    assert v_gap_search.main(["--devices", "2", "--factors", "1", "--costs", "a_equal", "--evaluations", "20",
                              "--json", str(out), "--markdown"]) == 0
    text = capsys.readouterr().out
    assert "2 cells: in 0 a search wins by more than 0.5%, in 0 the uniform-built order" in text
    assert "| v-min | a_equal | 1 | - | 0 |" in text
    assert '"rows"' in out.read_text()


def test_every_family_and_stage_set_runs_within_its_evaluations():
    rows = [v_gap_search.search_cell(name, 4, 4, label, evaluations=15)
            for name in v_gap_search.GENERATORS for label in ("a_equal", "hybrid")]
    assert {r.schedule for r in rows} == {"v-min", "v-half", "v-zb", "zb-1p"}
    for row in rows:
        assert row.evaluations <= 15 and row.best_peak <= row.peak + 1e-9 and row.gain >= 0
        assert row.uniform_gain <= 0.005  # the registry takes the uniform-built order where it is faster


def test_stage_sets_are_drawn_once_per_stage_count():
    one, again = v_gap_search.cell_costs("hybrid", 8), v_gap_search.cell_costs("hybrid", 8)
    assert one == again and len(one.stages) == 8 and not one.uniform
    assert v_gap_search.cell_costs("head1.9", 8).stages[-1].f == 1.9
    assert v_gap_search.cell_costs("rand25", 8) != v_gap_search.cell_costs("rand25", 16)


def test_a_uniform_built_order_that_wins_is_reported(monkeypatch):
    """A generator that ignores nothing but builds worse for unequal stages: the column sees it."""
    real = v_gap_search.GENERATORS["v-half"]

    def worse_when_staged(d, m, costs):
        return v_half_block(d).repeat(m, "plain") if not costs.uniform else real[0](d, m, costs)

    monkeypatch.setitem(v_gap_search.GENERATORS, "v-half", (worse_when_staged, real[1]))
    row = v_gap_search.search_cell("v-half", 4, 4, "head1.9", evaluations=10)
    assert row.uniform_gain > 0.02


# Issue 34's families (V-Half at m = d, V-Min at d % 3 == 0), where the authors' generator won by
# 0.5-6 %; V-Half with communication too. (V-Min with unequal costs keeps gaps to these searches:
# docs/schedules.md's table.)
EXTENDED = [("v-half", d, d, label) for d in (8, 10, 12) for label in ("a_equal", "c_unequal_comm")]
EXTENDED += [("v-min", d, factor * d, "a_equal") for d in (6, 9) for factor in (1, 2)]


@pytest.mark.extended
@pytest.mark.parametrize("name,d,m,label", EXTENDED)
def test_no_gap_on_the_issue_families(name, d, m, label):
    """No search wins by more than 0.5 % at the generator's own peak (budgets in schedules tried, so
    the result does not depend on the machine; CP-SAT left out for the same reason)."""
    row = v_gap_search.search_cell(name, d, m, label, seconds=600.0, cpsat_seconds=0, cpsat_max_passes=0,
                                   evaluations=300)
    assert row.gain <= 0.005, f"{row.gain:.2%} by {row.found_by}"


# Issue 44: the uniform-built order never wins, unequal stages or not, for every family; and the searches'
# gaps on the cells that issue closed on uniform stages (the late V-Min block, the local search) stay closed.
EXTENDED_44 = [(name, 4, 4, label) for name in ("v-min", "v-half", "v-zb", "zb-1p")
               for label in ("head1.9", "rand25", "hybrid")]
EXTENDED_44 += [("v-min", d, m, label) for d, m, label in ((8, 16, "a_equal"), (11, 11, "a_equal"),
                                                          (14, 14, "b_unequal"), (9, 9, "c_unequal_comm"))]


@pytest.mark.extended
@pytest.mark.parametrize("name,d,m,label", EXTENDED_44)
def test_issue_44_cells(name, d, m, label):
    row = v_gap_search.search_cell(name, d, m, label, evaluations=200)
    assert row.uniform_gain <= 0.005
    if label in v_gap_search.COSTS:
        assert row.gain <= 0.005, f"{row.gain:.2%} by {row.found_by}"
