"""``vshape optimize``: the exact schedule of one cell by constraint programming (OR-Tools CP-SAT).

    vshape optimize -d 4 -m 8 --memory-limit 0.5 --costs f=1,b=1.1,w=0.9,comm=0.05 --time-limit 60
    vshape optimize -d 3 -m 6 --json
    vshape optimize -d 4 -m 8 --placement looped --memory-limit 1 -o zb.txt   # then: vshape import ...

Prints the best schedule found within ``--time-limit`` (simulated like ``vshape simulate``), the
proven lower bound on its makespan and the gap; ``--json`` prints ``vshape simulate --json``'s
fields plus ``lower_bound``, ``gap`` and ``optimal``. Needs the solver extra:
``pip install -e ".[solver]"``. See docs/optimize.md.
"""

from __future__ import annotations

import json
import sys

from . import cli_inputs
from .cli_parser import OneLineParser, UsageError, _add_costs_and_memory, usage_error
from .schedules.core import inputs
from .schedules.core.schedule import PlacementKind, ScheduleError, parse_stage_work
from .schedules.exact import optimize
from .schedules.exact.problem import MAX_MEMORY_LIMIT
from .schedules.export.render_text import text_grid

_MAX_CELL_PASSES = 20_000  # a model this size takes minutes to build; the solver is for small cells


def _parser() -> OneLineParser:
    parser = OneLineParser(prog="vshape optimize", description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", "-d", type=int, required=True, metavar="D", help="pipeline devices")
    parser.add_argument("--microbatches", "-m", type=int, required=True, metavar="M", help="microbatches")
    parser.add_argument("--placement", choices=("v", "looped"), default="v",
                        help="v: device i holds stages i and 2D-1-i (default); looped: one stage per device (ZB's)")
    parser.add_argument("--memory-limit", type=float, default=1.0, metavar="X",
                        help="activation memory cap per device, x 1F1B's peak, as for v-auto (default 1)")
    parser.add_argument("--time-limit", type=float, default=60.0, metavar="S", help="solver seconds (default 60)")
    parser.add_argument("--workers", type=int, default=2, metavar="N", help="solver threads (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="solver random seed (default 0)")
    parser.add_argument("--stage-costs", dest="optimize_stage_costs", default=None, metavar="f=2,1,1,2;memory=...",
                        help="per-stage multipliers, one per stage (V: 2D, looped: D), as for vshape simulate")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    parser.add_argument("--grid", action="store_true", help="also print the text grid of the timeline")
    parser.add_argument("-o", "--output", default=None, metavar="FILE",
                        help="also write the schedule as text (read back with vshape import --format text)")
    _add_costs_and_memory(parser)
    return parser


def _request(args):
    inputs.count("--stages", args.stages, 1, 64)
    inputs.count("--microbatches", args.microbatches, 1, 1024)
    placement = PlacementKind.V if args.placement == "v" else PlacementKind.LOOPED
    num_stages = args.stages * (2 if placement is PlacementKind.V else 1)
    if 3 * num_stages * args.microbatches > _MAX_CELL_PASSES:
        raise UsageError(f"--microbatches: {3 * num_stages * args.microbatches:,} passes is too large for the exact "
                         f"solver (at most {_MAX_CELL_PASSES:,}); use vshape simulate -s v-auto for this size")
    limit = inputs.real("--memory-limit", args.memory_limit, 0.0, MAX_MEMORY_LIMIT, low_open=True)
    inputs.real("--time-limit", args.time_limit, 0.0, 86400.0, low_open=True)
    inputs.count("--workers", args.workers, 1, 256)
    costs = cli_inputs.costs_of(args)
    if args.optimize_stage_costs is not None:
        costs = costs.with_stages(parse_stage_work(args.optimize_stage_costs, num_stages))
    return placement, limit, costs, cli_inputs.memory_model_of(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = _parser().parse_args(argv)
        placement, limit, costs, memory = _request(args)
        found = optimize(args.stages, args.microbatches, costs, placement, limit, memory,
                         args.time_limit, args.workers, args.seed)
    except (UsageError, ScheduleError, ValueError) as exc:
        return usage_error(exc)
    if args.output:
        with open(args.output, "w") as out:
            out.write(found.schedule.to_text() + "\n")
    if args.json:
        print(json.dumps(found.to_json()))
        return 0
    _summary(found, args)
    return 0


def _summary(found, args) -> None:
    result = found.result
    costs = result.costs
    proof = "optimal (proven)" if found.optimal else f"best found in {args.time_limit:g} s ({found.status})"
    print(f"schedule      optimal ({result.schedule.placement.kind.value} placement, "
          f"{result.schedule.num_stages} stages on {result.schedule.num_devices} devices)")
    print(f"microbatches  {result.schedule.num_microbatches}")
    print(f"costs         f={costs.f:g} b={costs.b:g} w={costs.w:g} comm={costs.comm:g}")
    print(f"memory limit  {args.memory_limit:g} x 1F1B's peak = {result.schedule.meta['memory_limit_units']:g} units")
    print(f"makespan      {result.makespan:g}   (work per device {result.work_per_device:g})")
    print(f"lower bound   {found.lower_bound:g}   gap {found.gap:.2%}   {proof}")
    if not found.exact_time:
        print("              (pass times were rounded down to integers for the solver: the bound holds, "
              "the optimality proof is for the rounded times)")
    print(f"bubble rate   {result.bubble_rate:.4f}   ({result.bubble_rate:.1%})")
    peaks = " ".join(f"{p:g}" for p in result.peak_memory)
    print(f"peak memory   max {result.peak_memory_max:g}   per device: {peaks}")
    print(f"warm start    {found.warm_start or 'none fits the cap'}   solver {found.wall_s:.1f} s")
    print("validated:    ok")
    if args.grid:
        print()
        print(text_grid(result))


if __name__ == "__main__":
    sys.exit(main())
