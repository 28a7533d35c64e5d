"""Cached, size-extrapolated simulations: the search asks for the same shapes many times.

A schedule's timeline scales linearly with its costs, so simulations are keyed by the costs
normalised to F = 1 and rescaled afterwards; generation, the slow part, is further shared
between nearby cost ratios (within 0.1 for hand-ordered and building-block schedules, 0.02 and
0.001 for comm for the greedy ones); the order is generated with the rounded ratios and then
timed with the real ones. Large microbatch
counts (the paper goes to 512 on 40 devices) are slow to generate, so beyond ``exact_limit``
microbatches the makespan (and peak memory, which saturates except for GPipe) is extrapolated
linearly from two simulated sizes in the steady state.

Vocabulary passes (``costs.vocab``) go to the generator as they do in training (the registry places
them after the layers' schedule), with their multipliers rounded to 0.02 for sharing, and are timed
with the real ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from functools import lru_cache

from ..schedules.core.schedule import Costs, Schedule, StageWork, VocabWork
from ..schedules.core.simulator import SimulationResult, simulate
from ..schedules.generators.registry import get_schedule


@dataclass(frozen=True)
class PipelineRun:
    """What the planner needs from one simulated pipeline (times in seconds)."""

    makespan: float  # first pass start to last pass end, whole pipeline
    bubble_rate: float  # worst device
    sample: SimulationResult  # a simulated run (maybe fewer microbatches) for memory and pictures
    scale: float  # seconds per unit of ``sample``'s time axis
    extrapolated: bool
    earlier: SimulationResult | None = None  # the smaller extrapolation point (None if exact)
    num_microbatches: int = 0  # the size asked for (sample and earlier may be smaller)
    span: float = 0.0  # seconds, first to last pass of the device with the longest span

    def extend(self, at_sample: float, at_earlier: float) -> float:
        """Extrapolate a quantity measured on both points linearly to ``num_microbatches`` (never down).

        Peak memory saturates for most schedules but grows with the count for GPipe, so memory
        goes through here too: linearly only where the simulated peak grows between the two points
        (GPipe); where it has saturated, the later point's. (A per-device difference between two
        saturated points is not growth: at the 1024-GPU GPT-3 plan's V-ZB, PP 32, the two points are
        different orders, the uniform-built one at m = 92, with the same worst device, 25.5 GiB, and a
        per-device line through them said 36.5 GiB at m = 192.)"""
        if self.earlier is None or at_sample <= at_earlier:
            return at_sample
        if self.sample.peak_memory_max <= self.earlier.peak_memory_max + 1e-9:
            return at_sample
        m1, m2 = self.earlier.schedule.num_microbatches, self.sample.schedule.num_microbatches
        return at_sample + (at_sample - at_earlier) / (m2 - m1) * (self.num_microbatches - m2)


def _sizes(num_devices: int) -> tuple[int, int]:
    """The two microbatch counts a large run is extrapolated from: both past the warm-up
    (at least 1.5 fills of the pipeline) and a multiple of 6 apart, because V-Min's repeating
    bubble recurs every few microbatches (every 3 at d = 6) and a slope measured over part of a
    period misses it."""
    first = max(num_devices + num_devices // 2, 12)
    return first, first + 6 * -(-max(2, num_devices // 4) // 6)


EXACT_BUDGET = 4096  # devices x microbatches simulated exactly (about 1 s of generation)
# Hand-ordered and building-block schedules repeat exactly once warmed up (extrapolation error
# below 0.1 %); greedy ones (ZB, V-ZB, adaptive) are irregular and may carry a repeating bubble
# that small runs hide, so they are simulated exactly up to EXACT_BUDGET.
REGULAR = frozenset({"gpipe", "1f1b", "interleaved-1f1b", "v-min", "v-half"})


def exact_limit(name: str, num_devices: int) -> int:
    """Largest microbatch count simulated exactly."""
    regular = _sizes(num_devices)[1]
    return regular if name in REGULAR else max(regular, EXACT_BUDGET // num_devices)


def extrapolation_sizes(name: str, num_devices: int) -> tuple[int, int]:
    """The two simulated microbatch counts a count above :func:`exact_limit` is extrapolated from."""
    limit = exact_limit(name, num_devices)
    return _sizes(num_devices) if name in REGULAR else (limit - 6 * -(-limit // 24), limit)


@lru_cache(maxsize=1024)
def _build(name: str, num_devices: int, num_microbatches: int, b: float, w: float, comm: float,
           stages: tuple[StageWork, ...] = (), vocab: VocabWork | None = None, a2a: float = 0.0) -> Schedule:
    """Generate a schedule for coarsely rounded cost ratios: generation (greedy) is the slow part,
    and a schedule's order barely changes with a few percent of cost. ``stages`` (each stage's own
    work) and ``vocab`` (the vocabulary passes) go to the generator as they do in training, which
    builds the run's schedule from them."""
    return get_schedule(name, num_devices, num_microbatches, Costs(1.0, b, w, comm, stages, vocab, a2a))


