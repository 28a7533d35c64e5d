#!/usr/bin/env python
"""Time generation, simulation and validation of every registered schedule.

    python scripts/bench_schedules.py                      # d=64, m=512
    python scripts/bench_schedules.py --stages 8 --microbatches 32 --json out/bench.json
    python scripts/bench_schedules.py --only v-half v-zb

Prints a table (seconds per phase; "gen+sim" is what the 2 s target applies to) and, with
--json, writes the same numbers plus bubble rate and peak memory per schedule. "cpu" is the
process CPU time of gen+sim: on a shared machine the wall time also counts other jobs' load
(shown in the header), so the SLOW flag goes by CPU time.

    python scripts/bench_schedules.py --costs f=1,b=1.1,w=0.9,comm=0.05
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_vshape.schedules.core.schedule import Costs, ScheduleError
from megatron_vshape.schedules.core.simulator import simulate
from megatron_vshape.schedules.generators.registry import SCHEDULES, get_schedule
from megatron_vshape.schedules.lowering.validator import validate

TARGET_S = 2.0


def bench_one(name: str, stages: int, microbatches: int, costs: Costs, chunks: int, check: bool = True) -> dict:
    row: dict = {"schedule": name, "stages": stages, "microbatches": microbatches}
    minimum = SCHEDULES[name].min_microbatches(stages)
    if microbatches < minimum:
        row["error"] = f"needs at least {minimum} microbatches"
        return row
    try:
        c0 = time.process_time()
        t0 = time.perf_counter()
        schedule = get_schedule(name, stages, microbatches, costs, chunks=chunks)
        t1 = time.perf_counter()
        result = simulate(schedule, costs)
        t2 = time.perf_counter()
        cpu = time.process_time() - c0
        if check:
            validate(schedule)
        t3 = time.perf_counter()
    except ScheduleError as exc:
        row["error"] = str(exc)
        return row
    row.update(
        generate_s=t1 - t0,
        simulate_s=t2 - t1,
        validate_s=t3 - t2,
        gen_sim_s=t2 - t0,
        gen_sim_cpu_s=cpu,
        within_target=cpu < TARGET_S,
        actions=sum(len(p) for p in schedule.programs),
        bubble_rate=result.bubble_rate,
        peak_memory_max=result.peak_memory_max,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", "-d", type=int, default=64)
    parser.add_argument("--microbatches", "-m", type=int, default=512)
    parser.add_argument("--costs", default="f=1,b=1,w=1,comm=0",
                        help="pass costs, e.g. f=1,b=1.1,w=0.9,comm=0.05 (default: equal, no comm)")
    parser.add_argument("--chunks", type=int, default=2, help="for interleaved-1f1b")
    parser.add_argument("--skip-validate", action="store_true", help="time generation and simulation only")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="benchmark only these schedules")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    args = parser.parse_args(argv)
    try:
        costs = Costs.parse(args.costs)
    except ValueError as exc:
        parser.error(str(exc))
    names = args.only or list(SCHEDULES)
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown:
        parser.error(f"--only: unknown schedules {unknown}; choose from {list(SCHEDULES)}")

    header = f"{'schedule':<18}{'generate':>10}{'simulate':>10}{'validate':>10}{'gen+sim':>10}{'cpu':>8}  {'bubble':>8}{'peak':>8}"
    load = "load average {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()) if hasattr(os, "getloadavg") else ""
    print(f"d={args.stages} m={args.microbatches} costs={args.costs}  (seconds; target gen+sim < {TARGET_S:g} s "
          f"CPU; {load} on {os.cpu_count()} cores)")
    print(header)
    print("-" * len(header))
    rows = []
    for name in names:
        row = bench_one(name, args.stages, args.microbatches, costs, args.chunks, not args.skip_validate)
        rows.append(row)
        if "error" in row:
            print(f"{name:<18}  error: {row['error']}")
        else:
            flag = "" if row["within_target"] else "  SLOW"
            print(f"{name:<18}{row['generate_s']:>10.3f}{row['simulate_s']:>10.3f}{row['validate_s']:>10.3f}"
                  f"{row['gen_sim_s']:>10.3f}{row['gen_sim_cpu_s']:>8.3f}  {row['bubble_rate']:>8.4f}{row['peak_memory_max']:>8.3g}{flag}",
                  flush=True)
    if args.json:
        out = {
            "stages": args.stages,
            "microbatches": args.microbatches,
            "costs": args.costs,
            "target_gen_sim_s": TARGET_S,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "results": rows,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
