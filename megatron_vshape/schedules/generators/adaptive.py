"""``v-auto``: the adaptive V schedule under a memory limit (paper appendix B).

The user sets the activation memory, the schedule follows. For ``(d, m, costs)`` we build a
fixed set of candidate schedules on the V placement, evaluate each one (peak memory, bubble
under the given costs), and for a limit return the lowest-bubble candidate that fits.

Candidates:

* **Building blocks** with uniform gaps along each leg of the V (F chunk 0 down, F chunk 1 up,
  B chunk 1 down, B chunk 0 up), and blocks whose gaps switch at one device boundary; idle
  slots at the three turns of the V are chosen so the block is collision-free modulo the
  interval (6 slots). W passes go into the free slots after their B, as in ``blocks.fill_w``.
  Each block is repeated, squeezed and reordered by ``schedule_from_block``. V-Min and V-Half
  are members of this family and are added explicitly, so v-auto is never worse than them.
* **Memory-capped greedy V schedules** (``zero_bubble.best_greedy``) at a fixed grid of caps
  (``_GREEDY_FRACTIONS``), the top one being V-ZB itself.

The candidate set depends on ``(d, m, costs)`` only, never on the limit, so the returned bubble
can only fall as the limit rises: every candidate that fits a lower limit fits a higher one.

Enumerating blocks is cheap; evaluating one means repeat, squeeze and reorder. Blocks are
therefore screened (``_screened_blocks``) and only a few per memory level are evaluated.

Up to ``_EXACT_SEARCH_MAX_CELLS`` (devices x microbatches) the search is exact: every candidate is built at
the requested size and its measured peak and bubble decide (where a candidate that fits has no bubble at all,
the ones that provably have one are not built: ``_zero_bubble_choice``; the same choice). Above it, building the whole family
(or even ranking it on shorter runs) takes minutes at d=64, so the candidates are the fixed
schedules only (V-Min, V-Half, V-ZB, and the low greedy cap for limits below V-Min's memory), a
candidate fits when its memory bound does (the full-size schedule never exceeds it), and the
``_PROXY_EVALUATED`` fitting ones with the most memory are built at full size; the lower bubble
wins. Everywhere we measured, a fixed schedule with more memory has the lower bubble (V-ZB <
V-Half < V-Min), which is what makes the top two enough.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

from ..core.actions import Kind
from .adaptive_blocks import NAME, BlockCandidate, GapPattern, _named_blocks, candidate_blocks
from .block_schedule import repeated
from .simulated import simulated

__all__ = ["DEFAULT_LIMIT", "NAME", "BlockCandidate", "Evaluated", "GapPattern", "GreedyCandidate", "candidate_blocks",
           "choose", "evaluate_candidates", "greedy_caps", "lowest_reachable_limit", "v_auto"]
from ..core.inputs import EPS as _EPS
from ..core.schedule import Costs, Placement, Schedule, ScheduleError, one_f_one_b_peak
from ..core.simulator import simulate
from .solved import solved_for
from .zero_bubble import GreedyFamily, best_greedy, v_zb

DEFAULT_LIMIT = 1.0  # x 1F1B's peak, when no --memory-limit is given
# Caps of the greedy candidates, x 1F1B's peak. The low one makes any limit from 1/4 up
# reachable (below V-Min's ~1/3); 3/4 fills the gap between V-Half's blocks and V-ZB; 1 is V-ZB.
# (1/2 was dropped: V-Min/V-Half blocks beat it everywhere we measured, d=4..16.)
_GREEDY_FRACTIONS = (0.25, 0.75, 1.0)
_SCREEN_MICROBATCHES = 4  # short run that ranks blocks of one memory level
_PER_LEVEL = 2  # blocks per memory level that go to stage 2 of the screen
# Stage 2 keeps a memory level while its squeezed bubble is at most this much above the best lower
# level's: the reorder gains more where memory is spare (d=16: up to 0.025), so a strict Pareto
# cut would drop levels that end up best; 0.02 keeps twice the blocks for little more gain.
_STAGE2_SLACK = 0.01
_EXACT_SEARCH_MAX_CELLS = 1024  # above d*m, only the fixed schedules compete (see the module docstring)
_PROXY_EVALUATED = 2  # ... and only this many of them, those with the most memory that fit, are built
_FIXED_CANDIDATES = 3  # V-Min, V-Half, V-ZB: the first candidates above _EXACT_SEARCH_MAX_CELLS


# ---------------------------------------------------------------- candidates and their evaluation


@dataclass(frozen=True)
class GreedyCandidate:
    """The best memory-capped greedy V schedule; at 1F1B's memory this is V-ZB itself."""

    num_devices: int
    fraction: float  # of 1F1B's peak; the cap is rounded down to half units (one V chunk's F)

    @property
    def cap(self) -> float:
        return _cap_units(self.num_devices, self.fraction)

    @property
    def label(self) -> str:
        return "v-zb" if self.fraction >= 1 else f"greedy cap {self.cap:g}"

    def memory_bound(self, costs: Costs | None = None) -> float:
        return self.cap if costs is None else _cap_for(self.num_devices, self.fraction, costs)

    def build(self, num_microbatches: int, costs: Costs) -> Schedule:
        if self.fraction >= 1:
            return v_zb(self.num_devices, num_microbatches, costs)
        # A family, not a fixed cap: best_greedy may rank its rule variants on a smaller pipeline.
        fraction = self.fraction
        family = GreedyFamily(NAME, Placement.v_shape, lambda d, c: [_cap_for(d, fraction, c)] * d)
        return best_greedy(family, self.num_devices, num_microbatches, costs)


