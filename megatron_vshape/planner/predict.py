"""Predict one (schedule, layout): iteration time, MFU, bubble, per-GPU memory, OOM.

Iteration time = simulated pipeline makespan + DP gradient sync + optimizer step (neither
overlapped, as in the authors' fork). MFU = Megatron's model FLOPs / (time * GPUs * peak).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedules import SCHEDULES, Costs, ScheduleError
from .costs import CostModel, PassTimes
from .exposed_p2p import blocking_costs, blocks_on_p2p
from .layout import Layout
from .memory import RESERVED_BYTES, MemoryEstimate, activation_model, activation_peaks, static_bytes
from .model import GPTModel
from .simcache import run_pipeline

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
    layout: Layout
    iteration_time: float  # seconds
    mfu: float
    bubble_rate: float
    memory: MemoryEstimate
    capacity: float  # bytes usable per GPU
    pass_times: PassTimes
    extrapolated: bool

    @property
    def oom(self) -> bool:
        return self.memory.peak > self.capacity

    def to_json(self) -> dict:
        lay = self.layout
        return {
            "schedule": self.schedule, "dp": lay.dp, "tp": lay.tp, "pp": lay.pp,
            "micro_batch": lay.micro_batch, "num_microbatches": lay.num_microbatches,
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


def predict(name: str, layout: Layout, model: GPTModel, cost_model: CostModel,
            flash_attention: bool = False) -> Prediction:
    """Raise ValueError/ScheduleError naming the problem if the layout cannot run the schedule."""
    base, recompute = split_name(name)
    stages = num_stages(name, layout.pp)
    problem = layout.problem(model, stages)
    if problem:
        raise ValueError(problem)
    times = cost_model.pass_times(model, layout, flash_attention)
    costs = chunk_costs(times, model, stages, recompute, layout.pp)
    timed = costs
    if cost_model.blocking_p2p and blocks_on_p2p(base) and layout.pp > 1:
        timed = blocking_costs(base, costs, layout.pp,
                               lambda a, b: cost_model.p2p_between(model, layout, a, b))
    run = run_pipeline(base, layout.pp, layout.num_microbatches, timed)
    iteration = run.makespan + times.dp_sync + times.optimizer
    # The paper's bubble: 1 - compute / time, compute = m x (F + B + W) of one device (two V
    # chunks' worth of layer slots); waits for messages, exposed or not, count as bubble.
    compute = 2 * (costs.f + costs.b + costs.w) * layout.num_microbatches
    bubble = max(0.0, 1.0 - compute / run.span) if run.span > 0 else 0.0
    mfu = model.model_flops(layout.global_batch) / (iteration * layout.gpus * cost_model.gpu.peak_flops)
    placement = run.sample.schedule.placement
    static = static_bytes(model, layout, placement.stages_per_device, stages, cost_model.distributed_optimizer)
    acts = activation_model(model, layout, stages, flash_attention, recompute)
    peaks = activation_peaks(run.sample, acts)
    if run.earlier is not None:
        earlier = activation_peaks(run.earlier, acts)
        peaks = tuple(run.extend(late, early) for late, early in zip(peaks, earlier))
    memory = MemoryEstimate(static, peaks)
    capacity = cost_model.gpu.memory_bytes - RESERVED_BYTES
    return Prediction(name, layout, iteration, mfu, bubble, memory, capacity, times, run.extrapolated)


__all__ = ["Prediction", "ScheduleError", "chunk_costs", "num_stages", "planner_schedule_names", "predict",
           "split_name"]
