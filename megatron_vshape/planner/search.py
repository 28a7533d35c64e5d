"""Grid search over DP x TP x PP (x CP x EP) x microbatch size (x recomputation mode) per schedule,
like the paper's hybrid runs. The paper's grid is the default (CP 1, EP 1, no recomputation);
``vshape plan -- <Megatron flags>`` widens it to every CP, EP and recomputation mode.

``vocab_parallel``: the same search for the runs with ``--pipeline-vocab-parallel`` (planner/vocab.py).

Branch and bound: every candidate gets a cheap upper bound on its MFU (no pipeline bubble);
candidates are simulated best-bound first, and the search for a schedule stops as soon as the
best feasible MFU found beats every remaining bound. Configurations whose static memory alone
(weights, grads, optimizer state) exceeds the GPU are dropped before any simulation.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from ..schedules.core.schedule import ScheduleError
from ..schedules.generators.registry import SCHEDULES
from ..vocab_shards import splits_evenly
from .costs import CostModel
from .memory import RESERVED_BYTES, bytes_per_param
from .model import GPTModel
from .moe_pairs import pair_problem
from .parallel_layout import ParallelLayout
from .predict import Prediction, chunk_costs, num_stages, predict, recompute_mode, split_name
from .rows import row_label
from .vocab import head_seconds


@dataclass(frozen=True)
class Grid:
    """The values the search tries; ``None`` means every valid value."""

    tp: Sequence[int] | None = None
    pp: Sequence[int] | None = None
    dp: Sequence[int] | None = None
    micro_batch: Sequence[int] = (1, 2, 4, 8)
    cp: Sequence[int] = (1,)
    ep: Sequence[int] = (1,)
    recompute: Sequence[str] = ("none",)
    # Stop once the best MFU found is within this fraction of every remaining bound (0: exact).
    # The Megatron-flags grid is wide (CP, EP, recomputation): 0.02 there keeps it to seconds.
    tolerance: float = 0.0


@dataclass
class ScheduleSearch:
    schedule: str
    best: Prediction | None = None
    evaluated: list[Prediction] = field(default_factory=list)
    skipped: int = 0  # candidates pruned by the bound or by static memory
    vocab_parallel: bool = False  # the runs with --pipeline-vocab-parallel
    pairs: bool = False  # the runs with --overlap-moe-expert-parallel-comm (moe_pairs.py)

    @property
    def label(self) -> str:
        """The row's name: the schedule, with ``+vocab`` or ``+pairs`` for the runs with a flag (rows.py)."""
        return row_label(self.schedule, self.vocab_parallel, self.pairs)

    @property
    def reason(self) -> str:
        if self.best is not None:
            return ""
        return "every configuration is out of memory" if self.evaluated else "no valid configuration"