def _label(candidate: Candidate, costs: Costs) -> str:
    """The candidate's name for ``meta``: a greedy cap is stated under the costs' per-stage memory."""
    if isinstance(candidate, GreedyCandidate) and candidate.fraction < 1:
        return f"greedy cap {candidate.memory_bound(costs):g}"
    return candidate.label


def _cap_for(num_devices: int, fraction: float, costs: Costs) -> float:
    """The greedy cap under ``costs``: ``_cap_units`` when memory is uniform; otherwise
    ``fraction`` x 1F1B's peak under the per-stage memory, at least one microbatch on both
    chunks of the device that needs the most for it."""
    if costs.uniform:
        return _cap_units(num_devices, fraction)
    costs.check_stages(2 * num_devices, NAME)
    least = max((costs.memory_of(i) + costs.memory_of(2 * num_devices - 1 - i)) / 2 for i in range(num_devices))
    return max(least, fraction * one_f_one_b_peak(num_devices, costs))


def _cap_units(num_devices: int, fraction: float) -> float:
    """``fraction`` x 1F1B's peak in memory units, rounded down to half units, at least 1 unit
    (one microbatch on both chunks: the least any V schedule needs)."""
    return max(1.0, math.floor(2 * num_devices * fraction + _EPS) / 2)


Candidate = BlockCandidate | GreedyCandidate


@dataclass(frozen=True)
class Evaluated:
    """A candidate's peak memory (units, worst device) and bubble rate under the costs.

    Always measured on the schedule at the requested size (kept in ``schedule``). ``exact``:
    the candidate came from the full search (``_EXACT_SEARCH_MAX_CELLS``), not the fixed-schedule shortlist.
    """

    candidate: Candidate
    peak: float
    bubble: float
    exact: bool
    schedule: Schedule | None = None


def greedy_caps(num_devices: int) -> list[float]:
    """The caps (memory units) of the greedy candidates, from ``_GREEDY_FRACTIONS``."""
    return sorted({_cap_units(num_devices, fraction) for fraction in _GREEDY_FRACTIONS})


