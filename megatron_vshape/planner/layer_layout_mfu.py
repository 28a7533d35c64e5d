"""Predicted MFU of one (schedule, DP x TP x PP layout) with the reference and the balanced layer layout.

The pipeline is simulated with per-stage costs (:mod:`.balance`): the embedding, LM head and loss
sit on their own stages instead of the "each takes one layer's slot" assumption the search in
:mod:`.predict` makes. Iteration = makespan + DP sync + optimizer step, as in :mod:`.predict`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedules.core.schedule import Costs
from ..schedules.generators.registry import fuses_backward
from .balance import LayoutChoice, choose_layout
from .costs import CostModel
from .model import GPTModel
from .parallel_layout import ParallelLayout
from .predict import split_name


@dataclass(frozen=True)
class LayoutComparison:
    schedule: str
    layout: ParallelLayout
    choice: LayoutChoice
    fixed: float  # seconds per iteration outside the pipeline: DP sync + optimizer step
    mfu_per_second: float  # model FLOPs / (GPUs x peak): MFU = this / iteration seconds

    @property
    def reference_iteration(self) -> float:
        return self.choice.reference_time + self.fixed

    @property
    def balanced_iteration(self) -> float:
        return self.choice.iteration_time + self.fixed

    @property
    def reference_mfu(self) -> float:
        return self.mfu_per_second / self.reference_iteration

    @property
    def balanced_mfu(self) -> float:
        return self.mfu_per_second / self.balanced_iteration

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
    times = cost_model.pass_times(model, layout, flash_attention)
    per_second = model.model_flops(layout.global_batch) / (layout.gpus * cost_model.mfu_peak)
    window = 2 * (costs.w if not fuses_backward(base) else costs.b + costs.w)  # as predict charges it
    return LayoutComparison(name, layout, choice, cost_model.dp_exposed(model, layout, times, window) + times.optimizer,
                            per_second)
