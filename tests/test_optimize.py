"""`vshape optimize`: the exact schedule by CP-SAT, proved live on cells small enough for CI.

The oracle tier (the cached cells, compared with the heuristics) is tests/test_optimize_oracle.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _solver_support import need_solver

from megatron_vshape.schedules.core.schedule import Costs, PlacementKind, ScheduleError, one_f_one_b_peak
from megatron_vshape.schedules.core.simulator import simulate
from megatron_vshape.schedules.exact import build_problem, optimize
from megatron_vshape.schedules.exact import optimum as optimize_module
from megatron_vshape.schedules.exact.problem import makespan_of, starts_of
from megatron_vshape.schedules.generators.block_schedule import schedule_from_block
from megatron_vshape.schedules.generators.registry import get_schedule
from megatron_vshape.schedules.generators.v_schedules import v_min_block
from megatron_vshape.schedules.lowering.validator import validate

# The solver's tier (CP-SAT, seconds per cell): out of the fast inner loop, in the README's test command.
pytestmark = pytest.mark.slow

UNEQUAL = Costs.parse("f=1,b=1.1,w=0.9,comm=0.05")


def test_no_module_imports_the_solver_at_import_time():
    code = ("import sys, megatron_vshape.cli, megatron_vshape.optimize_cli, megatron_vshape.schedules.exact;"
            "print('ortools' in ' '.join(sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_without_the_solver_optimize_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(optimize_module.cpsat, "solver_available", lambda: False)
    with pytest.raises(ScheduleError, match=r"pip install -e \"\.\[solver\]\""):
        optimize(2, 2)


def test_problem_integer_times_and_origins_follow_the_costs():
    problem = build_problem(4, 8, UNEQUAL, memory_limit=0.5)
    assert problem.scale == 20 and problem.exact_time  # f=1, b=1.1, w=0.9, comm=0.05 in twentieths
    # Device i starts when F of stages 0..i-1 and i hops have passed: i x (f + comm).
    assert problem.origin == (0, 21, 42, 63)
    assert problem.cap == pytest.approx(0.5 * one_f_one_b_peak(4, UNEQUAL))
    # A heuristic's timeline in integer units is the simulator's, scaled.
    schedule = get_schedule("v-half", 4, 8, UNEQUAL)
    starts = starts_of(problem, schedule)
    assert makespan_of(problem, starts) == round(simulate(schedule, UNEQUAL).makespan * problem.scale)


def test_inexact_costs_round_down_so_the_bound_still_holds():
    problem = build_problem(2, 2, Costs.parse("f=1,b=1.0001,w=1,comm=0"))
    assert not problem.exact_time and problem.scale == 100


@pytest.mark.parametrize("d,m,costs,heuristic", [
    (2, 4, Costs(), "v-min"),
    (2, 4, Costs.parse("f=1,b=1.1,w=0.9,comm=0"), "v-min"),
    (3, 3, UNEQUAL, "v-half"),
    (4, 4, UNEQUAL, "v-min"),
])
def test_proves_small_cells_and_meets_every_heuristic_within_its_memory(d, m, costs, heuristic):
    need_solver()
    reference = simulate(get_schedule(heuristic, d, m, costs), costs)
    limit = reference.peak_memory_max / one_f_one_b_peak(d, costs)
    found = optimize(d, m, costs, memory_limit=limit, time_limit=60)
    assert found.optimal and found.gap == 0.0
    validate(found.schedule)
    again = simulate(found.schedule, costs)
    assert again.makespan == pytest.approx(found.lower_bound)  # the simulated makespan is the proven one
    assert again.peak_memory_max <= reference.peak_memory_max + 1e-9
    for name in ("v-min", "v-half", "v-zb"):
        result = simulate(get_schedule(name, d, m, costs), costs)
        if result.peak_memory_max <= reference.peak_memory_max + 1e-9:
            assert found.result.makespan <= result.makespan + 1e-9, name


def test_the_bisection_prover_alone_closes_a_small_cell():
    # The prover ("a schedule within T?" tests) without the improving search: from the heuristic's
    # schedule and the chain bound it must reach the optimum that the full solve proves.
    need_solver()
    import time

    from megatron_vshape.schedules.exact import cpsat
    from megatron_vshape.schedules.exact.optimum import warm_start

    costs = UNEQUAL
    limit = simulate(get_schedule("v-half", 3, 3, costs), costs).peak_memory_max / one_f_one_b_peak(3, costs)
    problem = build_problem(3, 3, costs, memory_limit=limit)
    _, hint = warm_start(problem)
    search = cpsat._Search(problem, hint, problem.lower_bound(), time.perf_counter(), 60.0)
    cpsat._bisect(search, seed=0)
    full = optimize(3, 3, costs, memory_limit=limit, time_limit=60)
    assert full.optimal and search.closed()
    assert search.upper == round(full.result.makespan * problem.scale)


@pytest.mark.parametrize("workers", [1, 2])
def test_one_and_two_workers_prove_the_same_optimum(workers):
    # One worker: improver, then prover; two: both at once (the prover stops the improver).
    need_solver()
    found = optimize(3, 3, UNEQUAL, memory_limit=0.5, time_limit=60, workers=workers)
    assert found.optimal and found.gap == 0.0
    assert found.result.makespan == pytest.approx(
        optimize(3, 3, UNEQUAL, memory_limit=0.5, time_limit=60, workers=3 - workers).result.makespan)


def test_beats_v_min_where_the_optimum_is_known_by_the_work_bound():
    # d=2, m=4 at 1F1B's memory: the optimum is the work itself (no bubble), which the V-Min block misses.
    need_solver()
    found = optimize(2, 4, Costs(), memory_limit=1.0, time_limit=60)
    assert found.result.makespan == pytest.approx(found.result.work_per_device)
    block = schedule_from_block(v_min_block(2), 4, Costs(), "v-min block")
    assert simulate(block, Costs()).makespan > found.result.makespan


def test_looped_placement_at_zb1p_memory():
    need_solver()
    found = optimize(3, 3, UNEQUAL, PlacementKind.LOOPED, memory_limit=1.0, time_limit=60)
    assert found.optimal and found.schedule.placement.kind is PlacementKind.LOOPED
    zb1p = simulate(get_schedule("zb-1p", 3, 3, UNEQUAL), UNEQUAL)
    assert found.result.makespan <= zb1p.makespan + 1e-9


def test_a_cap_below_one_activation_is_infeasible():
    need_solver()
    with pytest.raises(ScheduleError, match="no schedule fits the memory cap"):
        optimize(2, 2, memory_limit=0.1, time_limit=10)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "megatron_vshape.cli", "optimize", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_json_has_simulate_fields_plus_bound_and_gap(tmp_path):
    need_solver()
    out = tmp_path / "opt.txt"
    done = _cli("-d", "2", "-m", "4", "--costs", "f=1,b=1.1,w=0.9,comm=0.05", "--memory-limit", "0.75",
                "--time-limit", "30", "--json", "-o", str(out))
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    simulate_keys = json.loads(subprocess.run(
        [sys.executable, "-m", "megatron_vshape.cli", "simulate", "-s", "v-half", "-d", "2", "-m", "4", "--json"],
        capture_output=True, text=True, check=True).stdout).keys()
    assert set(simulate_keys) <= set(record)
    assert record["w_order_kept"] is True  # W in B's order per stage (TE's deferred-W FIFO): the symmetry cut
    assert record["gap"] == 0.0 and record["lower_bound"] == pytest.approx(record["makespan"])
    # The written schedule reads back through vshape import with the same makespan.
    back = subprocess.run([sys.executable, "-m", "megatron_vshape.cli", "import", "--format", "text", str(out),
                           "--placement", "v", "--costs", "f=1,b=1.1,w=0.9,comm=0.05", "--json"],
                          capture_output=True, text=True, check=True)
    assert json.loads(back.stdout)["makespan"] == pytest.approx(record["makespan"])


@pytest.mark.parametrize("args,flag", [
    (["-d", "2", "-m", "2", "--memory-limit", "0"], "--memory-limit"),
    (["-d", "2", "-m", "2", "--time-limit", "-1"], "--time-limit"),
    (["-d", "0", "-m", "2"], "--stages"),
    (["-d", "16", "-m", "512"], "--microbatches"),
])
def test_cli_bad_input_is_one_line_naming_the_flag(args, flag):
    done = _cli(*args)
    assert done.returncode == 2 and flag in done.stderr and len(done.stderr.strip().splitlines()) == 1
