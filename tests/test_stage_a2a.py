"""``StageWork.a2a``: each stage's share of the expert all-to-all (its MoE layers over the mean V chunk's), which
the planner's +pairs rows give (planner/moe_pairs.py), in the simulator and in a pair's time."""

from __future__ import annotations

import pytest

from megatron_vshape.schedules.core.schedule import Costs, ScheduleError, StageWork
from megatron_vshape.schedules.core.simulator import simulate
from megatron_vshape.schedules.generators.registry import get_schedule


def test_each_stage_pays_its_own_all_to_all():
    """``StageWork.a2a``: a stage's all-to-all is its share of the mean chunk's (the planner's MoE layers per
    stage), alone and in a pair; 1.0 everywhere is the uniform model's."""
    shares = (2.0, 0.0, 1.0, 1.0)  # d = 2: device 0 holds stages 0 and 3, device 1 stages 1 and 2
    costs = Costs(1.0, 1.0, 1.0, a2a=0.5, stages=tuple(StageWork(a2a=s) for s in shares))
    order = get_schedule("v-zb", 2, 4)  # built without pairs: every F and B alone
    assert simulate(order, costs).exposed_a2a == (4 * 2 * 0.5 * (2.0 + 1.0), 4 * 2 * 0.5 * (0.0 + 1.0))
    assert costs.pair_time(1.0, 1.0, 1.0, (0, 1)) == 1.0 + 1.0 + 0.0 + 0.0  # 1.0 (stage 0's) hides under 1.0
    assert costs.pair_time(0.5, 0.5, 1.0, (0, 1)) == 0.5 + 0.5 + (1.0 - 0.5) + 0.0  # F's: 1.0 over B's 0.5
    assert costs.pair_time(0.5, 0.5, 1.0, (1, 0)) == 0.5 + 0.5 + 0.0 + (1.0 - 0.5)  # B's: 1.0 over F's 0.5
    with pytest.raises(ScheduleError, match="a2a >= 0"):
        StageWork(a2a=-1.0)
