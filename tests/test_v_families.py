"""V-Half with few microbatches and V-Min off d = 4, 8 (issue 22's two families), over d 2..16, m d..8d.

Properties: valid; the block's memory (never above its steady peak); never worse than the
alternatives we have at no more memory (the other block, the greedy capped at its peak, the
solver's cached schedule), and V-Half never slower than V-Min (more memory never hurts).
"""

from __future__ import annotations

import pytest

from megatron_vshape.schedules.core.schedule import Costs, Placement
from megatron_vshape.schedules.core.simulator import simulate
from megatron_vshape.schedules.generators.registry import get_schedule
from megatron_vshape.schedules.generators.solved import solved_for
from megatron_vshape.schedules.generators.v_schedules import v_half_block, v_min_block
from megatron_vshape.schedules.generators.zero_bubble import GreedyFamily, best_greedy
from megatron_vshape.schedules.lowering.validator import validate

COSTS = {"equal": Costs(), "unequal_comm": Costs.parse("f=1,b=1.1,w=0.9,comm=0.05")}
EPS = 1e-9
# m = d everywhere and 2d up to d = 6 (the few-microbatch family), 8d where a build stays cheap; both cost
# settings up to d = 5, the unequal one above (CI time: the builds dominate).
SIZES = [(d, d) for d in (2, 3, 4, 5, 6, 7, 8, 12, 16)] + [(d, 2 * d) for d in (2, 3, 4, 5, 6)]
SIZES += [(d, 8 * d) for d in (2, 3, 5)]
CELLS = [pytest.param(d, m, label, marks=[pytest.mark.slow] if d >= 12 else [])  # d >= 12: seconds per cell
         for d, m in SIZES for label in COSTS if d <= 5 or label == "unequal_comm"]
GREEDY_CHECKED = 4  # the greedy is rebuilt here (independently of the generator) up to this d


def _greedy_at(peak: float, d: int, m: int, costs: Costs):
    family = GreedyFamily("greedy", Placement.v_shape, lambda devices, c: [peak] * devices)
    return simulate(best_greedy(family, d, m, costs), costs)


@pytest.mark.parametrize("d,m,label", CELLS)
def test_families_are_never_worse_than_our_alternatives(d, m, label):
    costs = COSTS[label]
    results = {}
    for name, block in (("v-min", v_min_block(d)), ("v-half", v_half_block(d))):
        schedule = get_schedule(name, d, m, costs)
        validate(schedule)
        result = simulate(schedule, costs)
        assert result.peak_memory_max <= max(block.steady_peak(costs)) + EPS, name
        results[name] = result
    vmin, vhalf = results["v-min"], results["v-half"]
    assert vhalf.makespan <= vmin.makespan + EPS  # V-Half has at least V-Min's memory
    if vhalf.peak_memory_max <= vmin.peak_memory_max + EPS:  # d = 2, 3, 5: the same memory
        assert vmin.makespan <= vhalf.makespan + EPS
    if m <= 2 * d and d <= GREEDY_CHECKED:
        for result in (vmin, vhalf):
            greedy = _greedy_at(result.peak_memory_max, d, m, costs)
            if greedy.peak_memory_max <= result.peak_memory_max + EPS:
                assert result.makespan <= greedy.makespan + EPS
    for cell in solved_for(d, m, costs):
        solved = simulate(cell.schedule(), costs)
        for result in (vmin, vhalf):
            if solved.peak_memory_max <= result.peak_memory_max + EPS:
                assert result.makespan <= solved.makespan + EPS
