"""``vshape``: list, simulate, plot, export and import pipeline schedules.

Examples::

    vshape list
    vshape simulate --schedule v-half --stages 4 --microbatches 8 --grid
    vshape simulate --schedule v-zb --stages 8 --microbatches 32 --costs f=1,b=1.1,w=0.9,comm=0.05 --json
    vshape simulate --schedule v-half --stages 2 --microbatches 8 --stage-costs "time=2,1,1,2;memory=1,1,1,3"
    vshape plot --schedule v-half --stages 4 --microbatches 8 -o v-half.png
    vshape export --schedule v-min --stages 4 --microbatches 8 --format torch-csv -o v-min.csv
    vshape import --format torch-csv v-min.csv --stages 4 --placement v

Bad input ends with one line on stderr (which flag, how to fix it) and exit status 2.
Everything here is pure Python; ``plot`` needs matplotlib.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from .progress import phase
from .schedules import (
    SCHEDULES,
    Costs,
    MemoryModel,
    Placement,
    Schedule,
    ScheduleError,
    get_schedule,
    inputs,
    parse_stage_work,
    schedule_names,
    simulate,
    validate,
)
from .schedules.render_text import text_grid

EXPORT_FORMATS = ("torch-csv", "chrome-trace", "text", "grid", "json")
IMPORT_FORMATS = ("torch-csv", "text")


class UsageError(Exception):
    """Bad command-line input: reported as one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump) and never a traceback."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


_Parser = OneLineParser


def usage_error(problem) -> int:
    """Print ``vshape: error: <problem on one line>`` to stderr; the exit status 2 (every subcommand)."""
    print(f"vshape: error: {_one_line(problem)}", file=sys.stderr)
    return 2


def _add_selection(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--schedule", "-s", required=True, metavar="NAME",
                        help="schedule name (see `vshape list`)")
    parser.add_argument("--stages", "-d", type=int, required=True, metavar="D", help="pipeline devices")
    parser.add_argument("--microbatches", "-m", type=int, required=True, metavar="M", help="microbatches")
    parser.add_argument("--chunks", "-v", type=int, default=2, metavar="V",
                        help="model chunks per device for interleaved-1f1b (default 2)")
    parser.add_argument("--memory-limit", type=float, default=None, metavar="X",
                        help="activation memory limit, for schedules that take one (e.g. v-auto)")
    _add_costs_and_memory(parser)


def _add_costs_and_memory(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--costs", default=None, metavar="f=1,b=1,w=1,comm=0",
                        help="pass times of one V chunk and the p2p time (default all 1, comm 0)")
    parser.add_argument("--costs-from", default=None, metavar="FILE",
                        help="read the costs from a JSON file with keys f, b, w, comm (what training writes "
                             "with --pipeline-costs auto --pipeline-costs-out FILE)")
    parser.add_argument("--memory-model", choices=("simple", "gpt"), default="simple",
                        help="simple: W frees all of F's activations; gpt: B frees part (needs --hidden, "
                             "--heads, --seq)")
    parser.add_argument("--hidden", type=int, metavar="H", help="hidden size (gpt memory model)")
    parser.add_argument("--heads", type=int, metavar="A", help="attention heads (gpt memory model)")
    parser.add_argument("--seq", type=int, metavar="S", help="sequence length (gpt memory model)")


