"""The oracle tier's cells: cost settings, the heuristics compared, and the memory each gets.

Shared by scripts/oracle_cells.py (which solves the cells and writes the fixture) and the tests
(tests/test_optimize_oracle.py), so both mean the same cells.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from ..core.schedule import Costs, StageWork, one_f_one_b_peak
from ..core.simulator import SimulationResult

__all__ = ["COST_SETTINGS", "HEURISTICS", "TOLERANCE", "heuristic_limit", "random_stage_costs"]

# The heuristics of the tier: the V schedules at their own memory, and ZB-1P (looped, 1F1B's memory).
HEURISTICS = ("v-min", "v-half", "v-zb", "zb-1p")
# A heuristic is within the oracle's reach when its makespan is at most this much above the optimum.
TOLERANCE = 0.01


def random_stage_costs(num_devices: int, seed: int = 0) -> Costs:
    """Per-stage time multipliers on the V placement's 2d stages, drawn from quarters in [0.75, 1.5]
    (so the solver's integer times stay exact); the same draw for every placement of a cell."""
    rng = random.Random(1000 * num_devices + seed)
    choices = (0.75, 1.0, 1.25, 1.5)
    return Costs().with_stages(StageWork(f=rng.choice(choices), b=rng.choice(choices), w=rng.choice(choices))
                               for _ in range(2 * num_devices))


# label -> costs for d devices on the V placement. The first three are the authors' settings.
COST_SETTINGS: dict[str, Callable[[int], Costs]] = {
    "a_equal": lambda d: Costs(),
    "b_unequal": lambda d: Costs.parse("f=1,b=1.1,w=0.9,comm=0"),
    "c_unequal_comm": lambda d: Costs.parse("f=1,b=1.1,w=0.9,comm=0.05"),
    "d_random_stages": random_stage_costs,
}


def heuristic_limit(result: SimulationResult, num_devices: int, costs: Costs) -> float:
    """The heuristic's measured peak as a fraction of 1F1B's: the solver's cap for its cell."""
    return result.peak_memory_max / one_f_one_b_peak(num_devices, costs)
