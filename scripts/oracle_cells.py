"""Solve the oracle tier's cells exactly and write them as the test fixture (or print a table).

    python scripts/oracle_cells.py --time-limit 60 -o tests/fixtures/oracle_cells.json
    python scripts/oracle_cells.py --devices 2,3 --time-limit 10          # a table only

For every cell (devices d, microbatches m in {d, 2d}, each cost setting) and every heuristic of the
tier (V-Min, V-Half, V-ZB on the V placement; ZB-1P on the looped one) the solver runs at that
heuristic's own peak memory (its measured peak as a fraction of 1F1B's), so "optimal" means: the
lowest makespan any schedule reaches with no more memory than the heuristic uses. Each record keeps
the solver's schedule (text), its makespan, the proven bound and whether it is optimal; the tests
(tests/test_optimize_oracle.py) compare the heuristics with these records and re-prove a few live.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_vshape.schedules.core.schedule import (
    Costs,
    PlacementKind,
    looped_stage_work,  # noqa: E402
)
from megatron_vshape.schedules.core.simulator import simulate  # noqa: E402
from megatron_vshape.schedules.exact import optimize  # noqa: E402
from megatron_vshape.schedules.exact.oracle import COST_SETTINGS, HEURISTICS, TOLERANCE, heuristic_limit
from megatron_vshape.schedules.generators.registry import get_schedule

_SOLVED: dict = {}


def solve_cell(d: int, m: int, label: str, costs: Costs, heuristic: str, time_limit: float, workers: int) -> dict:
    placement = PlacementKind.LOOPED if heuristic.startswith("zb") else PlacementKind.V
    if placement is PlacementKind.LOOPED and costs.stages:  # the same model cut into d looped stages
        costs = costs.with_stages(looped_stage_work(costs, d))
    schedule = get_schedule(heuristic, d, m, costs)
    result = simulate(schedule, costs)
    limit = heuristic_limit(result, d, costs)
    began, cpu = time.perf_counter(), time.process_time()
    key = (d, m, costs, placement, round(limit, 9))
    if key not in _SOLVED:  # V-Min and V-Half often use the same memory at small m: solve once
        _SOLVED[key] = optimize(d, m, costs, placement, limit, time_limit=time_limit, workers=workers)
    found = _SOLVED[key]
    return {
        "devices": d, "microbatches": m, "costs": label, "heuristic": heuristic, "memory_limit": limit,
        "heuristic_makespan": result.makespan, "heuristic_bubble": result.bubble_rate,
        "makespan": found.result.makespan, "bubble": found.result.bubble_rate, "lower_bound": found.lower_bound,
        "optimal": found.optimal, "gap": found.gap, "wall_s": round(time.perf_counter() - began, 2),
        "cpu_s": round(time.process_time() - cpu, 2),
        "schedule": found.schedule.to_text(),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="2,3,4")
    parser.add_argument("--costs", default=",".join(COST_SETTINGS), help="cost settings by label")
    parser.add_argument("--heuristics", default=",".join(HEURISTICS))
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("-o", "--output", default=None, help="JSON fixture to write")
    parser.add_argument("--cache", default=None, metavar="FILE",
                        help="also write the V cells where the solver beats v-auto (by more than the tolerance where "
                             "proven, at all where not) as v-auto's cache (megatron_vshape/schedules/generators/solved_cells.json)")
    parser.add_argument("--keep", default=None, metavar="FILE",
                        help="a fixture whose proven cells are kept as they are (only the others are solved again)")
    args = parser.parse_args(argv)
    kept = {}
    if args.keep:
        for cell in json.loads(Path(args.keep).read_text())["cells"]:
            if cell["optimal"]:
                kept[(cell["devices"], cell["microbatches"], cell["costs"], cell["heuristic"])] = cell
    records = []
    for d in map(int, args.devices.split(",")):
        for m in (d, 2 * d):
            for label in args.costs.split(","):
                costs = COST_SETTINGS[label](d)
                for heuristic in args.heuristics.split(","):
                    record = kept.get((d, m, label, heuristic)) or solve_cell(
                        d, m, label, costs, heuristic, args.time_limit, args.workers)
                    records.append(record)
                    print(f"d={d} m={m:<2} {label:<8} {heuristic:<6} limit {record['memory_limit']:.3f}  "
                          f"heuristic {record['heuristic_makespan']:8.3f}  solver {record['makespan']:8.3f}  "
                          f"bound {record['lower_bound']:8.3f}  {'optimal' if record['optimal'] else 'gap %.2f%%' % (100 * record['gap'])}"
                          f"  {record['wall_s']:6.1f} s", flush=True)
                    if args.output:
                        Path(args.output).write_text(json.dumps({"time_limit": args.time_limit,
                                                                 "workers": args.workers, "cells": records}, indent=1) + "\n")
    if args.cache:
        write_cache(records, args.cache)
    return 0


def write_cache(records: list[dict], path: str) -> None:
    """The V cells whose solved schedule v-auto (its own candidates) does not reach."""
    from megatron_vshape.schedules.generators.adaptive import choose
    from megatron_vshape.schedules.generators.solved import SolvedCell, cell_to_json

    cells = []
    for r in records:
        if r["heuristic"] not in ("v-min", "v-half", "v-zb") or r["memory_limit"] > 1:
            continue
        costs = COST_SETTINGS[r["costs"]](r["devices"])
        own = simulate(choose(r["devices"], r["microbatches"], costs, r["memory_limit"]).schedule, costs).makespan
        if (r["makespan"] * (1 + TOLERANCE) < own) if r["optimal"] else (r["makespan"] < own - 1e-9):
            cells.append(cell_to_json(SolvedCell(r["devices"], r["microbatches"], costs, PlacementKind.V,
                                                 r["memory_limit"], r["makespan"], r["lower_bound"], r["optimal"],
                                                 r["schedule"])))
            print(f"cache: d={r['devices']} m={r['microbatches']} {r['costs']} at {r['heuristic']}'s memory: "
                  f"v-auto {own:g} -> solved {r['makespan']:g}")
    unique = {json.dumps(c, sort_keys=True): c for c in cells}  # V-Min and V-Half may share a cell
    Path(path).write_text(json.dumps({"source": "scripts/oracle_cells.py --cache", "cells": list(unique.values())},
                                     indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
