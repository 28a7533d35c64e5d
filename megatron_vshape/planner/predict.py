"""Predict one (schedule, layout): iteration time, MFU, bubble, per-GPU memory, OOM.

Iteration time = simulated pipeline makespan + exposed DP gradient sync + optimizer step. Without
``--overlap-grad-reduce`` (the paper's setting, the authors' fork) the whole sync is exposed; see
:meth:`CostModel.dp_exposed`. MFU = Megatron's model FLOPs / (time * GPUs * dense peak), the FP8 peak when the GEMMs run in FP8.

Two pipeline cost models: the paper's layer with ``layers + 2`` dividing the stages keeps the
paper's "embedding and head each take one layer's slot" (its tables were reproduced with it);
every other model or layer count is costed per stage (:func:`.balance.stage_work`: the head's
GEMM, per-layer weights of a HybridModel pattern) on an uneven layout, proportional to each
device's work (:func:`.balance.proportional_layout`), so no divisibility rule hides a configuration.

``vocab_parallel`` (``--pipeline-vocab-parallel``, :mod:`.vocab`): the stages hold the layers alone (the
layout is the layers' own: uniform where they divide), the schedule carries every device's vocabulary
passes, and the memory estimate the vocabulary layers' 1/p shards.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..schedules.core.schedule import Costs, ScheduleError, StageWork
from ..schedules.generators.registry import SCHEDULES, fuses_backward
from .balance import placement_for, proportional_layout, stage_work
from .costs import CostModel, PassTimes
from .exposed_p2p import blocking_costs, blocks_on_p2p
from .memory import RESERVED_BYTES, MemoryEstimate, activation_model, activation_peaks, static_bytes
from .model import GPTModel
from .moe_pairs import pair_problem, paired_costs
from .parallel_layout import ParallelLayout
from .rows import row_label
from .simcache import run_pipeline
from .vocab import vocab_call_seconds, vocab_dp_exposed, vocab_work

RECOMPUTE_SUFFIX = "-r"  # "1f1b-r": a schedule with full activation recomputation


def planner_schedule_names() -> list[str]:
    return [*SCHEDULES, "1f1b-r"]


def split_name(name: str) -> tuple[str, bool]:
    """("1f1b", True) for "1f1b-r"; raise a one-line error for unknown names."""
    recompute = name.endswith(RECOMPUTE_SUFFIX) and name[: -len(RECOMPUTE_SUFFIX)] in SCHEDULES
    base = name[: -len(RECOMPUTE_SUFFIX)] if recompute else name
    if base not in SCHEDULES:
        raise ValueError(f"--schedules: unknown schedule {name!r}; choose from: {', '.join(planner_schedule_names())}")
    return base, recompute


def num_stages(name: str, pp: int) -> int:
    base, _ = split_name(name)
    return SCHEDULES[base].num_stages(pp)


@dataclass(frozen=True)
class Prediction:
    schedule: str
    layout: ParallelLayout
    iteration_time: float  # seconds
    mfu: float
    bubble_rate: float
    memory: MemoryEstimate
    capacity: float  # bytes usable per GPU
    pass_times: PassTimes
    extrapolated: bool
    layers_per_stage: tuple[int, ...] = ()  # the layout costed ((): the paper's slot model)
    dp_exposed: float = 0.0  # seconds of DP sync the iteration pays
    vocab_parallel: bool = False  # --pipeline-vocab-parallel: the vocabulary layers on every device
    pairs: bool = False  # --overlap-moe-expert-parallel-comm: F&B pairs hide the all-to-all (moe_pairs.py)

    @property
    def oom(self) -> bool:
        return self.memory.peak > self.capacity

    @property
    def label(self) -> str:
        return row_label(self.schedule, self.vocab_parallel, self.pairs)

    def to_json(self) -> dict:
        lay = self.layout
        return {
            "schedule": self.schedule, "dp": lay.dp, "tp": lay.tp, "pp": lay.pp,
            "cp": lay.cp, "ep": lay.ep, "recompute": lay.recompute,
            "micro_batch": lay.micro_batch, "num_microbatches": lay.num_microbatches,
            "vocab_parallel": self.vocab_parallel, "moe_pairs": self.pairs,
            "layers_per_stage": list(self.layers_per_stage), "dp_exposed_s": self.dp_exposed,
            "iteration_time_s": self.iteration_time, "mfu": self.mfu, "bubble_rate": self.bubble_rate,
            "peak_memory_gib": self.memory.peak / 1024**3,
            "peak_activation_gib": self.memory.peak_activation / 1024**3, "oom": self.oom,
        }


def chunk_costs(pass_times: PassTimes, model: GPTModel, stages: int, recompute: bool, pp: int) -> Costs:
    """Simulator costs: seconds per pass over one V chunk's worth of layer slots ((L+2)/(2*pp))."""
    slots = (model.layers + 2) / (2 * pp)
    f, b, w = (slots * t for t in (pass_times.f, pass_times.b, pass_times.w))
    if recompute:
        b += f  # the backward first re-runs the forward
    return Costs(f, b, w, pass_times.p2p)


def recompute_mode(name: str, layout: ParallelLayout) -> str:
    """"full" for the "-r" names (1f1b-r), else the layout's mode."""
    return "full" if split_name(name)[1] else layout.recompute


def stage_plan(name: str, layout: ParallelLayout, model: GPTModel, times: PassTimes,
               vocab_parallel: bool = False) -> tuple[int, ...] | None:
    """Layers per stage for the per-stage cost model, or None for the paper's slot model (never with
    ``vocab_parallel``: the stages then hold the layers alone, uniform where they divide)."""
    stages = num_stages(name, layout.pp)
    if not vocab_parallel and layout.uses_slots(model, stages):
        return None
    if model.segments:
        return tuple(model.segments)
    base, _ = split_name(name)
    unit = model.layers / (2 * layout.pp)
    costs = Costs(unit * times.f, unit * times.b, unit * times.w, times.p2p)
    return tuple(proportional_layout(model, placement_for(base, layout.pp), costs, vocab_parallel=vocab_parallel))


