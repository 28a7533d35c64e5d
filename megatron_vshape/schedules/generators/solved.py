"""Schedules the exact solver found for small cells, kept as package data (``solved_cells.json``).

Small cells are cheap to solve once and the heuristics miss their optimum by several per cent (the
oracle tier, docs/optimize.md), so ``v-auto`` takes a solved schedule where one fits its memory limit
and beats its own choice. Reading the cache needs no solver, and the schedule is a fixed text, so
every rank of a job builds the same one. The file is written by ``scripts/oracle_cells.py --cache``;
a cell matches only on exactly equal sizes and costs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..core.schedule import Costs, Placement, PlacementKind, Schedule, StageWork

__all__ = ["CACHE_PATH", "SolvedCell", "solved_cells", "solved_for"]

CACHE_PATH = Path(__file__).with_name("solved_cells.json")


@dataclass(frozen=True)
class SolvedCell:
    num_devices: int
    num_microbatches: int
    costs: Costs
    placement: PlacementKind
    memory_limit: float  # the cap it was solved under, x 1F1B's peak
    makespan: float
    lower_bound: float
    optimal: bool
    text: str  # the schedule, one line per device (Schedule.to_text)

    def schedule(self, name: str = "optimal") -> Schedule:
        place = (Placement.v_shape(self.num_devices) if self.placement is PlacementKind.V
                 else Placement.looped(self.num_devices))
        return Schedule.from_text(self.text, name, place)


def costs_to_json(costs: Costs) -> dict:
    return {"f": costs.f, "b": costs.b, "w": costs.w, "comm": costs.comm,
            "stages": [[w.f, w.b, w.w, w.memory] for w in costs.stages]}


def costs_from_json(record: dict) -> Costs:
    stages = tuple(StageWork(*values) for values in record.get("stages", ()))
    return Costs(record["f"], record["b"], record["w"], record["comm"], stages)


def cell_to_json(cell: SolvedCell) -> dict:
    return {"devices": cell.num_devices, "microbatches": cell.num_microbatches, "costs": costs_to_json(cell.costs),
            "placement": cell.placement.value, "memory_limit": cell.memory_limit, "makespan": cell.makespan,
            "lower_bound": cell.lower_bound, "optimal": cell.optimal, "schedule": cell.text}


@lru_cache(maxsize=1)
def solved_cells() -> tuple[SolvedCell, ...]:
    """Every cached cell (empty when the file is absent)."""
    if not CACHE_PATH.exists():
        return ()
    return tuple(
        SolvedCell(r["devices"], r["microbatches"], costs_from_json(r["costs"]), PlacementKind(r["placement"]),
                   r["memory_limit"], r["makespan"], r["lower_bound"], r["optimal"], r["schedule"])
        for r in json.loads(CACHE_PATH.read_text())["cells"]
    )


def solved_for(num_devices: int, num_microbatches: int, costs: Costs,
               placement: PlacementKind = PlacementKind.V) -> list[SolvedCell]:
    """The cached cells of exactly these sizes and costs, any memory limit."""
    return [c for c in solved_cells() if (c.num_devices, c.num_microbatches, c.placement, c.costs)
            == (num_devices, num_microbatches, placement, costs)]