@lru_cache(maxsize=32)
def _shortlists(num_devices: int, costs: Costs, screen_microbatches: int) -> tuple[tuple[float, tuple], ...]:
    """Stage 1 of the screen (see ``_screened_blocks``): per memory level, ascending, the
    ``_PER_LEVEL`` enumerated blocks with the lowest bubble on a short repeated-and-squeezed run."""
    levels: dict[float, list] = {}
    for candidate in candidate_blocks(num_devices)[2:]:  # past V-Min and V-Half
        bubble = simulate(candidate.block.repeat(screen_microbatches, NAME), costs).bubble_rate
        level = levels.setdefault(candidate.memory_bound(), [])
        level.append((bubble, len(level), candidate))
    return tuple(
        (bound, tuple(c for _, _, c in sorted(levels[bound], key=lambda item: item[:2])[:_PER_LEVEL]))
        for bound in sorted(levels)
    )


def _screened_blocks(num_devices: int, costs: Costs, run_microbatches: int) -> list[BlockCandidate]:
    """V-Min, V-Half, and the enumerated blocks worth a full evaluation.

    Evaluating a block means repeat, squeeze and reorder (several list-scheduler runs), so the
    family is screened first. Stage 1: a short run (``_SCREEN_MICROBATCHES``, repeated and
    squeezed) ranks blocks of equal memory well (measured at d=8: each level's best ends up in
    the top two); keep ``_PER_LEVEL`` per memory level. Stage 2: the squeezed run at the evaluation
    size (the reorder can only improve it) picks one block per level, and a level is kept only if
    it is within ``_STAGE2_SLACK`` of every lower level: more memory must buy a lower bubble.
    """
    named = list(candidate_blocks(num_devices)[:2])
    kept, best_below = [], math.inf
    for _, shortlist in _shortlists(num_devices, costs, min(run_microbatches, _SCREEN_MICROBATCHES)):
        squeezed = [(simulated(repeated(c.block, run_microbatches, NAME), costs).bubble_rate, i, c)
                    for i, c in enumerate(shortlist)]
        bubble, _, best = min(squeezed, key=lambda item: item[:2])
        if bubble < best_below + _STAGE2_SLACK:
            kept.append(best)
        best_below = min(best_below, bubble)
    return named + kept


def _is_exact(num_devices: int, num_microbatches: int) -> bool:
    """Full search up to ``_EXACT_SEARCH_MAX_CELLS`` cells, the fixed schedules only above."""
    return num_devices * num_microbatches <= _EXACT_SEARCH_MAX_CELLS


@lru_cache(maxsize=64)
def candidates(num_devices: int, num_microbatches: int, costs: Costs) -> tuple[Candidate, ...]:
    """v-auto's candidate set for these sizes and costs (it never depends on the limit)."""
    d = num_devices
    fractions = {_cap_units(d, f): f for f in sorted(_GREEDY_FRACTIONS)}  # one per distinct cap
    if not _is_exact(d, num_microbatches):
        # V-Min, V-Half, V-ZB, and the lowest cap (the only way below V-Min's memory).
        lowest = min(fractions.values())
        return (*_named_blocks(d), GreedyCandidate(d, 1.0), *([GreedyCandidate(d, lowest)] * (lowest < 1)))
    greedy = [GreedyCandidate(d, fraction) for fraction in sorted(fractions.values())]
    return tuple(_screened_blocks(d, costs, num_microbatches) + greedy)


@lru_cache(maxsize=1024)
def _evaluate(num_devices: int, num_microbatches: int, costs: Costs, index: int) -> Evaluated:
    candidate = candidates(num_devices, num_microbatches, costs)[index]
    exact = _is_exact(num_devices, num_microbatches)
    try:
        schedule = candidate.build(num_microbatches, costs)
    except ScheduleError:  # e.g. every greedy variant stalls under this cap: never choose it
        return Evaluated(candidate, math.inf, math.inf, exact)
    result = simulated(schedule, costs)  # the build compared it already (block_schedule)
    return Evaluated(candidate, result.peak_memory_max, result.bubble_rate, exact, schedule)


def evaluate_candidates(num_devices: int, num_microbatches: int, costs: Costs) -> tuple[Evaluated, ...]:
    """Every candidate of v-auto for these sizes and costs, evaluated (cached)."""
    count = len(candidates(num_devices, num_microbatches, costs))
    return tuple(_evaluate(num_devices, num_microbatches, costs, i) for i in range(count))


