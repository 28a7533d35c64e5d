"""``vshape``: list, simulate, plot, export and import pipeline schedules.

Examples::

    vshape list
    vshape simulate --schedule v-half --stages 4 --microbatches 8 --grid
    vshape simulate --schedule v-zb --stages 8 --microbatches 32 --costs f=1,b=1.1,w=0.9,comm=0.05 --json
    vshape simulate --schedule v-half --stages 2 --microbatches 8 --stage-costs "time=2,1,1,2;memory=1,1,1,3"
    vshape simulate --schedule v-zb --stages 8 --microbatches 32 --vocab-parallel time=0.92
    vshape plot --schedule v-half --stages 4 --microbatches 8 -o v-half.png
    vshape export --schedule v-min --stages 4 --microbatches 8 --format torch-csv -o v-min.csv
    vshape import --format torch-csv v-min.csv --stages 4 --placement v

Bad input ends with one line on stderr (which flag, how to fix it) and exit status 2.
Everything here is pure Python; ``plot`` needs matplotlib.

This module runs the subcommands; their flags are in ``cli_parser``, what the flags mean for the
schedule library in ``cli_inputs``; ``plan`` and ``verify`` parse their own (``cli_parser.DELEGATED``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from . import cli_inputs
from .cli_parser import (
    DELEGATED,
    EXPORT_FORMATS,
    IMPORT_FORMATS,
    OneLineParser,
    UsageError,
    build_parser,
    usage_error,
)
from .progress import phase
from .schedules.core import inputs
from .schedules.core.schedule import Costs, Schedule, ScheduleError
from .schedules.core.simulator import simulate
from .schedules.export.render_text import text_grid
from .schedules.generators.registry import SCHEDULES, get_schedule, schedule_names
from .schedules.lowering.validator import validate, w_order_breaks

# The parser, the usage error and Costs stay importable from here (verify and the tests use them).
__all__ = ["EXPORT_FORMATS", "IMPORT_FORMATS", "Costs", "OneLineParser", "UsageError", "build_parser", "main",
           "usage_error"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DELEGATED:
        import importlib

        module = importlib.import_module(DELEGATED[argv[0]][0])
        return module.main(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return _COMMANDS[args.command](args)
    except (UsageError, ScheduleError, ValueError) as exc:  # ValueError includes InvalidSchedule, DeadlockError
        return usage_error(exc)
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


def _build(args) -> Schedule:
    names = schedule_names()
    if args.schedule not in names:
        raise UsageError(f"--schedule: unknown schedule {args.schedule!r}; choose one of: {', '.join(names)}")
    if args.stages < 2:
        raise UsageError(f"--stages: need at least 2 pipeline devices; got {args.stages}")
    size = cli_inputs.size_of(args)
    problem = SCHEDULES[args.schedule].check(args.stages, args.microbatches)
    if problem:
        raise UsageError(f"--microbatches: {problem}")
    kwargs = {"costs": cli_inputs.costs_of(args), "chunks": args.chunks}
    if args.memory_limit is not None:
        kwargs["memory_limit"] = inputs.real("--memory-limit", args.memory_limit, 0.0, 1.0, low_open=True)
    cli_inputs.memory_model_of(args)  # a bad --memory-model combination fails before a long build
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
        return simulate(schedule, cli_inputs.costs_of(args), cli_inputs.memory_model_of(args))


def _report(result, args) -> None:
    if args.json:
        print(json.dumps({**result.to_json(), "validated": True, "w_order_kept": not w_order_breaks(result.schedule)}))
        return
    schedule = result.schedule
    costs = result.costs
    fused = ", fused B+W backward" if schedule.fused_backward else ""
    print(f"schedule      {schedule.name} ({schedule.placement.kind.value} placement, "
          f"{schedule.num_stages} stages on {schedule.num_devices} devices{fused})")
    print(f"microbatches  {schedule.num_microbatches}")
    if "candidate" in schedule.meta:  # v-auto: which building block / greedy cap it chose
        print(f"chosen        {schedule.meta['candidate']}")
    a2a = f" a2a={costs.a2a:g}" if costs.a2a else ""
    print(f"costs         f={costs.f:g} b={costs.b:g} w={costs.w:g} comm={costs.comm:g}{a2a}")
    if costs.stages:
        for name in ("f", "b", "w", "memory"):
            values = ",".join(f"{getattr(work, name):g}" for work in costs.stages)
            print(f"stage {name:<7} {values}")
    if costs.vocab is not None:
        v = costs.vocab
        print(f"vocabulary    parallel over {schedule.num_devices} devices: f={v.f:g} b={v.b:g} w={v.w:g} "
              f"memory={v.memory:g} (whole vocabulary, x one V chunk's passes), one H and one G per device "
              "and microbatch")
    print(f"work          per device: {' '.join(f'{w:g}' for w in result.work_each)}")
    print(f"makespan      {result.makespan:g}   (work per device {result.work_per_device:g})")
    print(f"bubble rate   {result.bubble_rate:.4f}   ({result.bubble_rate:.1%})")
    if costs.a2a:  # the work above includes the all-to-all time no compute hides
        exposed = " ".join(f"{e:g}" for e in result.exposed_a2a)
        print(f"all-to-all    exposed per device: {exposed}   ({len(schedule.pairs)} overlapped F&B pairs)")
    peaks = " ".join(f"{p:g}" for p in result.peak_memory)
    print(f"peak memory   max {result.peak_memory_max:g}   per device: {peaks}")
    print("validated:    ok")
    breaks = w_order_breaks(schedule)  # TE's deferred W is a FIFO per layer: it needs W in B's order
    print(f"W order       {'kept on every stage' if not breaks else 'broken: ' + breaks[0]} (TE's deferred W "
          f"{'can' if not breaks else 'cannot'} serve it)")
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
    from .schedules.export.render_plot import check_image_path, plot_memory, plot_schedule

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
        from .schedules.export.torch_csv import to_torch_csv

        text = to_torch_csv(schedule, merge_backward=args.merge_backward)
    elif fmt == "text":
        _validate(schedule)
        text = schedule.to_text() + "\n"
    else:
        result = _simulate(schedule, args)
        if fmt == "chrome-trace":
            from .schedules.export.trace import chrome_trace

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
    from .schedules.core.actions import parse_step
    from .schedules.export.torch_csv import from_torch_csv, parse_torch_csv

    text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
    name = args.name or (Path(args.file).stem if args.file != "-" else "imported")
    if args.format == "torch-csv":
        rows = parse_torch_csv(text)
    else:
        # A pair (F3.7&B5.2) is its two actions here; Schedule.from_text keeps it a pair.
        rows = tuple(tuple(a for tok in line.split() for a in _actions_of(parse_step(tok)))
                     for line in text.strip().splitlines())
    placement = cli_inputs.placement_of(args, rows)
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


def _actions_of(step) -> tuple:
    from .schedules.core.actions import Pair

    return tuple(step) if isinstance(step, Pair) else (step,)


_COMMANDS = {
    "list": _cmd_list,
    "simulate": _cmd_simulate,
    "plot": _cmd_plot,
    "export": _cmd_export,
    "import": _cmd_import,
}


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
