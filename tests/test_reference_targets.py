"""Our schedules against the paper authors' own generators, cell by cell.

The numbers live in tests/fixtures/reference_targets.json (copied from the design notes; its
``source_note`` says where they come from). Each cell must be at least as good as theirs:
bubble <= theirs + 0.001 and peak <= theirs. The bubble is recomputed here from the timeline
with *their* definition, so the test does not depend on how the simulator defines it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_vshape.schedules.core.schedule import Costs
from megatron_vshape.schedules.core.simulator import simulate
from megatron_vshape.schedules.generators.registry import get_schedule

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "reference_targets.json").read_text())
COSTS = {key: Costs.parse(text) for key, text in FIXTURE["cost_settings"].items()}
OWNED = ("v-zb", "zb-1p", "zb-2p")  # v-half / v-min cells: tests/test_adaptive.py's owner
TOLERANCE = 0.001


def reference_bubble(result) -> float:
    """1 - useful work / (devices x makespan); makespan per device from first start to last
    end, max over devices (the definition in the fixture)."""
    per_device: dict[int, list[float]] = {}
    useful = 0.0
    for interval in result.timeline.values():
        useful += interval.end - interval.start
        span = per_device.setdefault(interval.device, [interval.start, interval.end])
        span[0] = min(span[0], interval.start)
        span[1] = max(span[1], interval.end)
    makespan = max(end - start for start, end in per_device.values())
    return 1.0 - useful / (result.schedule.num_devices * makespan)


def _cells(names):
    return [
        pytest.param(cell, id=f"{cell['schedule']}-d{cell['p']}-m{cell['m']}-{cell['cost_setting']}")
        for cell in FIXTURE["cells"]
        if cell["schedule"] in names
    ]


def test_fixture_has_every_cell():
    cells = FIXTURE["cells"]
    assert len(cells) == 60 and "sail-sg/zero-bubble-pipeline-parallelism" in FIXTURE["source_note"]
    assert {c["schedule"] for c in cells} == {"v-zb", "zb-1p", "zb-2p", "v-half", "v-min"}


@pytest.mark.parametrize("cell", _cells(OWNED))
def test_at_least_as_good_as_the_authors(cell):
    costs = COSTS[cell["cost_setting"]]
    result = simulate(get_schedule(cell["schedule"], cell["p"], cell["m"], costs), costs)
    bubble = reference_bubble(result)
    assert bubble == pytest.approx(result.bubble_rate, abs=1e-9)  # same definition as ours
    assert bubble <= cell["bubble_rate"] + TOLERANCE, f"bubble {bubble:.4f} vs theirs {cell['bubble_rate']}"
    assert result.peak_memory_max <= cell["peak_units_max"] + 1e-9


def _paper_rows():
    import sys

    scripts = str(Path(__file__).resolve().parent.parent / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    import paper_rows

    return paper_rows


def test_paper_orderings_closer_than_one_percent_are_ties():
    """Issue 22's rule: a paper ordering whose two numbers differ by < 1 % matches either predicted order."""
    rows = _paper_rows()

    def ordering(paper_a, paper_b, predicted_a, predicted_b):
        recs = [{"setting": "S", "metric": "MFU %", "schedule_before": "a", "schedule_after": "b",
                 "paper_before": paper_a, "paper_after": paper_b,
                 "predicted_before": predicted_a, "predicted_after": predicted_b}]
        (only,) = rows.setting_orderings(recs)
        return only

    # The paper's 98.5B seq 3072 pair: 1F1B 62.95 vs V-ZB 62.56 (0.6 %), predicted the other way round.
    tie = ordering(62.95, 62.56, 60.0, 61.0)
    assert tie["paper_tie"] and tie["matches"]
    assert ordering(62.95, 62.56, 61.0, 60.0)["matches"]
    # 2 % apart is an ordering, not a tie: the reversed prediction misses it.
    apart = ordering(62.95, 61.7, 60.0, 61.0)
    assert not apart["paper_tie"] and not apart["matches"]
    # A missing prediction (OOM) never matches, tie or not.
    assert not ordering(62.95, 62.56, None, 61.0)["matches"]
    seq3072 = [r for r in rows.ROWS if r.source == "seq 3072, batch 640"]
    papers = {name: value for r in seq3072 for name, value in ((r.schedule_before, r.paper_before),
                                                               (r.schedule_after, r.paper_after))}
    assert abs(papers["1f1b"] - papers["v-zb"]) / papers["v-zb"] < rows.PAPER_TIE