def _rounded(vocab: VocabWork | None) -> VocabWork | None:
    """The vocabulary multipliers the order is generated with (0.02 apart). Without the last stage's device's
    longer H (``holder``): training builds its schedule with every H alike (megatron/pipeline_layout.py), and
    the placement (schedules/generators/vocab_passes.py) given the longer H placed Llama-3 8B's V-ZB at PP 8
    4 % longer than the order built without it, both timed with it."""
    if vocab is None:
        return None
    rounded = replace(vocab, **{f.name: round(getattr(vocab, f.name) / 2, 2) * 2 for f in fields(vocab)})
    return replace(rounded, holder=0.0)


def _geometric(x: float, steps_per_octave: int = 4) -> float:
    """``x`` rounded to a geometric grid (2^(1/4) apart: within 9 %); tiny values to 0."""
    if x < 1e-3:
        return 0.0
    return 2.0 ** (round(math.log2(x) * steps_per_octave) / steps_per_octave)


@lru_cache(maxsize=4096)
def _simulate_normalised(name: str, num_devices: int, num_microbatches: int, b: float, w: float,
                         comm: float, stages: tuple[StageWork, ...] = (), coarse: bool = False,
                         staged_order: bool = False, vocab: VocabWork | None = None,
                         a2a: float = 0.0) -> SimulationResult:
    order_stages = stages if staged_order else ()
    order_vocab = _rounded(vocab)
    order_a2a = round(a2a / 2, 2) * 2  # the pairs' all-to-all (x F): the order is built as b and w are
    if coarse and name in REGULAR:  # a wide search (CP, EP, recomputation): one order per cost octave quarter
        schedule = _build(name, num_devices, num_microbatches, _geometric(b), _geometric(w), _geometric(comm), order_stages,
                          order_vocab, order_a2a)
    elif coarse:
        schedule = _build(name, num_devices, num_microbatches, round(b / 2, 2) * 2, round(w / 2, 2) * 2,
                          _geometric(comm, 8), order_stages, order_vocab, order_a2a)
    elif name in REGULAR:  # their order hardly depends on costs: share generation widely
        schedule = _build(name, num_devices, num_microbatches, round(b, 1), round(w, 1), round(comm / 2, 2) * 2, order_stages,
                          order_vocab, order_a2a)
    else:  # greedy decisions react to small cost changes (comm especially)
        schedule = _build(name, num_devices, num_microbatches, round(b / 2, 2) * 2, round(w / 2, 2) * 2,
                          round(comm, 3), order_stages, order_vocab, order_a2a)
    # timed with the real ratios (and per-stage work); generated as training generates it: for each stage's
    # own work under an uneven --pipeline-layout (``staged_order``), for the base costs under the uniform one.
    # (Generated for the base costs and timed with per-stage work, V-ZB at Llama-3 8B's PP 8 came out 7 %
    # shorter than the schedule training runs, and `vshape plan`'s two tables disagreed.)
    return simulate(schedule, Costs(1.0, b, w, comm, stages, vocab, a2a))


def run_pipeline(name: str, num_devices: int, num_microbatches: int, costs: Costs, coarse: bool = False,
                 staged_order: bool = False) -> PipelineRun:
    """Simulate ``name`` with real ``costs`` (seconds per V-chunk pass), extrapolating large sizes.

    ``staged_order``: the order is generated for ``costs``' per-stage work too, as training builds the
    schedule of an uneven ``--pipeline-layout`` (a uniform one is built from the base costs).

    ``coarse``: share generated orders over wider cost ranges (:func:`_geometric`), for searches
    over many cost ratios (the Megatron-flags grid); the paper's grid keeps the finer sharing its
    reproduced tables were made with."""
    unit = costs.f

    def sim(m: int) -> SimulationResult:
        return _simulate_normalised(name, num_devices, m, round(costs.b / unit, 6), round(costs.w / unit, 6),
                                    round(costs.comm / unit, 6), costs.stages, coarse, staged_order, costs.vocab,
                                    round(costs.a2a, 6))  # a2a is in units of F already

    limit = exact_limit(name, num_devices)
    if num_microbatches <= limit:
        result = sim(num_microbatches)
        return PipelineRun(result.makespan_total * unit, result.bubble_rate, result, unit, False,
                           None, num_microbatches, result.makespan * unit)
    m1, m2 = extrapolation_sizes(name, num_devices)
    first, second = sim(m1), sim(m2)

    # Each extra microbatch costs at least its work on the busiest device; greedy schedules
    # are irregular at small sizes and their measured slope can dip below that.
    floor = second.work_per_device / m2

    def extend(a: float, b: float) -> float:
        return b + max((b - a) / (m2 - m1), floor) * (num_microbatches - m2)

    total = extend(first.makespan_total, second.makespan_total)
    worst_span = extend(first.makespan, second.makespan)  # the simulator's per-device span
    work = second.work_per_device / m2 * num_microbatches
    return PipelineRun(total * unit, 1.0 - work / worst_span, second, unit, True, first, num_microbatches,
                       worst_span * unit)