def staged_costs(times: PassTimes, model: GPTModel, layers: tuple[int, ...], full_recompute: bool, pp: int,
                 flash_attention: bool, vocab_parallel: bool = False) -> Costs:
    """Costs per uniform V chunk (L/(2 pp) layers) with each stage's own work (head, uneven layers;
    the layers alone with ``vocab_parallel``: the vocabulary work is :func:`.vocab.vocab_work`'s)."""
    unit = model.layers / (2 * pp)
    f, b, w = unit * times.f, unit * times.b, unit * times.w
    works = stage_work(model, layers, flash_attention, vocab_parallel=vocab_parallel)
    if full_recompute:  # each stage's backward first re-runs its forward
        works = tuple(StageWork(x.f, (x.b * b + x.f * f) / (b + f), x.w, x.memory) for x in works)
        b += f
    return Costs(f, b, w, times.p2p, works)


def predict(name: str, layout: ParallelLayout, model: GPTModel, cost_model: CostModel,
            flash_attention: bool = False, layers: tuple[int, ...] | None = None,
            vocab_parallel: bool = False, pairs: bool = False) -> Prediction:
    """Raise ValueError/ScheduleError naming the problem if the layout cannot run the schedule.

    ``layers``: the layers per stage to cost (a ``--pipeline-layout``); default :func:`stage_plan`'s.
    ``vocab_parallel``: the run with ``--pipeline-vocab-parallel`` (see the module docstring).
    ``pairs``: the run with ``--overlap-moe-expert-parallel-comm`` (moe_pairs.py)."""
    base, _ = split_name(name)
    mode = recompute_mode(name, layout)
    stages = num_stages(name, layout.pp)
    problem = layout.problem(model, stages) or (pair_problem(base, layout, model) if pairs else None)
    if problem:
        raise ValueError(problem)
    times = cost_model.pass_times(model, layout, flash_attention)
    if layers is None:
        layers = stage_plan(name, layout, model, times, vocab_parallel)
    if layers is None:
        costs = chunk_costs(times, model, stages, mode == "full", layout.pp)
    else:
        costs = staged_costs(times, model, layers, mode == "full", layout.pp, flash_attention, vocab_parallel)
    if pairs:  # the all-to-all apart from F and B, for the pairs to hide
        costs = paired_costs(costs, times, model, layers or ())
    timed = costs
    if cost_model.blocking_p2p and blocks_on_p2p(base) and layout.pp > 1:
        timed = blocking_costs(base, costs, layout.pp,
                               lambda a, b: cost_model.p2p_between(model, layout, a, b))
    if vocab_parallel:  # the vocabulary passes, against the costs the simulator times (their comm)
        timed = replace(timed, vocab=vocab_work(model, layout, cost_model, times, timed, flash_attention))
    uneven = layers is not None and len(set(layers)) > 1  # training's schedule sees per-stage work then
    run = run_pipeline(base, layout.pp, layout.num_microbatches, timed, coarse=not model.paper_shape,
                       staged_order=uneven)
    # Gradients are final once a device's last backward work runs: B + W fused, W when split.
    window = 2 * (costs.w if not fuses_backward(base) else costs.b + costs.w)
    outside = 0.0
    sample = run.sample.schedule
    first_actions = sample.programs[sample.placement.device_of(0)]
    if vocab_parallel:  # what runs outside the passes, and the shard's reductions after it (planner/vocab.py)
        outside = vocab_call_seconds(model, layout, cost_model, first_actions)
        dp = vocab_dp_exposed(model, layout, cost_model, times, window, outside)
    else:
        dp = cost_model.dp_exposed(model, layout, times, window)
    iteration = run.makespan + outside + dp + times.optimizer
    # The paper's bubble: 1 - compute / time, compute = m x (F + B + W) of one device (two V
    # chunks' worth of layer slots); waits for messages, exposed or not, count as bubble.
    if layers is None:
        compute = 2 * (costs.f + costs.b + costs.w) * layout.num_microbatches
    else:  # the busiest device's work
        sample_m = run.sample.schedule.num_microbatches
        compute = run.sample.work_per_device / sample_m * layout.num_microbatches * run.scale
    bubble = max(0.0, 1.0 - compute / run.span) if run.span > 0 else 0.0
    mfu = model.model_flops(layout.global_batch) / (iteration * layout.gpus * cost_model.mfu_peak)
    placement = run.sample.schedule.placement
    static = static_bytes(model, layout, placement.stages_per_device, stages, cost_model.distributed_optimizer,
                          layers, vocab_parallel)
    acts = activation_model(model, layout, stages, flash_attention, mode, layers, vocab_parallel)
    peaks = activation_peaks(run.sample, acts)
    if run.earlier is not None:
        earlier = activation_peaks(run.earlier, acts)
        peaks = tuple(run.extend(late, early) for late, early in zip(peaks, earlier))
    memory = MemoryEstimate(static, peaks)
    capacity = cost_model.gpu.memory_bytes - RESERVED_BYTES
    return Prediction(name, layout, iteration, mfu, bubble, memory, capacity, times, run.extrapolated,
                      layers or (), dp, vocab_parallel, pairs)


__all__ = ["Prediction", "ScheduleError", "chunk_costs", "num_stages", "planner_schedule_names", "predict",
           "recompute_mode", "split_name", "stage_plan", "staged_costs"]
