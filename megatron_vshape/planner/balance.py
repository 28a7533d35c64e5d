"""Balanced layer layouts: fewer transformer layers where the embedding, LM head and loss already sit.

On the V placement device 0 holds the first stage (embedding) and the last (final norm, LM head,
loss); with a 128k vocabulary the head alone costs about 2.6 layers. :func:`stage_work` turns a
layout (transformer layers per global stage) into per-stage cost multipliers from the FLOPs model;
:func:`choose_layout` picks the layout whose simulated iteration is shortest for one schedule.

Units: a multiplier of 1 is one *uniform stage*, ``L / num_stages`` transformer layers (one V chunk
on a V placement), separately for F, B, W and the activation memory of one F. With the uniform
layout and no head the multipliers are all 1, i.e. today's costs.

FLOPs per microbatch of ``t`` tokens (see :mod:`.model`): a layer is F ``24 t h^2 + 4 t s h``,
B ``24 t h^2 + 8 t s h``, W ``24 t h^2``; the LM head's logits GEMM is F ``2 t h V``, its input
gradient (B) ``2 t h V`` and its weight gradient (W) ``2 t h V``. The embedding lookup, final
norm and softmax/cross-entropy are elementwise: no GEMM FLOPs, counted as free. Memory: a layer
keeps ``activation_bytes``; the last stage also keeps the fp32 logits for the loss's backward.

Search: start from proportional balancing of each device's total work (a V device holds stages i
and 2d-1-i), then move one layer at a time between stages while the simulated makespan drops.
Candidates are timed on a fixed order (generation is the slow part); greedy generators, whose
order depends on the costs, are re-run after each accepted move. The result is never slower than
the reference layout (uniform, or the paper's "layers + 2" layout when uniform does not divide).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from ..layout_flag import check_layout
from ..schedules.core.schedule import Costs, Placement, PlacementKind, Schedule, ScheduleError, StageWork
from ..schedules.core.simulator import last_end, simulate
from ..schedules.generators.registry import SCHEDULES, get_schedule
from .model import GPTModel
from .simcache import exact_limit, extrapolation_sizes

# An empty first stage holds only the embedding: a gather and a gradient scatter, memory-bound and
# tiny next to a layer, but the schedule core takes only positive multipliers; this floor (of a
# uniform stage) stands for it.
MIN_STAGE_WORK = 1e-3
REGULAR = frozenset({"gpipe", "1f1b", "interleaved-1f1b", "v-min", "v-half"})  # order independent of costs
MAX_ROUNDS = 64  # accepted moves; each lowers the makespan, so the loop ends well before on real models
SHORTLIST = 40  # one-layer moves simulated per round, picked by per-device work (see _shortlist)
GREEDY_SHORTLIST = 1  # of those, regenerated per round for a greedy (cost-dependent) schedule (seconds each)
INFINITY = float("inf")


@dataclass(frozen=True)
class LayoutChoice:
    """The chosen layout and what the simulator predicts for it and for the reference layout.

    Times are in the units of the costs given to :func:`choose_layout` (seconds with a cost model,
    or F of one uniform stage = 1 by default): the pipeline's makespan, no DP sync or optimizer.
    """

    schedule: str
    layers_per_stage: tuple[int, ...]
    iteration_time: float
    reference_name: str  # "uniform", or "paper" (layers + 2 split) when uniform does not divide
    reference_layers: tuple[int, ...]
    reference_time: float
    peak_memory: float  # max over devices, simulator units (one F of a uniform stage = 1/2 on a V)
    reference_peak_memory: float
    evaluated: int  # layouts simulated

    @property
    def uniform_time(self) -> float:
        return self.reference_time

    @property
    def speedup(self) -> float:
        return self.reference_time / self.iteration_time


# ---- per-stage work from FLOPs -----------------------------------------------------------------
def _layer_flops(model: GPTModel) -> tuple[float, float, float]:
    return model.layer_flops(1)


@dataclass(frozen=True)
class StageExtras:
    """Work besides the transformer layers, in layers' worth of (F, B, W): the embedding on the
    first stage, the final norm, LM head and loss on the last. :meth:`from_flops` is the FLOPs
    model; a measurement (e.g. scripts/bench_layout.py's calibration run) may give other values."""

    embedding: tuple[float, float, float] = (0.0, 0.0, 0.0)
    head: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def __post_init__(self) -> None:
        values = (*self.embedding, *self.head)
        if len(self.embedding) != 3 or len(self.head) != 3 or not all(v >= 0 for v in values):
            raise ValueError(f"stage extras must be three numbers >= 0 each (F, B, W); got {self}")

    @classmethod
    def from_flops(cls, model: GPTModel) -> StageExtras:
        """Embedding free; the head's logits GEMM, its input gradient (B) and weight gradient (W)."""
        head = model.head_flops(1)
        return cls((0.0, 0.0, 0.0), tuple(head / per_layer for per_layer in _layer_flops(model)))


def stage_work(model: GPTModel, layers_per_stage, flash_attention: bool = False,
               extras: StageExtras | None = None, vocab_parallel: bool = False) -> tuple[StageWork, ...]:
    """Each stage's (F, B, W, memory) relative to a uniform stage of ``L / len(layers_per_stage)`` layers.

    Stage 0 holds the embedding, the last stage the final norm, LM head and loss (``extras``;
    default :meth:`StageExtras.from_flops`). ``vocab_parallel``: the vocabulary layers run as passes of
    their own on every device (``--pipeline-vocab-parallel``, planner/vocab.py): the stages hold the
    layers alone, and the last one keeps no logits.
    """
    return _stage_terms(model, flash_attention, extras, vocab_parallel).works(tuple(layers_per_stage))


class _StageTerms:
    """What :func:`stage_work` reads from the model, read once per (model, flash attention, extras): the layout
    search asks for thousands of layouts of one model (the 1024-GPU plan: 7.7k calls), and each layout's
    stages are (first layer, layer count) pairs it has mostly seen before, so their layers' sums are kept
    (summed exactly as before, layer by layer from the first)."""

    def __init__(self, model: GPTModel, flash_attention: bool, extras: StageExtras | None, vocab_parallel: bool):
        self.model = model
        self.extras = StageExtras() if vocab_parallel else extras or StageExtras.from_flops(model)
        self.act = model.activation_bytes(1, 1, flash_attention)
        self.logits = 0.0 if vocab_parallel else model.logits_bytes(1, 1)
        self.weights = model.layer_weights(flash_attention)  # per layer, relative to the mean (1.0 when alike)
        self._own: dict[tuple[int, int], list[float]] = {}
        # works() by layout: the layout search asks for the same layouts' work again and again (scoring, building,
        # the device bound), and a StageWork checks its fields when made. At most WORKS_KEPT layouts (then
        # cleared); the tuples are immutable, so sharing them is safe.
        self._works: dict[tuple[int, ...], tuple[StageWork, ...]] = {}

    def own(self, start: int, count: int) -> list[float]:
        found = self._own.get((start, count))
        if found is None:
            weights = self.weights
            found = self._own[(start, count)] = [sum(w[i] for w in weights[start:start + count]) for i in range(4)]
        return found

    def works(self, layers: tuple[int, ...]) -> tuple[StageWork, ...]:
        found = self._works.get(layers)
        if found is None:
            if len(self._works) >= WORKS_KEPT:
                self._works.clear()
            found = self._works[layers] = self._made_works(layers)
        return found

    def _made_works(self, layers: tuple[int, ...]) -> tuple[StageWork, ...]:
        num_stages = len(layers)
        unit = self.model.layers / num_stages
        extras, act, logits = self.extras, self.act, self.logits
        out, start = [], 0
        for stage, count in enumerate(layers):
            first, last = stage == 0, stage == num_stages - 1
            own = self.own(start, count)
            start += count
            work = [x + (e if first else 0.0) + (h if last else 0.0) for x, e, h in zip(own, extras.embedding, extras.head)]
            memory = own[3] * act + (logits if last else 0.0)
            ratios = [x / unit for x in work] + [memory / (unit * act)]
            out.append(StageWork(*(max(r, MIN_STAGE_WORK) for r in ratios)))
        return tuple(out)


# Layouts whose stage work one _StageTerms keeps (a few hundred kB of StageWork at PP 32).
WORKS_KEPT = 4096


@lru_cache(maxsize=16)
def _stage_terms(model: GPTModel, flash_attention: bool, extras: StageExtras | None,
                 vocab_parallel: bool) -> _StageTerms:
    return _StageTerms(model, flash_attention, extras, vocab_parallel)


def stage_time(work: StageWork, placement: Placement, costs: Costs) -> float:
    """F + B + W of one microbatch on a stage, as the simulator times it (``costs`` are per V chunk,
    L/(2d) layers; a looped stage of L/d layers is twice that: ``layer_scale``)."""
    return (work.f * costs.f + work.b * costs.b + work.w * costs.w) * placement.layer_scale


def device_work(works, placement: Placement, costs: Costs = Costs()) -> tuple[float, ...]:
    """Per-device time of one microbatch's F + B + W over all its stages, in ``costs`` units."""
    return tuple(sum(stage_time(works[s], placement, costs) for s in stages) for stages in placement.stages_per_device)


def default_costs(model: GPTModel) -> Costs:
    """One V chunk's (L/(2d) layers') F = 1, with a layer's B/F and W/F from FLOPs and no communication."""
    f, b, w = _layer_flops(model)
    return Costs(1.0, b / f, w / f, 0.0)


# ---- reference layouts -------------------------------------------------------------------------
def paper_layout(num_layers: int, num_stages: int) -> tuple[int, ...] | None:
    """The paper's split: embedding and head each take a layer's slot (None if L + 2 does not divide)."""
    if (num_layers + 2) % num_stages or (num_layers + 2) // num_stages < 1:
        return None
    per = (num_layers + 2) // num_stages
    counts = [per] * num_stages
    counts[0] -= 1
    counts[-1] -= 1
    return tuple(counts)


def reference_layout(num_layers: int, num_stages: int) -> tuple[str, tuple[int, ...]]:
    if num_layers % num_stages == 0:
        return "uniform", (num_layers // num_stages,) * num_stages
    paper = paper_layout(num_layers, num_stages)
    if paper is not None:
        return "paper", paper
    return "even", _spread(num_layers, num_stages)


def _spread(total: int, parts: int) -> tuple[int, ...]:
    """As even as possible, the remainder on the middle stages (neither holds the embedding or head)."""
    base, extra = divmod(total, parts)
    counts = [base] * parts
    order = sorted(range(parts), key=lambda s: (s in (0, parts - 1), abs(s - (parts - 1) / 2)))
    for stage in order[:extra]:
        counts[stage] += 1
    return tuple(counts)


# ---- the proportional start --------------------------------------------------------------------
def _apportion(total: int, weights: list[float], floors: list[int]) -> list[int]:
    """Integers >= floors summing to ``total``, proportional to ``weights`` (largest remainder)."""
    counts = list(floors)
    left = total - sum(floors)
    share = [max(w, 0.0) for w in weights]
    scale = left / sum(share) if sum(share) > 0 else 0.0
    ideal = [x * scale for x in share] if scale else [left / len(share)] * len(share)
    base = [int(x) for x in ideal]
    rest = left - sum(base)
    order = sorted(range(len(ideal)), key=lambda i: (-(ideal[i] - base[i]), i))
    for i in order[:rest]:
        base[i] += 1
    return [c + b for c, b in zip(counts, base)]


def proportional_layout(model: GPTModel, placement: Placement, costs: Costs,
                        extras: StageExtras | None = None, vocab_parallel: bool = False) -> tuple[int, ...]:
    """Each device gets layers in proportion to what its stages' head/embedding leave of the mean work;
    within a device, layers go where they even out the stages' work. ``vocab_parallel``: no head or
    embedding on the stages (the uniform layout where the layers divide)."""
    num_stages, per_device = placement.num_stages, placement.stages_per_device
    # the extras alone (embedding, head)
    probe = stage_work(model, (0,) * num_stages, extras=extras, vocab_parallel=vocab_parallel)
    # One layer is 1/unit of a uniform stage (unit = L / num_stages layers) in each of F, B, W.
    per_layer = (costs.f + costs.b + costs.w) * placement.layer_scale * num_stages / model.layers
    extras = device_work(probe, placement, costs)
    mean = (model.layers * per_layer + sum(extras)) / placement.num_devices
    floors = [sum(1 for s in stages if 0 < s < num_stages - 1) for stages in per_device]
    weights = [mean - e - per_layer * f for e, f in zip(extras, floors)]
    device_layers = _apportion(model.layers, weights, floors)
    counts = [0] * num_stages
    for stages, n in zip(per_device, device_layers):
        stage_extra = [stage_time(probe[s], placement, costs) for s in stages]
        stage_floor = [1 if 0 < s < num_stages - 1 else 0 for s in stages]
        top = (sum(stage_extra) + n * per_layer) / len(stages)  # every stage at the same work
        share = [top - e - per_layer * f for e, f in zip(stage_extra, stage_floor)]
        for s, c in zip(stages, _apportion(n, share, stage_floor)):
            counts[s] = c
    return tuple(counts)


# ---- scoring by the simulator ------------------------------------------------------------------
@dataclass
class _Scorer:
    model: GPTModel
    name: str
    num_devices: int
    num_microbatches: int
    costs: Costs
    flash_attention: bool
    memory_limit: float | None
    placement: Placement
    extras: StageExtras | None = None
    evaluated: int = 0
    orders: dict[tuple, Schedule] = field(default_factory=dict)

    def works(self, layers) -> tuple[StageWork, ...]:
        return stage_work(self.model, layers, self.flash_attention, self.extras)

    def costs_for(self, layers) -> Costs:
        return self.costs.with_stages(self.works(layers))

    def build(self, layers, num_microbatches: int | None = None, shared: bool = False,
              base_order: bool = False) -> Schedule:
        """The schedule generated for ``layers``' costs, as training would get it (cached).

        ``base_order``: generated for the base costs alone, as training builds a uniform layout's
        schedule. ``shared``: the same for a regular schedule (order nearly independent of costs),
        one order per size, cheap enough to rank many layouts on."""
        m = num_microbatches or self.num_microbatches
        base = base_order or (shared and self.name in REGULAR)
        key = (m, None if base else tuple(layers))
        if key not in self.orders:
            costs = self.costs if base else self.costs_for(layers)
            limit = {"memory_limit": self.memory_limit} if SCHEDULES[self.name].takes_memory_limit else {}
            self.orders[key] = get_schedule(self.name, self.num_devices, m, costs, **limit)
        return self.orders[key]

    def evaluate(self, layers, num_microbatches: int | None = None) -> float:
        """Build and time (the makespan); a layout the generator cannot schedule (e.g. over a memory cap) scores
        infinity."""
        try:
            return self.makespan(self.build(layers, num_microbatches), layers)
        except ScheduleError:
            return INFINITY

    def time(self, schedule: Schedule, layers) -> tuple[float, float]:
        """(makespan, peak activation memory) of ``schedule``'s order under ``layers``' costs."""
        self.evaluated += 1
        result = simulate(schedule, self.costs_for(layers))
        # End of each device's last pass (the whole timeline's max end, without walking it all).
        end = max(result.timeline[program[-1]].end for program in schedule.programs if program)
        return end, max(result.peak_memory)

    def makespan(self, schedule: Schedule, layers) -> float:
        """:meth:`time`'s makespan alone (the ranking reads no memory: the simulator's memory timelines were
        as long as its timing)."""
        self.evaluated += 1
        return last_end(schedule, self.costs_for(layers))


def _moves(layers: tuple[int, ...]):
    """Every layout one layer away that keeps the middle stages non-empty."""
    num_stages = len(layers)
    for src in range(num_stages):
        if layers[src] == 0 or (layers[src] == 1 and 0 < src < num_stages - 1):
            continue
        for dst in range(num_stages):
            if dst != src:
                moved = list(layers)
                moved[src] -= 1
                moved[dst] += 1
                yield tuple(moved)


def _shortlist(scorer: _Scorer, layouts) -> list[tuple[int, ...]]:
    """The layouts worth simulating: lowest busiest-device work first, then the most even stages
    (the fill and drain pass through every stage). Which of equally loaded layouts is fastest
    depends on where the bottleneck sits, which only the simulator tells, hence a long list."""
    def key(layers):
        works = scorer.works(layers)
        load = device_work(works, scorer.placement, scorer.costs)
        stage = [x.f + x.b + x.w for x in works]
        return round(max(load), 9), round(sum(x * x for x in stage), 9), layers
    return sorted(layouts, key=key)[:SHORTLIST]


def placement_for(name: str, num_devices: int) -> Placement:
    """The placement ``name`` runs on (interleaved-1f1b: 2 chunks per device, as the planner assumes)."""
    spec = SCHEDULES[name]
    if spec.placement is PlacementKind.V:
        return Placement.v_shape(num_devices)
    return Placement.looped(num_devices, spec.chunks_per_device())


def _search_size(name: str, num_devices: int, num_microbatches: int) -> int:
    """Microbatches the local search simulates: past the warm-up, but capped (generation cost)."""
    return SCHEDULES[name].nearest_microbatches(num_devices, min(num_microbatches, max(2 * num_devices, 8)))


def choose_layout(model: GPTModel, schedule_name: str, pp: int, num_microbatches: int, costs: Costs | None = None,
                  memory_limit: float | None = None, flash_attention: bool = False,
                  extras: StageExtras | None = None) -> LayoutChoice:
    """The layout (layers per global stage) with the shortest simulated iteration of ``schedule_name``.

    ``costs``: F, B, W of one V chunk (L/(2d) layers, as everywhere in the schedule core) and a
    message (default: :func:`default_costs`).
    ``memory_limit``: v-auto's limit (a fraction of 1F1B's peak), passed to its generator.
    ``extras``: the embedding's and head's work (default: from FLOPs, :meth:`StageExtras.from_flops`).
    Raises ScheduleError for unknown schedules or too few microbatches, ValueError (one line) if
    the model has fewer layers than the schedule has middle stages.
    """
    if schedule_name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {schedule_name!r}; choose one of: {', '.join(SCHEDULES)}")
    placement = placement_for(schedule_name, pp)
    num_stages = placement.num_stages
    if model.layers < max(num_stages - 2, 1):
        raise ValueError(f"--pipeline-layout: {model.layers} layers cannot fill the {num_stages - 2} middle stages "
                         f"of {schedule_name} on {pp} devices; use fewer pipeline devices")
    scorer = _Scorer(model, schedule_name, pp, num_microbatches, costs or default_costs(model), flash_attention,
                     memory_limit, placement, extras)
    reference_name, reference = reference_layout(model.layers, num_stages)
    start = proportional_layout(model, placement, scorer.costs, extras)
    best = _local_search(scorer, start, _search_size(schedule_name, pp, num_microbatches))
    # Final verdict at the real size, each layout with its own generated order.
    ref_time, ref_peak = _verdict(scorer, reference, reference=True)
    best_time, best_peak = _verdict(scorer, best)
    if best_time >= ref_time:
        best, best_time, best_peak = reference, ref_time, ref_peak
    check_layout(best, model.layers, num_stages)
    return LayoutChoice(schedule_name, best, best_time, reference_name, reference, ref_time, best_peak, ref_peak,
                        scorer.evaluated)


def _verdict(scorer: _Scorer, layers, reference: bool = False) -> tuple[float, float]:
    """(makespan, peak memory) at the real microbatch count, with the order training would run:
    generated for ``layers``' per-stage costs, or for the base costs for the uniform ``reference``
    (training builds a uniform layout's schedule without per-stage work). Errors raise for the
    reference (they are the user's) and score infinity otherwise.

    Above the planner's exact-simulation limit the makespan is extrapolated linearly from two
    smaller sizes, as :mod:`.simcache` does (generation with uneven costs grows faster than
    linearly in the count); the peak memory saturates once the pipeline is full."""
    spec, d, m = SCHEDULES[scorer.name], scorer.num_devices, scorer.num_microbatches
    base = reference and len(set(layers)) == 1

    def at(size: int) -> tuple[float, float]:
        try:
            return scorer.time(scorer.build(layers, size, base_order=base), layers)
        except ScheduleError:
            if reference:
                raise
            return INFINITY, INFINITY

    sizes = [spec.nearest_microbatches(d, size) for size in extrapolation_sizes(scorer.name, d)]
    if m <= exact_limit(scorer.name, d) or not sizes[0] < sizes[1] < m:
        return at(m)
    (t1, _), (t2, peak) = at(sizes[0]), at(sizes[1])
    if t2 == INFINITY:
        return INFINITY, INFINITY
    # Each extra microbatch costs at least the busiest device's work for one microbatch.
    per_microbatch = max(device_work(scorer.works(layers), scorer.placement, scorer.costs))
    return t2 + max((t2 - t1) / (sizes[1] - sizes[0]), per_microbatch) * (m - sizes[1]), peak


def _local_search(scorer: _Scorer, start: tuple[int, ...], size: int) -> tuple[int, ...]:
    """Best single-layer moves while the simulated makespan drops.

    A regular schedule's layouts are all timed on one shared order. A greedy schedule's shortlist
    is ranked on the current layout's own order, and the best few are regenerated and timed on
    their own orders before one is accepted (what training would run)."""
    regular = scorer.name in REGULAR

    def own(layout) -> float:
        return scorer.makespan(scorer.build(layout, size, shared=True), layout) if regular \
            else scorer.evaluate(layout, size)

    current = start
    current_time = own(current)
    for _ in range(MAX_ROUNDS):
        shortlist = _shortlist(scorer, _moves(current))
        if regular:
            scored = [(own(layout), layout) for layout in shortlist]
        else:
            if current_time < INFINITY:  # rank on the current order, then regenerate the best few
                order = scorer.build(current, size)
                shortlist = [layout for _, layout in sorted((scorer.makespan(order, x), x) for x in shortlist)]
            scored = [(own(layout), layout) for layout in shortlist[:GREEDY_SHORTLIST]]
        if not scored:
            break
        candidate_time, candidate = min(scored)
        if candidate_time >= current_time * (1 - 1e-9):
            break
        current, current_time = candidate, candidate_time
    return current