def _add_output_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    parser.add_argument("--grid", action="store_true", help="also print the text grid of the timeline")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vshape", description="Controllable-memory pipeline schedules: list, simulate, "
                                                "plot, export, import, plan, verify.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    sub.add_parser("list", help="schedules with a one-line description")
    for name, (_, help_text) in _DELEGATED.items():  # listed in --help; main() dispatches them first
        sub.add_parser(name, help=help_text + f" (see `vshape {name} --help`)", add_help=False)

    simulate_p = sub.add_parser("simulate", help="validate and simulate a schedule, print a summary")
    _add_selection(simulate_p)
    _add_output_flags(simulate_p)
    simulate_p.add_argument(
        "--stage-costs", default=None, metavar="f=2,1,1,2;memory=1,1,1,3",
        help="per-stage multipliers of the --costs times and of activation memory, one value per stage in "
             "global stage order (V: 2d stages, stage 2d-1-i on device i; looped: d, interleaved: d x chunks); "
             "groups f=, b=, w=, memory= or time= (f, b and w together) separated by ';'; omitted keys stay 1")

    plot_p = sub.add_parser("plot", help="draw a schedule (PNG, SVG or PDF)")
    _add_selection(plot_p)
    plot_p.add_argument("-o", "--output", required=True, metavar="FILE", help="picture to write (.png/.svg/.pdf)")
    plot_p.add_argument("--memory", nargs="?", const=True, default=None, metavar="FILE",
                        help="draw activation memory over time: into -o alone, or with FILE into FILE "
                             "in addition to the schedule picture")
    plot_p.add_argument("--title", default=None, help="picture title (default: name, sizes, bubble, memory)")

    export_p = sub.add_parser("export", help="write a schedule as torch CSV, chrome trace, text or grid")
    _add_selection(export_p)
    export_p.add_argument("--format", "-f", required=True, choices=EXPORT_FORMATS)
    export_p.add_argument("-o", "--output", default="-", metavar="FILE", help="file to write (default stdout)")
    export_p.add_argument("--merge-backward", action=argparse.BooleanOptionalAction, default=None,
                          help="torch-csv: write B directly followed by its W as one full backward 'B' "
                               "(default: only for schedules that never split the backward, e.g. 1f1b)")

    import_p = sub.add_parser("import", help="read a schedule (torch CSV or our text), validate and simulate it")
    import_p.add_argument("file", metavar="FILE", help="schedule file ('-' for stdin)")
    import_p.add_argument("--format", "-f", required=True, choices=IMPORT_FORMATS)
    import_p.add_argument("--stages", "-d", type=int, default=None, metavar="D",
                          help="pipeline devices (default: the file's row count)")
    import_p.add_argument("--placement", choices=("v", "looped"), required=True,
                          help="v: device i holds stages i and 2D-1-i; looped: device i holds i, i+D, ...")
    import_p.add_argument("--chunks", "-v", type=int, default=None, metavar="V",
                          help="looped placement: stages per device (default: from the file)")
    import_p.add_argument("--microbatches", "-m", type=int, default=None, metavar="M",
                          help="microbatches (default: largest index in the file + 1)")
    import_p.add_argument("--name", default=None, help="schedule name (default: the file name)")
    import_p.add_argument("--fused-backward", action=argparse.BooleanOptionalAction, default=None,
                          help="run each B+W pair as one backward whose gradient leaves at its end (default: "
                               "torch-csv: when all backwards are full 'B' cells; text: no)")
    _add_costs_and_memory(import_p)
    _add_output_flags(import_p)
    return parser


