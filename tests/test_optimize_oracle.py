"""The oracle tier: the exact optimum of small cells against the heuristics, at each heuristic's memory.

Cells: d = 2, 3, 4; m = d, 2d; the authors' three cost settings and random per-stage costs; the
memory of V-Min, V-Half, V-ZB (V placement) and ZB-1P (looped). The solver's results are cached in
tests/fixtures/oracle_cells.json (scripts/oracle_cells.py writes it; proving all takes minutes); a few
small cells are proved again live. Where the optimum is proven, our schedule for that memory (v-auto
at that limit; ZB-1P on the looped placement) is within ``TOLERANCE`` of it, and no heuristic beats it;
where only bounded, ours is no worse than the solver's best. v-auto reaches the optimum in some cells
only through the solved-schedule cache (exact/solved_cells.json): test_cells_that_need_the_cache lists them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _solver_support import need_solver

from megatron_vshape.schedules.core.schedule import (
    Placement,
    PlacementKind,
    Schedule,
    looped_stage_work,
    one_f_one_b_peak,
)
from megatron_vshape.schedules.core.simulator import simulate
from megatron_vshape.schedules.exact import optimize
from megatron_vshape.schedules.exact.oracle import COST_SETTINGS, HEURISTICS, TOLERANCE
from megatron_vshape.schedules.generators.adaptive import choose, v_auto
from megatron_vshape.schedules.generators.registry import get_schedule
from megatron_vshape.schedules.generators.solved import solved_cells
from megatron_vshape.schedules.lowering.messages import lower
from megatron_vshape.schedules.lowering.nccl_model import check_exchange
from megatron_vshape.schedules.lowering.validator import validate

# The solver's tier (CP-SAT, seconds per cell): out of the fast inner loop, in the README's test command.
pytestmark = pytest.mark.slow

FIXTURE = Path(__file__).parent / "fixtures" / "oracle_cells.json"
CELLS = json.loads(FIXTURE.read_text())["cells"]
EPS = 1e-9


def _looped(record) -> bool:
    return record["heuristic"].startswith("zb")


def _costs(record):
    costs = COST_SETTINGS[record["costs"]](record["devices"])
    if _looped(record) and costs.stages:
        costs = costs.with_stages(looped_stage_work(costs, record["devices"]))
    return costs


def _cap(record) -> float:
    return record["memory_limit"] * one_f_one_b_peak(record["devices"], _costs(record)) + EPS


def _ours(record) -> float:
    """Our schedule's makespan at the cell's memory: v-auto at that limit (V), ZB-1P (looped)."""
    d, m, costs = record["devices"], record["microbatches"], _costs(record)
    schedule = get_schedule("zb-1p", d, m, costs) if _looped(record) else v_auto(d, m, costs, record["memory_limit"])
    result = simulate(schedule, costs)
    assert result.peak_memory_max <= _cap(record)
    return result.makespan


def _label(record) -> str:
    return f"d={record['devices']} m={record['microbatches']} {record['costs']} at {record['heuristic']}'s memory"


def test_the_tier_covers_every_cell_and_heuristic():
    cells = {(r["devices"], r["microbatches"], r["costs"], r["heuristic"]) for r in CELLS}
    assert cells == {(d, m, c, h) for d in (2, 3, 4) for m in (d, 2 * d) for c in COST_SETTINGS for h in HEURISTICS}


def test_the_cached_solver_schedules_are_real():
    """Each cached schedule validates, and simulates to its recorded makespan within its cap."""
    for record in CELLS:
        d = record["devices"]
        placement = Placement.looped(d) if _looped(record) else Placement.v_shape(d)
        schedule = Schedule.from_text(record["schedule"], "optimal", placement)
        validate(schedule)
        result = simulate(schedule, _costs(record))
        assert result.makespan == pytest.approx(record["makespan"]), _label(record)
        assert result.peak_memory_max <= _cap(record), _label(record)
        assert record["lower_bound"] <= record["makespan"] + EPS


def test_the_models_memory_precedences_hold_on_every_known_schedule():
    """The redundant precedences the cap implies (cpsat.memory_precedences, posted in every model)
    cut off no schedule the tier knows: each solver schedule and each V heuristic at its cell's cap.
    A cut that removed a feasible schedule would make the solver's "optimal" wrong."""
    from megatron_vshape.schedules.exact import build_problem
    from megatron_vshape.schedules.exact.cpsat import memory_precedences
    from megatron_vshape.schedules.exact.problem import starts_of

    checked = 0
    for record in CELLS:
        if _looped(record):
            continue
        d, m, costs = record["devices"], record["microbatches"], _costs(record)
        problem = build_problem(d, m, costs, PlacementKind.V, record["memory_limit"])
        schedules = [Schedule.from_text(record["schedule"], "optimal", Placement.v_shape(d))]
        schedules += [get_schedule(name, d, m, costs) for name in ("v-min", "v-half", "v-zb")]
        for schedule in schedules:
            if simulate(schedule, costs).peak_memory_max > _cap(record):
                continue
            starts = starts_of(problem, schedule)
            for device in range(d):
                for before, after in memory_precedences(problem, device):
                    assert starts[after] >= starts[before] + problem.duration[before], (_label(record), schedule.name)
                    checked += 1
    assert checked > 1000