def layouts(model: GPTModel, gpus: int, global_batch: int, grid: Grid, gpus_per_node: int) -> Iterable[ParallelLayout]:
    def allowed(value: int, choices) -> bool:
        return choices is None or value in choices

    for tp in (t for t in (1, 2, 4, 8, 16) if t <= gpus_per_node and gpus % t == 0 and allowed(t, grid.tp)):
        for cp in (c for c in grid.cp if (gpus // tp) % c == 0):
            rest = gpus // (tp * cp)
            for pp in (p for p in range(2, rest + 1) if rest % p == 0 and allowed(p, grid.pp)):
                dp = rest // pp
                if not allowed(dp, grid.dp):
                    continue
                for ep in (e for e in grid.ep if (dp * cp) % e == 0):
                    for mb in grid.micro_batch:
                        if global_batch % (dp * mb) == 0:
                            for mode in grid.recompute:
                                yield ParallelLayout(dp, tp, pp, mb, global_batch, cp, ep, mode)


def _upper_bound(name: str, layout: ParallelLayout, model: GPTModel, cost_model: CostModel,
                 flash_attention: bool = False, vocab_parallel: bool = False, pairs: bool = False) -> float:
    """MFU if the pipeline had no bubble except its fill (and, with ``pairs``, every all-to-all hidden).

    Iteration >= (time before the last device can start) + work per device + DP sync + step:
    the last pipeline device waits for the first microbatch's forwards (and messages) through
    every earlier device.
    """
    stages = num_stages(name, layout.pp)
    times = cost_model.pass_times(model, layout, flash_attention)
    if pairs:
        times = times.compute_only()
    costs = chunk_costs(times, model, stages, recompute_mode(name, layout) == "full", layout.pp)
    work = 2 * (costs.f + costs.b + costs.w) * layout.num_microbatches  # two V chunks' worth per device
    if vocab_parallel:
        # The busiest device holds at least the mean of the layers (whole layers: ceil(L / pp) when
        # they are alike), and every device its 1/pp of the head and the H passes' collectives.
        layer = (costs.f + costs.b + costs.w) / costs_slots(model, layout.pp)  # one layer's F + B + W
        layers = -(-model.layers // layout.pp) if len(set(model.layer_costs)) == 1 else model.layers / layout.pp
        vocab = sum(head_seconds(model, layout, times)) / layout.pp + cost_model.vocab_collectives(model, layout)
        work = (layers * layer + vocab) * layout.num_microbatches
    elif not layout.uses_slots(model, stages):
        # Costed per stage: the busiest device does at least the mean work and at least the LM head
        # (which sits on one device whole; with a 128k vocabulary about 2.6 layers' worth).
        f, b, w = costs.f / costs_slots(model, layout.pp), costs.b / costs_slots(model, layout.pp), \
            costs.w / costs_slots(model, layout.pp)  # one layer's F, B, W
        layer_f, layer_b, layer_w = model.layer_flops(1)
        head = model.head_flops(1) * (f / layer_f + b / layer_b + w / layer_w)
        layer = f + b + w
        if len(set(model.layer_costs)) == 1:  # whole layers: the head's device holds k of them, the
            # others share the rest, so the busiest holds at least ceil((L - k) / (pp - 1)) (best k)
            per_microbatch = min(max(head + k * layer, -(-(model.layers - k) // (layout.pp - 1)) * layer)
                                 for k in range(model.layers + 1))
        else:
            per_microbatch = max((model.layers * layer + head) / layout.pp, head)
        work = per_microbatch * layout.num_microbatches
    forward_per_device = costs.f * 2 * layout.pp / stages  # one F over the device's first stage
    if vocab_parallel:  # the stages hold layers alone: at least the fewest whole layers a stage can get
        forward_per_device = costs.f / costs_slots(model, layout.pp) * (model.layers // stages) \
            if len(set(model.layer_costs)) == 1 and not model.segments else 0.0
    fill = (layout.pp - 1) * (forward_per_device + costs.comm)
    dp = cost_model.dp_exposed(model, layout, times, 2 * (costs.b + costs.w))  # at least what predict charges
    iteration = fill + work + dp + times.optimizer
    return model.model_flops(layout.global_batch) / (iteration * layout.gpus * cost_model.mfu_peak)


def costs_slots(model: GPTModel, pp: int) -> float:
    """Layer slots in one V chunk of the paper's slot model (what :func:`chunk_costs` multiplies by)."""
    return (model.layers + 2) / (2 * pp)


def _static_fits(layout: ParallelLayout, model: GPTModel, cost_model: CostModel) -> bool:
    """Weights, gradients and optimizer state of the layers alone (experts split over EP) fit."""
    experts = model.layers * model.mean_cost.expert_params
    dense = model.layers * model.layer_params - experts
    data = layout.dp * layout.cp
    static = dense / (layout.tp * layout.pp) * bytes_per_param(data, cost_model.distributed_optimizer) + \
        experts / (layout.tp * layout.ep * layout.pp) * bytes_per_param(max(data // layout.ep, 1),
                                                                        cost_model.distributed_optimizer)
    return static < cost_model.gpu.memory_bytes - RESERVED_BYTES


@lru_cache(maxsize=1024)
def _min_microbatches(base: str, pp: int) -> int:
    return SCHEDULES[base].min_microbatches(pp)  # a search over its sizes: milliseconds each, asked often


def _runnable(name: str, layout: ParallelLayout, model: GPTModel) -> bool:
    base, _ = split_name(name)
    if layout.num_microbatches < _min_microbatches(base, layout.pp):
        return False
    return layout.problem(model, num_stages(name, layout.pp)) is None


def search(schedules: Sequence[str], model: GPTModel, cost_model: CostModel, gpus: int, global_batch: int,
           grid: Grid = Grid(), flash_attention: bool = False, vocab_parallel: bool = False,
           pairs: bool = False) -> list[ScheduleSearch]:
    for name in schedules:
        split_name(name)  # fail fast on a bad name, before any simulation
    candidates = list(layouts(model, gpus, global_batch, grid, cost_model.gpu.gpus_per_node))
    return [_search_one(name, candidates, model, cost_model, flash_attention, grid.tolerance, vocab_parallel, pairs)
            for name in schedules]


def _search_one(name, candidates, model, cost_model, flash_attention, tolerance: float = 0.0,
                vocab_parallel: bool = False, pairs: bool = False) -> ScheduleSearch:
    found = ScheduleSearch(name, vocab_parallel=vocab_parallel, pairs=pairs)
    viable = [c for c in candidates if _runnable(name, c, model) and (not vocab_parallel or vocab_problem(c, model) is None)
              and (not pairs or pair_problem(name, c, model) is None)]
    fitting = [c for c in viable if _static_fits(c, model, cost_model)]
    found.skipped = len(viable) - len(fitting)
    bounds = {c: _upper_bound(name, c, model, cost_model, flash_attention, vocab_parallel, pairs) for c in fitting}
    ranked = sorted(fitting, key=lambda c: -bounds[c])
    out_of_memory: list[ParallelLayout] = []
    for index, layout in enumerate(ranked):
        if found.best is not None and bounds[layout] * (1 - tolerance) <= found.best.mfu:
            found.skipped += len(ranked) - index
            break
        if any(_dominated(layout, smaller) for smaller in out_of_memory):
            found.skipped += 1
            continue
        try:
            prediction = predict(name, layout, model, cost_model, flash_attention, vocab_parallel=vocab_parallel,
                                 pairs=pairs)
        except ScheduleError:
            found.skipped += 1  # e.g. a generator that cannot meet its memory cap at this size
            continue
        found.evaluated.append(prediction)
        if prediction.oom:
            out_of_memory.append(layout)
        if not prediction.oom and (found.best is None or prediction.mfu > found.best.mfu):
            found.best = prediction
    return found


def vocab_problem(layout: ParallelLayout, model: GPTModel) -> str | None:
    """Why training refuses --pipeline-vocab-parallel on ``layout`` (megatron/vocab_checks.py), or None: no
    context parallelism, and Megatron's padded vocabulary (to a multiple of --make-vocab-size-divisible-by x TP)
    in TP x PP equal shards."""
    if layout.cp > 1:
        return "--pipeline-vocab-parallel does not run with context parallelism"
    padded = model.padded_vocab_at(layout.tp)
    if not splits_evenly(padded, layout.tp, layout.pp):
        return (f"--pipeline-vocab-parallel: the padded vocabulary ({padded}) does not split into TP {layout.tp} x "
                f"PP {layout.pp} equal shards; set --make-vocab-size-divisible-by to a multiple of PP")
    return None


def _dominated(layout: ParallelLayout, oom: ParallelLayout) -> bool:
    """A bigger microbatch on a layout already out of memory, with the pipeline still full.

    Activations grow with the microbatch size, and once there are at least as many microbatches
    as pipeline devices the number in flight no longer shrinks, so memory only grows.
    """
    same_split = (layout.dp, layout.tp, layout.pp, layout.cp, layout.ep, layout.recompute) == \
        (oom.dp, oom.tp, oom.pp, oom.cp, oom.ep, oom.recompute)
    return same_split and layout.micro_batch > oom.micro_batch and layout.num_microbatches >= layout.pp