# Subcommands that own their argument parsing (lazily imported: verify needs torch).
_DELEGATED = {
    "plan": ("megatron_vshape.planner.cli", "cost model + search: predict MFU, bubble and memory of layouts"),
    "verify": ("megatron_vshape.verify", "run one iteration on CPU or GPU ranks (--device cuda) and compare with a one-process run"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in _DELEGATED:
        import importlib

        module = importlib.import_module(_DELEGATED[argv[0]][0])
        return module.main(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return _COMMANDS[args.command](args)
    except UsageError as exc:
        print(f"vshape: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except (ScheduleError, ValueError) as exc:  # includes InvalidSchedule, DeadlockError
        print(f"vshape: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `vshape export ... | head`: the reader left, nothing to report
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:
        print(f"vshape: error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"vshape: error: {exc.name or 'a module'} is not installed ({exc}); "
              f"pip install 'megatron-vshape[plot]'", file=sys.stderr)
        return 2


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


# ---------------------------------------------------------------- argument interpretation


def _costs(args) -> Costs:
    if args.costs_from is not None:
        if args.costs is not None:
            raise UsageError("give --costs or --costs-from, not both")
        return _costs_from_file(args.costs_from)
    costs = Costs.parse(args.costs or "f=1,b=1,w=1,comm=0")
    stage_costs = getattr(args, "stage_costs", None)  # only `simulate` has the flag
    if stage_costs is not None:
        num_stages = args.stages * SCHEDULES[args.schedule].chunks_per_device(args.chunks)
        costs = costs.with_stages(parse_stage_work(stage_costs, num_stages))
    return costs


def _costs_from_file(path: str) -> Costs:
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise UsageError(f"--costs-from {path}: cannot read a JSON object ({err})") from None
    if not isinstance(record, dict) or not all(key in record for key in ("f", "b", "w", "comm")):
        raise UsageError(f"--costs-from {path}: needs the keys f, b, w and comm (as training writes them)")
    return Costs.parse(",".join(f"{key}={record[key]}" for key in ("f", "b", "w", "comm")))


def _memory_model(args) -> MemoryModel:
    if args.memory_model == "simple":
        if any(v is not None for v in (args.hidden, args.heads, args.seq)):
            raise UsageError("--hidden/--heads/--seq only apply to --memory-model gpt")
        return MemoryModel()
    missing = [flag for flag, v in (("--hidden", args.hidden), ("--heads", args.heads), ("--seq", args.seq))
               if v is None]
    if missing:
        raise UsageError(f"--memory-model gpt needs {', '.join(missing)} (e.g. --hidden 4096 --heads 32 --seq 4096)")
    inputs.count("--hidden", args.hidden, 1, 1 << 20)
    inputs.count("--heads", args.heads, 1, 1 << 14)
    inputs.count("--seq", args.seq, 1, 1 << 24)
    return MemoryModel.for_gpt(args.hidden, args.heads, args.seq)


def _size(args) -> inputs.Size:
    """The requested size, checked for range and sane total before anything is built."""
    inputs.count("--chunks", args.chunks, 1, inputs.MAX_CHUNKS)
    chunks = SCHEDULES[args.schedule].chunks_per_device(args.chunks)
    return inputs.Size(args.stages, args.microbatches, chunks).check()


def _build(args) -> Schedule:
    names = schedule_names()
    if args.schedule not in names:
        raise UsageError(f"--schedule: unknown schedule {args.schedule!r}; choose one of: {', '.join(names)}")
    if args.stages < 2:
        raise UsageError(f"--stages: need at least 2 pipeline devices; got {args.stages}")
    size = _size(args)
    problem = SCHEDULES[args.schedule].check(args.stages, args.microbatches)
    if problem:
        raise UsageError(f"--microbatches: {problem}")
    kwargs = {"costs": _costs(args), "chunks": args.chunks}
    if args.memory_limit is not None:
        kwargs["memory_limit"] = inputs.real("--memory-limit", args.memory_limit, 0.0, 1.0, low_open=True)
    _memory_model(args)  # a bad --memory-model combination fails before a long build
    label = f"building {args.schedule} on {args.stages} devices x {args.microbatches} microbatches"
    with phase(f"{label} ({size.passes:,} passes)", size.large):
        return get_schedule(args.schedule, args.stages, args.microbatches, **kwargs)


def _large(schedule: Schedule) -> bool:
    return sum(map(len, schedule.programs)) > inputs.LARGE_PASSES


def _validate(schedule: Schedule) -> None:
    with phase("validating", _large(schedule)):
        validate(schedule)


def _simulate(schedule: Schedule, args):
    _validate(schedule)
    with phase("simulating", _large(schedule)):
        return simulate(schedule, _costs(args), _memory_model(args))


def _report(result, args) -> None:
    if args.json:
        print(json.dumps({**result.to_json(), "validated": True}))
        return
    schedule = result.schedule
    costs = result.costs
    fused = ", fused B+W backward" if schedule.fused_backward else ""
    print(f"schedule      {schedule.name} ({schedule.placement.kind.value} placement, "
          f"{schedule.num_stages} stages on {schedule.num_devices} devices{fused})")
    print(f"microbatches  {schedule.num_microbatches}")
    if "candidate" in schedule.meta:  # v-auto: which building block / greedy cap it chose
        print(f"chosen        {schedule.meta['candidate']}")
    print(f"costs         f={costs.f:g} b={costs.b:g} w={costs.w:g} comm={costs.comm:g}")
    if costs.stages:
        for name in ("f", "b", "w", "memory"):
            values = ",".join(f"{getattr(work, name):g}" for work in costs.stages)
            print(f"stage {name:<7} {values}")
    print(f"work          per device: {' '.join(f'{w:g}' for w in result.work_each)}")
    print(f"makespan      {result.makespan:g}   (work per device {result.work_per_device:g})")
    print(f"bubble rate   {result.bubble_rate:.4f}   ({result.bubble_rate:.1%})")
    peaks = " ".join(f"{p:g}" for p in result.peak_memory)
    print(f"peak memory   max {result.peak_memory_max:g}   per device: {peaks}")
    print("validated:    ok")
    if args.grid:
        print()
        print(text_grid(result))


# ---------------------------------------------------------------- commands


def _cmd_list(args) -> int:
    width = max(len(name) for name in SCHEDULES)
    for name, spec in SCHEDULES.items():
        print(f"{name:<{width}}  {spec.placement.value:<6}  {spec.description}  [{spec.microbatch_rule}]")
    return 0


def _cmd_simulate(args) -> int:
    _report(_simulate(_build(args), args), args)
    return 0


def _cmd_plot(args) -> int:
    from .schedules.render_plot import check_image_path, plot_memory, plot_schedule

    check_image_path(args.output)  # fail before a long simulation
    if isinstance(args.memory, str):
        check_image_path(args.memory, flag="--memory")
    result = _simulate(_build(args), args)
    if args.memory is True:
        written = [plot_memory(result, args.output, args.title)]
    else:
        written = [plot_schedule(result, args.output, args.title)]
        if args.memory is not None:
            written.append(plot_memory(result, args.memory))
    for path in written:
        print(f"wrote {path}")
    return 0


def _cmd_export(args) -> int:
    schedule = _build(args)
    fmt = args.format
    if fmt == "torch-csv":
        _validate(schedule)
        from .schedules.torch_csv import to_torch_csv

        text = to_torch_csv(schedule, merge_backward=args.merge_backward)
    elif fmt == "text":
        _validate(schedule)
        text = schedule.to_text() + "\n"
    else:
        result = _simulate(schedule, args)
        if fmt == "chrome-trace":
            from .schedules.trace import chrome_trace

            text = json.dumps(chrome_trace(result)) + "\n"
        elif fmt == "grid":
            text = text_grid(result) + "\n"
        else:
            text = json.dumps({**result.to_json(), "validated": True}) + "\n"
    _write(args.output, text)
    return 0


def _write(output: str, text: str) -> None:
    if output == "-":
        sys.stdout.write(text)
        return
    Path(output).write_text(text)
    print(f"wrote {output}", file=sys.stderr)


def _cmd_import(args) -> int:
    from .schedules.actions import parse_action
    from .schedules.torch_csv import from_torch_csv, parse_torch_csv

    text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
    name = args.name or (Path(args.file).stem if args.file != "-" else "imported")
    if args.format == "torch-csv":
        rows = parse_torch_csv(text)
    else:
        rows = tuple(tuple(parse_action(tok) for tok in line.split()) for line in text.strip().splitlines())
    placement = _placement(args, rows)
    if args.microbatches is not None:
        inputs.count("--microbatches", args.microbatches, 1, inputs.MAX_MICROBATCHES)
    if args.format == "torch-csv":
        schedule = from_torch_csv(text, name, placement, args.microbatches, args.fused_backward)
    else:
        schedule = Schedule.from_text(text, name, placement)
        schedule = dataclasses.replace(
            schedule,
            num_microbatches=args.microbatches if args.microbatches is not None else schedule.num_microbatches,
            fused_backward=bool(args.fused_backward),
        )
        inputs.check_microbatches_held((a for row in rows for a in row), placement.num_stages,
                                       schedule.num_microbatches, source=f"FILE {args.file}")
    _report(_simulate(schedule, args), args)
    return 0


def _placement(args, rows) -> Placement:
    """The placement named by --placement, sized from the file (rows = devices, stages used)."""
    devices = len(rows)
    if devices == 0:
        raise UsageError(f"FILE: {args.file} holds no schedule rows")
    inputs.count(f"FILE {args.file}: rows (devices)", devices, 1, inputs.MAX_DEVICES)
    passes = sum(map(len, rows))
    if passes > inputs.MAX_PASSES:
        raise UsageError(f"FILE: {args.file} holds {passes:,} passes, above the {inputs.MAX_PASSES:,} this tool reads")
    if args.stages is not None and args.stages != devices:
        raise UsageError(f"--stages: the file has {devices} rows (one per device) but --stages is {args.stages}")
    used = {a.stage for row in rows for a in row}
    num_stages = max(used, default=-1) + 1
    if num_stages > len(used):  # a stage index far beyond the others would size the placement
        missing = min(set(range(len(used) + 1)) - used)
        raise UsageError(f"FILE: {args.file} uses stage {num_stages - 1} but no pass of stage {missing}; "
                         "stages must be numbered 0, 1, 2, ... without gaps")
    if args.placement == "v":
        if args.chunks not in (None, 2):
            raise UsageError("--chunks: the v placement always has 2 chunks per device")
        if num_stages != 2 * devices:
            raise UsageError(f"--placement v: the file uses {num_stages} stages; a V on {devices} devices has "
                             f"{2 * devices} (try --placement looped)")
        return Placement.v_shape(devices)
    chunks = args.chunks if args.chunks is not None else max(1, -(-num_stages // devices))
    if chunks < 1 or num_stages != chunks * devices:
        raise UsageError(f"--chunks: {chunks} chunks on {devices} devices hold {chunks * devices} stages; "
                         f"the file uses {num_stages}")
    return Placement.looped(devices, chunks)


_COMMANDS = {
    "list": _cmd_list,
    "simulate": _cmd_simulate,
    "plot": _cmd_plot,
    "export": _cmd_export,
    "import": _cmd_import,
}


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