def test_the_solver_schedules_cannot_hang_under_nccls_rules():
    """The GPU rule's CPU model (schedules.nccl_model): the runtime's p2p programs for each solved
    schedule complete under NCCL's lazy communicators and in-order queues, one queue or one per stream."""
    for record in CELLS:
        d = record["devices"]
        placement = Placement.looped(d) if _looped(record) else Placement.v_shape(d)
        check_exchange(lower(Schedule.from_text(record["schedule"], "optimal", placement)), single_queue=(True, False))


def test_no_heuristic_beats_a_proven_optimum():
    """The proofs checked against every generator that fits the same memory."""
    for record in (r for r in CELLS if r["optimal"]):
        d, m, costs = record["devices"], record["microbatches"], _costs(record)
        names = ("zb-h1", "zb-1p", "zb-2p", "1f1b") if _looped(record) else ("v-min", "v-half", "v-zb")
        for name in names:
            result = simulate(get_schedule(name, d, m, costs), costs)
            if result.peak_memory_max <= _cap(record):
                assert result.makespan >= record["makespan"] - EPS, (name, _label(record))


def test_where_proven_ours_is_within_tolerance_of_the_optimum():
    misses = []
    for record in (r for r in CELLS if r["optimal"]):
        ours = _ours(record)
        assert ours >= record["makespan"] - EPS, _label(record)
        if ours > record["makespan"] * (1 + TOLERANCE):
            misses.append(f"{_label(record)}: ours {ours:g}, optimum {record['makespan']:g}")
    assert not misses, misses


def test_where_only_bounded_ours_is_no_worse_than_the_solvers_best():
    for record in (r for r in CELLS if not r["optimal"]):
        ours = _ours(record)
        assert ours <= record["makespan"] + EPS, _label(record)
        gap = (ours - record["lower_bound"]) / ours
        print(f"{_label(record)}: ours {ours:g}, solver {record['makespan']:g}, bound {record['lower_bound']:g}, "
              f"gap of ours {gap:.1%}")


def test_cells_that_need_the_cache():
    """The V cells where v-auto's own candidates miss the solver's schedule: exactly the cached ones."""
    needed, labels = set(), []
    for record in (r for r in CELLS if not _looped(r) and r["memory_limit"] <= 1):
        d, m, costs = record["devices"], record["microbatches"], _costs(record)
        own = simulate(choose(d, m, costs, record["memory_limit"]).schedule, costs).makespan
        if (record["makespan"] * (1 + TOLERANCE) < own) if record["optimal"] else (record["makespan"] < own - EPS):
            needed.add((d, m, costs, round(record["memory_limit"], 6)))
            labels.append(f"{_label(record)}: v-auto's own {own:g}, solved {record['makespan']:g}")
    cached = {(c.num_devices, c.num_microbatches, c.costs, round(c.memory_limit, 6)) for c in solved_cells()}
    assert needed <= cached
    print("v-auto takes the solved schedule:", *labels, sep="\n  ")


# Proved again live: the small cells (each well under a second of solver time on an idle core).
LIVE = [r for r in CELLS if r["optimal"] and (r["devices"], r["microbatches"]) in ((2, 2), (2, 4), (3, 3))
        and r["costs"] in ("b_unequal", "d_random_stages")]


@pytest.mark.parametrize("record", LIVE, ids=_label)
def test_live_proof_matches_the_fixture(record):
    need_solver()
    placement = PlacementKind.LOOPED if _looped(record) else PlacementKind.V
    found = optimize(record["devices"], record["microbatches"], _costs(record), placement,
                     record["memory_limit"], time_limit=60)
    assert found.optimal
    assert found.result.makespan == pytest.approx(record["makespan"])
