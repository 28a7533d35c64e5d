"""The layout table's line of a ``+pairs`` row (``--overlap-moe-expert-parallel-comm``, planner/moe_pairs.py): the
row's own run on the search's layout, next to the same schedule's best run without the flag."""

from __future__ import annotations

from dataclasses import dataclass

from .predict import Prediction


@dataclass(frozen=True)
class PairedRun:
    """The layout-table entry of a ``+pairs`` row: ``run`` is the row's prediction (the search's layout: the
    balance search does not cost pairs), ``without`` the same schedule's best run without the flag."""

    run: Prediction
    without: Prediction | None = None

    def to_json(self) -> dict:
        return {"schedule": self.run.schedule, "moe_pairs": True, "layers": list(self.run.layers_per_stage),
                "iteration_s": self.run.iteration_time, "mfu": self.run.mfu,
                "without_flag_mfu": None if self.without is None else self.without.mfu,
                "without_flag_iteration_s": None if self.without is None else self.without.iteration_time}