# ---------------------------------------------------------------- the public entry points


def _check_limit(memory_limit: float) -> None:
    if not 0 < memory_limit <= 1:
        raise ScheduleError(f"--memory-limit must be in (0, 1] (a fraction of 1F1B's peak activation memory); "
                            f"got {memory_limit:g}")


def lowest_reachable_limit(num_devices: int, num_microbatches: int, costs: Costs = Costs()) -> float:
    """The smallest --memory-limit (fraction of 1F1B's peak) that v-auto can satisfy."""
    return min(peak for _, peak in _peaks(num_devices, num_microbatches, costs)) / one_f_one_b_peak(num_devices, costs)


def _peaks(num_devices: int, num_microbatches: int, costs: Costs) -> list[tuple[int, float]]:
    """(index, peak) of every candidate. An exact search measures the peaks (which needs every
    candidate built); otherwise the memory bounds are the peaks and nothing is built yet."""
    if _is_exact(num_devices, num_microbatches):
        return [(i, e.peak) for i, e in enumerate(evaluate_candidates(num_devices, num_microbatches, costs))]
    return [(i, c.memory_bound(costs)) for i, c in enumerate(candidates(num_devices, num_microbatches, costs))]


def choose(num_devices: int, num_microbatches: int, costs: Costs, memory_limit: float) -> Evaluated:
    """The lowest-bubble candidate whose peak fits ``memory_limit`` x 1F1B's peak (``d`` units
    when memory is uniform; weighted by the per-stage memory otherwise).

    Ties go to the lower peak, then to the earlier candidate, so the choice is deterministic.
    Only candidates that fit are evaluated (all of them in an exact search, see ``_peaks``;
    otherwise the ``_PROXY_EVALUATED`` with the largest memory bounds).
    """
    _check_limit(memory_limit)
    reference = one_f_one_b_peak(num_devices, costs)  # 1F1B's peak under the same per-stage memory
    budget = memory_limit * reference + _EPS
    if _is_exact(num_devices, num_microbatches) and costs.uniform:
        found = _zero_bubble_choice(num_devices, num_microbatches, costs, budget)
        if found is not None:
            return found
    peaks = _peaks(num_devices, num_microbatches, costs)
    fitting = [i for i, peak in peaks if peak <= budget]
    if not fitting:
        lowest = min(peak for _, peak in peaks) / reference
        raise ScheduleError(
            f"--memory-limit {memory_limit:g} is below what v-auto reaches on {num_devices} devices with "
            f"{num_microbatches} microbatches; the lowest reachable is {math.ceil(lowest * 1000) / 1000:g} "
            f"(x 1F1B's peak): raise --memory-limit to at least that"
        )
    if not _is_exact(num_devices, num_microbatches):
        # The low greedy cap (last) only where nothing else fits: it is slow to build and, at
        # less memory than V-Min, never better.
        fixed = [i for i in fitting if i < _FIXED_CANDIDATES] or fitting
        bounds = dict(peaks)
        fitting = sorted(fixed, key=lambda i: (-bounds[i], i))[:_PROXY_EVALUATED]
    evaluated = {i: _evaluate(num_devices, num_microbatches, costs, i) for i in fitting}
    best = min(fitting, key=lambda i: (evaluated[i].bubble, evaluated[i].peak, i))
    if math.isinf(evaluated[best].bubble):
        raise ScheduleError(f"v-auto: no candidate schedule could be built within --memory-limit {memory_limit:g}; "
                            f"try a higher limit")
    return evaluated[best]


