"""The planner's memory verdict on each grid point of the Slurm scripts, and its cache file.

A point fits when the planner's predicted peak on the worst GPU (weights, gradients and sharded
optimizer state, plus the schedule's simulated activation peak with flash attention's activation
sizes) is within the A100 80 GB's usable memory. ``memory_fit(run)`` reads only the run's model,
variant, sequence and layout (``generate.Run``); :class:`MemoryCache` keeps the verdicts by run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megatron_vshape.planner import CostModel, GPTModel, ParallelLayout, get_gpu, predict
from megatron_vshape.planner.memory import (
    RESERVED_BYTES,
    MemoryEstimate,
    activation_model,
    activation_peaks,
    static_bytes,
)
from megatron_vshape.planner.predict import chunk_costs, num_stages, split_name
from megatron_vshape.schedules.core.schedule import ScheduleError
from megatron_vshape.schedules.core.simulator import simulate
from megatron_vshape.schedules.generators.registry import get_schedule

GPU = get_gpu("a100")  # the paper's cluster: A100 SXM 80 GB
GIB = 1024**3
VOCAB = 50257  # GPT-2's, as the NullTokenizer mock data and the GPT2BPETokenizer data both use


@dataclass(frozen=True)
class MemoryFit:
    """The planner's per-GPU memory prediction for one run (worst GPU)."""

    peak: float  # bytes: static + activations on the worst GPU
    static: float  # weights, gradients, optimizer state on that GPU
    activation: float
    capacity: float  # usable bytes (HBM minus the planner's reserve)

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity

    def describe(self) -> str:
        return (f"predicted peak {self.peak / GIB:.1f} GiB (static {self.static / GIB:.1f} + activations "
                f"{self.activation / GIB:.1f}) of {self.capacity / GIB:.0f} GiB usable")


class MemoryCache:
    """Planner verdicts by run, kept in ``memory_fit.json`` next to the scripts.

    The planner simulates every schedule at up to 40 devices and 640 microbatches: all grid points
    take tens of minutes, so ``--check`` and the tests read the verdicts from this file, and the
    tests recompute the points nearest the memory limit with the live planner (a planner change that
    would flip a verdict fails them). Runs missing from the file are computed on the spot;
    ``--refresh-memory`` recomputes all.
    """

    def __init__(self, path: Path):
        self.path = path
        self.entries: dict[str, dict] = json.loads(path.read_text()) if path.exists() else {}
        self.refresh = False
        self.dirty = False

    def get(self, run) -> MemoryFit:
        entry = None if self.refresh else self.entries.get(run.key)
        if entry is None:
            fit = memory_fit(run)
            self.entries[run.key] = {"peak": fit.peak, "static": fit.static, "activation": fit.activation}
            self.dirty = True
            return fit
        return MemoryFit(entry["peak"], entry["static"], entry["activation"], GPU.memory_bytes - RESERVED_BYTES)

    def save(self, keys: set[str]) -> None:
        """Write the entries of ``keys`` (runs that no longer exist are dropped from the file)."""
        kept = {key: self.entries[key] for key in sorted(keys)}
        self.path.write_text(json.dumps(kept, indent=1) + "\n")




def padded_vocab(tp: int) -> int:
    """Megatron pads the vocabulary to a multiple of 128 x TP (--make-vocab-size-divisible-by 128)."""
    multiple = 128 * tp
    return -(-VOCAB // multiple) * multiple


def planner_model(run) -> GPTModel:
    m = run.model
    return GPTModel(m.name, m.layers, m.hidden, m.heads, run.seq, padded_vocab(run.tp))


def memory_fit(run) -> MemoryFit:
    """Static + simulated activation peak of the worst GPU, from the planner (TE fused attention = flash sizes)."""
    model, layout = planner_model(run), ParallelLayout(run.dp, run.tp, run.pp, run.micro_batch, run.global_batch)
    cost_model = CostModel(GPU)  # distributed optimizer, as the scripts run
    try:
        estimate = predict(run.variant.name, layout, model, cost_model, flash_attention=True).memory
    except ScheduleError:
        # The planner extrapolates large microbatch counts from two smaller ones, which
        # interleaved-1f1b refuses unless they are multiples of PP: simulate the real size instead.
        estimate = _exact_memory(run.variant.name, layout, model, cost_model)
    worst = max(range(len(estimate.per_device)), key=lambda i: estimate.per_device[i])
    return MemoryFit(estimate.per_device[worst], estimate.static[worst], estimate.activation[worst],
                     GPU.memory_bytes - RESERVED_BYTES)


def _exact_memory(name: str, layout: ParallelLayout, model: GPTModel, cost_model: CostModel) -> MemoryEstimate:
    base, recompute = split_name(name)
    stages = num_stages(name, layout.pp)
    costs = chunk_costs(cost_model.pass_times(model, layout), model, stages, recompute, layout.pp)
    result = simulate(get_schedule(base, layout.pp, layout.num_microbatches, costs), costs)
    static = static_bytes(model, layout, result.schedule.placement.stages_per_device, stages,
                          cost_model.distributed_optimizer)
    acts = activation_model(model, layout, stages, flash_attention=True, recompute=recompute)
    return MemoryEstimate(static, activation_peaks(result, acts))

