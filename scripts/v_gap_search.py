#!/usr/bin/env python
"""The generators against stronger searches and against the order built for uniform stages.

    python scripts/v_gap_search.py --evaluations 300                     # uniform costs, d 2..16, m d/2d/4d
    python scripts/v_gap_search.py --schedules v-min,v-half,v-zb,zb-1p --devices 4-16 \
        --costs head1.5,head1.9,rand25,hybrid --evaluations 300 --markdown   # unequal stages
    python scripts/v_gap_search.py --devices 6,10 --factors 1 --costs a_equal
    python scripts/v_gap_search.py --json out/gaps.json --markdown      # the table for docs/schedules.md

For every cell (schedule, d, m, costs) the generator's schedule (``registry.get_schedule``, built for
the cell's per-stage costs) sets the memory: its peak, worst device (for the zero-bubble families at least
their cap, 1F1B's peak). Then:

* ``uniform-built`` (cost sets with unequal stages only): the same generator run for uniform stages (the
  base costs) and timed under the cell's stage costs. It is not a search but the reference the generator
  must never lose to (issue 44); its gain is its own column.

and the searches look for a schedule with a smaller makespan and no higher peak:

* ``greedy``: the greedy scheduler capped at that peak (``zero_bubble.best_greedy``, on the schedule's
  placement), another family of schedules altogether;
* ``offsets`` (V-Min, V-Half): a local search over the building block's F/B offsets (one offset of one
  device moved by 1, 2, 3 or 6 slots, W by ``fill_w``), each block through the slot reorder, first
  improvement, for ``--evaluations`` x OFFSETS_SHARE blocks;
* ``idle-fill``: the generator's schedule (and the offsets search's) replayed in real time with
  every wait filled by a ready pass within a look-ahead of 2d passes, no device above the peak
  (``reorder.fill_idle``);
* ``order``: a local search over the device programs of the best schedule so far: a later pass that
  is ready pulled into a wait, or the input a waiting pass waited for pulled ahead on its own
  device (first improvement of (makespan, sum of end times), the peak held);
* ``cp-sat`` (V placement, with ``--cpsat-seconds``; off by default because its budget is time): the
  exact model (``schedules.exact``) with the best schedule so far as its hint, on cells of at most
  ``--cpsat-max-passes`` passes. An improvement it finds is a gap; no proof is needed.

The local searches stop at a count of schedules tried (``--evaluations``, the default), which makes the
counts independent of the machine's speed; ``--seconds`` adds a CPU-time cap. A cell is reported when the
uniform-built order or the best search wins by more than ``--report`` (0.5 %). The searches are
heuristics: a cell without a gap is one where they found none, not a proof.

Cost sets: ``a_equal``, ``b_unequal`` (f=1,b=1.1,w=0.9), ``c_unequal_comm`` (and comm=0.05) on uniform
stages; on f=1,b=1.1,w=0.9,comm=0.05 with per-stage multipliers: ``head1.5`` / ``head1.9`` (the last
stage's F, B, W x 1.5 / 1.9), ``rand25`` (each stage's F, B, W x one factor drawn from [0.75, 1.25]) and
``hybrid`` (each stage's F, B, W multipliers drawn from {0.7, 1, 1.3}, {0.8, 1, 1.4}, {0.5, 1, 1.5}: a
HybridModel's mix of Mamba, attention and MoE layers). Drawn with a fixed seed per (set, stage count).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_vshape.schedules.core.actions import Kind  # noqa: E402
from megatron_vshape.schedules.core.inputs import EPS  # noqa: E402
from megatron_vshape.schedules.core.schedule import (  # noqa: E402
    Costs,
    Placement,
    PlacementKind,
    Schedule,
    ScheduleError,
    StageWork,
    one_f_one_b_peak,
)
from megatron_vshape.schedules.core.simulator import SimulationResult, simulate  # noqa: E402
from megatron_vshape.schedules.generators.block import BuildingBlock  # noqa: E402
from megatron_vshape.schedules.generators.block_schedule import schedule_from_block  # noqa: E402
from megatron_vshape.schedules.generators.local_search import pull_into_waits  # noqa: E402
from megatron_vshape.schedules.generators.registry import SCHEDULES, get_schedule  # noqa: E402
from megatron_vshape.schedules.generators.reorder import fill_idle  # noqa: E402
from megatron_vshape.schedules.generators.slot_reorder import slot_schedule  # noqa: E402
from megatron_vshape.schedules.generators.v_schedules import v_block, v_half_block, v_min_block  # noqa: E402
from megatron_vshape.schedules.generators.zero_bubble import GreedyFamily, best_greedy  # noqa: E402

COSTS = {
    "a_equal": Costs(),
    "b_unequal": Costs.parse("f=1,b=1.1,w=0.9,comm=0"),
    "c_unequal_comm": Costs.parse("f=1,b=1.1,w=0.9,comm=0.05"),
}
STAGE_BASE = COSTS["c_unequal_comm"]
SEED = 44


def _head(factor: float):
    return lambda rng, n: [StageWork()] * (n - 1) + [StageWork(factor, factor, factor)]


def _random_25(rng: random.Random, n: int) -> list[StageWork]:
    return [StageWork(x, x, x) for x in (round(rng.uniform(0.75, 1.25), 3) for _ in range(n))]


def _hybrid(rng: random.Random, n: int) -> list[StageWork]:
    return [StageWork(rng.choice((0.7, 1.0, 1.3)), rng.choice((0.8, 1.0, 1.4)), rng.choice((0.5, 1.0, 1.5)))
            for _ in range(n)]


# Per-stage multipliers on STAGE_BASE: (rng, number of stages) -> one StageWork per global stage.
STAGE_SETS = {"head1.5": _head(1.5), "head1.9": _head(1.9), "rand25": _random_25, "hybrid": _hybrid}
ALL_COSTS = (*COSTS, *STAGE_SETS)


def cell_costs(label: str, num_stages: int) -> Costs:
    """The costs of set ``label`` for a pipeline of ``num_stages`` global stages (same draw every run)."""
    if label in COSTS:
        return COSTS[label]
    rng = random.Random(f"{SEED}-{label}-{num_stages}")
    return STAGE_BASE.with_stages(STAGE_SETS[label](rng, num_stages))


def _registry(name: str):
    return lambda d, m, costs: get_schedule(name, d, m, costs)


MEMORY_FACTOR = {"v-zb": 1.0, "zb-1p": 1.0}  # the zero-bubble caps, x 1F1B's peak
# name -> (generator (d, m, costs), building block of d or None)
GENERATORS = {
    "v-min": (_registry("v-min"), v_min_block),
    "v-half": (_registry("v-half"), v_half_block),
    "v-zb": (_registry("v-zb"), None),
    "zb-1p": (_registry("zb-1p"), None),
}
OFFSET_STEPS = (-1, 1, -2, 2, -3, 3, -6, 6)
OFFSETS_SHARE = 0.6  # of the budget; the order search gets the rest


@dataclass
class Row:
    schedule: str
    devices: int
    microbatches: int
    costs: str
    makespan: float
    bubble: float
    peak: float
    best_makespan: float
    best_bubble: float
    best_peak: float
    found_by: str  # the search that found the best schedule ("" when none beat the generator)
    gain: float  # 1 - best / own makespan
    seconds: float
    uniform_gain: float = 0.0  # 1 - uniform-built / own makespan (0 on uniform stages; < 0: ours wins)
    evaluations: int = 0  # schedules the local searches tried


class Budget:
    """A number of schedules tried and, optionally, CPU seconds: spent when either runs out."""

    def __init__(self, seconds: float | None, evaluations: int | None = None) -> None:
        self.seconds, self.evaluations = seconds, evaluations
        self.began, self.tried = time.process_time(), 0

    def count(self) -> None:
        self.tried += 1

    def spent(self) -> bool:
        if self.evaluations is not None and self.tried >= self.evaluations:
            return True
        return self.seconds is not None and time.process_time() - self.began >= self.seconds


def _fits(result: SimulationResult, cap: float) -> bool:
    return result.peak_memory_max <= cap + EPS


class _Best:
    """The best schedule so far of one cell, and which search found it."""

    def __init__(self, schedule: Schedule, result: SimulationResult, cap: float) -> None:
        self.schedule, self.result, self.cap, self.found_by = schedule, result, cap, ""

    def offer(self, schedule: Schedule | None, costs: Costs, by: str) -> None:
        if schedule is None:
            return
        result = simulate(schedule, costs)
        if _fits(result, self.cap) and result.makespan < self.result.makespan - EPS:
            self.schedule, self.result, self.found_by = schedule, result, by


def greedy_at(cap: float, d: int, m: int, costs: Costs, placement=Placement.v_shape) -> Schedule | None:
    family = GreedyFamily("greedy", placement, lambda devices, c: [cap] * devices)
    try:
        return best_greedy(family, d, m, costs)
    except ScheduleError:  # the greedy stalls under this cap
        return None


def _starts(block: BuildingBlock) -> list[list[int]]:
    return [[block.offsets[(Kind.F, c0)], block.offsets[(Kind.F, c1)], block.offsets[(Kind.B, c1)],
             block.offsets[(Kind.B, c0)]] for c0, c1 in block.placement.stages_per_device]


def _block_result(starts, m: int, costs: Costs, cap: float):
    """The block of these starts through the slot reorder (cheap: what the search ranks by), or None
    when it collides, breaks a dependency or needs more than ``cap``."""
    if min(min(s) for s in starts) < 0:  # slots count from 0 (the slot reorder's rows)
        return None, None
    try:
        block = v_block([tuple(s) for s in starts])
        if block.collisions() or max(block.steady_peak()) > cap + EPS:
            return None, None
        schedule = slot_schedule(block, m, "offsets", cap)
        result = None if schedule is None else simulate(schedule, costs)
    except ScheduleError:  # no free slot for a W, a deadlock
        return None, None
    return (block, result) if result is not None and _fits(result, cap) else (None, None)


def offsets_search(block: BuildingBlock, m: int, costs: Costs, cap: float, budget: Budget) -> Schedule | None:
    """First-improvement descent over single offset moves; the best block is then built in full
    (``schedule_from_block``: every reorder the generators have)."""
    current = _starts(block)
    best_block, best = _block_result(current, m, costs, cap)
    if best is None:
        return None
    improved = True
    while improved and not budget.spent():
        improved = False
        moves = ((device, which, step) for device in range(len(current)) for which in range(4) for step in OFFSET_STEPS)
        for device, which, step in moves:
            trial = [list(s) for s in current]
            trial[device][which] += step
            found_block, result = _block_result(trial, m, costs, cap)
            budget.count()
            if result is not None and result.makespan < best.makespan - EPS:
                current, best_block, best, improved = trial, found_block, result, True
                break
            if budget.spent():
                break
    return schedule_from_block(best_block, m, costs, "offsets")


def idle_fill(schedule: Schedule, costs: Costs, cap: float) -> Schedule:
    d = schedule.num_devices
    return fill_idle(schedule, costs, [cap] * d, lookahead=2 * d)[0]


def order_search(schedule: Schedule, costs: Costs, cap: float, budget: Budget) -> Schedule | None:
    """First-improvement descent over moves of one pass ahead in its device's program
    (``generators.local_search``, which the generators run with a small budget on small cells)."""
    found = pull_into_waits(schedule, costs, [cap] * schedule.num_devices, budget)
    return None if found is None else dataclasses.replace(found, name="order", meta={})


def cpsat_search(schedule: Schedule, d: int, m: int, costs: Costs, cap: float, seconds: float) -> Schedule | None:
    from megatron_vshape.schedules.exact import cpsat  # OR-Tools: the test extra
    from megatron_vshape.schedules.exact.problem import build_problem, schedule_from_starts, starts_of

    if not cpsat.solver_available():
        return None
    problem = build_problem(d, m, costs, memory_limit=cap / one_f_one_b_peak(d, costs))  # V placement
    outcome = cpsat.solve(problem, seconds, workers=1, hint=starts_of(problem, schedule))
    return None if outcome.starts is None else schedule_from_starts(problem, outcome.starts, "cp-sat")


def _cap(name: str, d: int, costs: Costs, own: SimulationResult) -> float:
    """The memory a better schedule may use: the generator's peak, and for the zero-bubble families at
    least their own cap (x 1F1B's peak under the stages' memory)."""
    factor = MEMORY_FACTOR.get(name)
    return max(own.peak_memory_max, factor * one_f_one_b_peak(d, costs) if factor is not None else 0.0)


def uniform_built(name: str, d: int, m: int, costs: Costs, cap: float) -> SimulationResult | None:
    """The generator's order for uniform stages timed under ``costs``; None when it needs more than ``cap``
    or when the stages are uniform (it is the generator's own schedule then)."""
    if costs.uniform:
        return None
    try:
        schedule = GENERATORS[name][0](d, m, costs.with_stages(()))
    except ScheduleError:
        return None
    result = simulate(schedule, costs)
    return result if _fits(result, cap) else None


def search_cell(name: str, d: int, m: int, label: str, seconds: float | None = None, cpsat_seconds: float = 0.0,
                cpsat_max_passes: int = 300, evaluations: int | None = 300) -> Row:
    generate, block_of = GENERATORS[name]
    placement = SCHEDULES[name].placement
    costs = cell_costs(label, d * SCHEDULES[name].chunks_per_device())
    began = time.process_time()
    own = generate(d, m, costs)
    own_result = simulate(own, costs)
    cap = _cap(name, d, costs, own_result)
    uniform = uniform_built(name, d, m, costs, cap)
    best = _Best(own, own_result, cap)
    place = Placement.v_shape if placement is PlacementKind.V else Placement.looped
    best.offer(greedy_at(cap, d, m, costs, place), costs, "greedy")
    best.offer(idle_fill(own, costs, cap), costs, "idle-fill")
    tried = 0
    share = None if evaluations is None else round(evaluations * OFFSETS_SHARE)
    if block_of is not None:
        budget = Budget(None if seconds is None else seconds * OFFSETS_SHARE, share)
        offsets = offsets_search(block_of(d), m, costs, cap, budget)
        tried += budget.tried
        best.offer(offsets, costs, "offsets")
        if offsets is not None:
            best.offer(idle_fill(offsets, costs, cap), costs, "offsets+idle-fill")
    else:  # no block: the whole budget goes to the order search
        share = 0
    left = None if seconds is None else max(seconds - (time.process_time() - began), 0.1 * seconds)
    rest = None if evaluations is None else evaluations - share
    budget = Budget(left, rest)
    best.offer(order_search(best.schedule, costs, cap, budget), costs,
               f"{best.found_by}+order" if best.found_by else "order")
    tried += budget.tried
    if placement is PlacementKind.V and 6 * d * m <= cpsat_max_passes and cpsat_seconds > 0:
        best.offer(cpsat_search(best.schedule, d, m, costs, cap, cpsat_seconds), costs, "cp-sat")
    mine, found = own_result, best.result
    uniform_gain = 0.0 if uniform is None else 1.0 - uniform.makespan / mine.makespan
    return Row(name, d, m, label, mine.makespan, mine.bubble_rate, cap, found.makespan, found.bubble_rate,
               found.peak_memory_max, best.found_by, 1.0 - found.makespan / mine.makespan,
               time.process_time() - began, uniform_gain, tried)


def _int_list(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        out.extend(range(int(low), int(high or low) + 1))
    return out


def summary(rows: list[Row], report: float) -> list[str]:
    """Per schedule and cost set: cells, and those where the uniform-built order / a search wins by > report."""
    lines = ["| schedule | costs | cells | uniform-built wins | search wins |", "|---|---|---|---|---|"]
    for name in dict.fromkeys(r.schedule for r in rows):
        for label in dict.fromkeys(r.costs for r in rows):
            group = [r for r in rows if r.schedule == name and r.costs == label]
            if group:
                uniform = "-" if label in COSTS else str(sum(r.uniform_gain > report for r in group))
                lines.append(f"| {name} | {label} | {len(group)} | {uniform} | {sum(r.gain > report for r in group)} |")
    return lines


def markdown(rows: list[Row], report: float) -> str:
    flagged = [r for r in rows if r.gain > report or r.uniform_gain > report]
    searched = sum(r.gain > report for r in rows)
    uniform = sum(r.uniform_gain > report for r in rows)
    lines = [f"{len(rows)} cells: in {searched} a search wins by more than {report:.1%}, in {uniform} the "
             f"uniform-built order ({sum(r.seconds for r in rows):.0f} CPU s, {sum(r.evaluations for r in rows)} "
             f"schedules tried)", "", *summary(rows, report), ""]
    if flagged:
        lines += ["| schedule | d | m | costs | ours: bubble (peak) | search: bubble (peak) | gain | found by | "
                  "uniform-built gain |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r.schedule} | {r.devices} | {r.microbatches} | {r.costs} | {r.bubble:.4f} ({r.peak:g}) | "
                  f"{r.best_bubble:.4f} ({r.best_peak:g}) | {r.gain:.2%} | {r.found_by} | "
                  f"{'-' if r.costs in COSTS else format(r.uniform_gain, '.2%')} |" for r in flagged]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", default="v-min,v-half", help=f"from {','.join(GENERATORS)}")
    parser.add_argument("--devices", default="2-16", help="e.g. 2-16 or 4,6,9")
    parser.add_argument("--factors", default="1,2,4", help="m = factor x d")
    parser.add_argument("--costs", default=",".join(COSTS), help=f"from {','.join(ALL_COSTS)}")
    parser.add_argument("--evaluations", type=int, default=300,
                        help="schedules tried per cell by the local searches (the budget: machine-independent)")
    parser.add_argument("--seconds", type=float, help="also stop the local searches after this many CPU s per cell")
    parser.add_argument("--cpsat-seconds", type=float, default=0.0, help="CP-SAT per cell (a time budget; 0: off)")
    parser.add_argument("--cpsat-max-passes", type=int, default=300, help="6 d m at most (d=5, m=10: 300)")
    parser.add_argument("--report", type=float, default=0.005, help="gain above which a cell is a gap")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", action="store_true", help="print the gap table for docs/schedules.md")
    args = parser.parse_args(argv)
    rows = []
    began = time.perf_counter()
    for d in _int_list(args.devices):
        for factor in _int_list(args.factors):
            for label in args.costs.split(","):
                for name in args.schedules.split(","):
                    row = search_cell(name, d, factor * d, label, args.seconds, args.cpsat_seconds,
                                      args.cpsat_max_passes, args.evaluations)
                    rows.append(row)
                    mark = "  GAP" if row.gain > args.report else ""
                    mark += "  UNIFORM" if row.uniform_gain > args.report else ""
                    print(f"{name:6} d={d:2} m={row.microbatches:3} {label:14} ours {row.bubble:.4f} ({row.peak:g})"
                          f"  search {row.best_bubble:.4f} ({row.best_peak:g}) {row.gain:+.2%} {row.found_by:14}"
                          f" uniform-built {row.uniform_gain:+.2%} {row.seconds:5.1f}s{mark}", flush=True)
    wall = time.perf_counter() - began
    print(f"wall {wall:.0f} s")
    if args.markdown:
        print(markdown(rows, args.report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"wall_s": wall, "report": args.report, "rows": [asdict(r) for r in rows]},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
