"""Predicted MFU of one (schedule, DP x TP x PP layout) with the reference and the balanced layer layout.

:func:`.balance.choose_layout` finds the balanced layout, with the embedding, LM head and loss on their
own stages; both layouts are then costed by :func:`.predict.predict`, the function that costs the
search's rows, so a row and its layout's line describe the same run (the schedule generated as training
generates it, Megatron's blocking p2p where it blocks, the same DP sync and optimizer step).

With ``--pipeline-vocab-parallel`` the stages hold the layers alone, so there is nothing to balance: the
layout is the layers' own (:func:`.predict.stage_plan`: uniform where they divide) and its line in the
table is the row's run (:class:`LayersAlone`), next to the same schedule's run without the flag.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedules.core.schedule import Costs
from .balance import LayoutChoice, choose_layout
from .costs import CostModel
from .model import GPTModel
from .parallel_layout import ParallelLayout
from .predict import Prediction, predict, split_name


@dataclass(frozen=True)
class LayoutComparison:
    schedule: str
    layout: ParallelLayout
    choice: LayoutChoice  # the layouts (the balance search's own simulated times are its ranking)
    reference: Prediction  # the reference layout's run
    balanced: Prediction  # the balanced layout's run

    @property
    def reference_iteration(self) -> float:
        return self.reference.iteration_time

    @property
    def balanced_iteration(self) -> float:
        return self.balanced.iteration_time

    @property
    def reference_mfu(self) -> float:
        return self.reference.mfu

    @property
    def balanced_mfu(self) -> float:
        return self.balanced.mfu

    def to_json(self) -> dict:
        lay, choice = self.layout, self.choice
        return {
            "schedule": self.schedule, "dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "micro_batch": lay.micro_batch,
            "num_microbatches": lay.num_microbatches, "reference": choice.reference_name,
            "reference_layers": list(choice.reference_layers), "balanced_layers": list(choice.layers_per_stage),
            "reference_iteration_s": self.reference_iteration, "balanced_iteration_s": self.balanced_iteration,
            "reference_mfu": self.reference_mfu, "balanced_mfu": self.balanced_mfu,
            "reference_peak_activation": choice.reference_peak_memory, "balanced_peak_activation": choice.peak_memory,
        }


@dataclass(frozen=True)
class LayersAlone:
    """The layout of a run with ``--pipeline-vocab-parallel``: the layers alone, no balancing; ``run`` is
    the row's prediction, ``without`` the same schedule's best run without the flag (None if none fits)."""

    run: Prediction
    without: Prediction | None = None

    @property
    def layers(self) -> tuple[int, ...]:
        return self.run.layers_per_stage

    def to_json(self) -> dict:
        return {"schedule": self.run.schedule, "vocab_parallel": True, "layers": list(self.layers),
                "iteration_s": self.run.iteration_time, "mfu": self.run.mfu,
                "without_flag_mfu": None if self.without is None else self.without.mfu,
                "without_flag_iteration_s": None if self.without is None else self.without.iteration_time}


def chunk_costs(model: GPTModel, cost_model: CostModel, layout: ParallelLayout, flash_attention: bool = False) -> Costs:
    """Seconds of one pass over one V chunk's ``L / (2 pp)`` layers (the schedule core's unit; a
    looped stage is two of them), and of one p2p message. The embedding and the head are added per
    stage by :func:`.balance.stage_work`, not spread over layer slots as :func:`.predict.chunk_costs` does."""
    times = cost_model.pass_times(model, layout, flash_attention)
    unit = model.layers / (2 * layout.pp)
    full = times.f if layout.recompute == "full" else 0.0  # the backward first re-runs the forward
    return Costs(unit * times.f, unit * (times.b + full), unit * times.w, times.p2p)


def compare_layouts(name: str, model: GPTModel, cost_model: CostModel, layout: ParallelLayout,
                    flash_attention: bool = False) -> LayoutComparison:
    """Reference vs balanced layout for ``name`` on ``layout`` (ValueError for recomputing schedules)."""
    base, recompute = split_name(name)
    if recompute:
        raise ValueError(f"{name}: layer balancing does not model recomputation; compare {base} instead")
    costs = chunk_costs(model, cost_model, layout, flash_attention)
    choice = choose_layout(model, base, layout.pp, layout.num_microbatches, costs, flash_attention=flash_attention)
    reference = predict(name, layout, model, cost_model, flash_attention, layers=tuple(choice.reference_layers))
    balanced = predict(name, layout, model, cost_model, flash_attention, layers=tuple(choice.layers_per_stage))
    return LayoutComparison(name, layout, choice, reference, balanced)