def _zero_bubble_choice(num_devices: int, num_microbatches: int, costs: Costs, budget: float) -> Evaluated | None:
    """:func:`choose`'s choice without building the candidates that cannot win it, where a candidate that fits
    has no bubble at all (uniform stages; None where none does: every candidate is then built).

    With uniform stages every device does the same work, so a schedule without bubble keeps device 0 busy
    from its first pass to its last. Its first B (of the last stage, on device 0) waits for the forwards of
    its microbatch through all 2d stages, which started on device 0 itself; until then device 0 can run only
    forwards, at least 2d of them, each holding half a unit: its peak is at least d units (1F1B's). No
    candidate exceeds its memory bound (``memory_bound``), so one bounded below d - 1/2 has a bubble, which
    loses to none; the candidates left are built and the lowest (bubble, peak, index) wins, as in ``choose``."""
    listed = candidates(num_devices, num_microbatches, costs)
    open_ = [i for i, candidate in enumerate(listed) if candidate.memory_bound(costs) > num_devices - 0.5]
    evaluated = {i: _evaluate(num_devices, num_microbatches, costs, i) for i in open_}
    without = [i for i in open_ if evaluated[i].peak <= budget and evaluated[i].bubble <= 0.0]
    if not without:
        return None
    return evaluated[min(without, key=lambda i: (evaluated[i].bubble, evaluated[i].peak, i))]


@lru_cache(maxsize=64)
def _chosen_schedule(num_devices: int, num_microbatches: int, costs: Costs, memory_limit: float):
    chosen = choose(num_devices, num_microbatches, costs, memory_limit)
    return chosen, chosen.schedule


@lru_cache(maxsize=64)
def _solved_better(num_devices: int, num_microbatches: int, costs: Costs, memory_limit: float,
                   bubble: float):
    """The cached exact schedule (``exact.solved``) with the lowest bubble that fits the limit, when
    it beats ``bubble`` (the candidates' best); else None. Small cells only: see that module."""
    budget = memory_limit * one_f_one_b_peak(num_devices, costs) + _EPS
    best = None
    for cell in solved_for(num_devices, num_microbatches, costs):
        schedule = cell.schedule()
        result = simulate(schedule, costs)
        if result.peak_memory_max <= budget and result.bubble_rate < bubble - _EPS:
            if best is None or result.bubble_rate < best[0]:
                best = (result.bubble_rate, cell, schedule)
    return None if best is None else best[1:]


def v_auto(num_devices: int, num_microbatches: int, costs: Costs = Costs(), memory_limit: float | None = None) -> Schedule:
    """The lowest-bubble V schedule whose activation memory fits ``memory_limit`` x 1F1B's peak.

    Without a limit, 1F1B's own peak (1.0): the best V schedule that needs no more memory than
    Megatron's default. Cached by (d, m, costs, limit); each call returns its own ``meta`` dict.
    """
    if memory_limit is None:
        memory_limit = DEFAULT_LIMIT
    _check_limit(memory_limit)
    chosen, schedule = _chosen_schedule(num_devices, num_microbatches, costs, memory_limit)
    solved = _solved_better(num_devices, num_microbatches, costs, memory_limit, chosen.bubble)
    if solved is not None:
        cell, schedule = solved
        meta = {"memory_limit": memory_limit, "memory_limit_units": memory_limit * one_f_one_b_peak(num_devices, costs),
                "candidate": "optimal (solved, cached)", "exact_search": True, "lower_bound": cell.lower_bound,
                "optimal": cell.optimal, "solved_memory_limit": cell.memory_limit}
        return dataclasses.replace(schedule, name=NAME, meta=meta)
    meta = {
        "memory_limit": memory_limit,
        "memory_limit_units": memory_limit * one_f_one_b_peak(num_devices, costs),
        "candidate": _label(chosen.candidate, costs),
        "exact_search": chosen.exact,
    }
    if isinstance(chosen.candidate, BlockCandidate):
        block = chosen.candidate.block
        meta["interval"] = block.interval
        meta["offsets"] = {f"{kind.value}{stage}.0": block.offsets[(kind, stage)]
                           for stage in range(block.placement.num_stages) for kind in Kind}
    else:
        meta["greedy_cap_units"] = chosen.candidate.memory_bound(costs)
    return dataclasses.replace(schedule, name=NAME, meta=meta)
