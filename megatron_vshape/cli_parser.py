"""The ``vshape`` command line: its subcommands and flags, and the one-line usage error.

Every subcommand reports bad input as ``vshape: error: <one line>`` with exit status 2
(:func:`usage_error`); ``vshape verify`` builds its own parser on :class:`OneLineParser` too.
"""

from __future__ import annotations

import argparse
import sys

EXPORT_FORMATS = ("torch-csv", "chrome-trace", "text", "grid", "json")
IMPORT_FORMATS = ("torch-csv", "text")


class UsageError(Exception):
    """Bad command-line input: reported as one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump) and never a traceback."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


def usage_error(problem) -> int:
    """Print ``vshape: error: <problem on one line>`` to stderr; the exit status 2 (every subcommand)."""
    print(f"vshape: error: {one_line(problem)}", file=sys.stderr)
    return 2


def one_line(exc: BaseException | str) -> str:
    """``exc``'s text with every run of white space (newlines included) folded to one space."""
    return " ".join(str(exc).split())


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
    parser = OneLineParser(prog="vshape", description="Controllable-memory pipeline schedules: list, simulate, "
                                                "plot, export, import, plan, verify.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    sub.required = True

    sub.add_parser("list", help="schedules with a one-line description")
    for name, (_, help_text) in DELEGATED.items():  # listed in --help; main() dispatches them first
        sub.add_parser(name, help=help_text + f" (see `vshape {name} --help`)", add_help=False)

    simulate_p = sub.add_parser("simulate", help="validate and simulate a schedule, print a summary")
    _add_selection(simulate_p)
    _add_output_flags(simulate_p)
    simulate_p.add_argument(
        "--stage-costs", default=None, metavar="f=2,1,1,2;memory=1,1,1,3",
        help="per-stage multipliers of the --costs times and of activation memory, one value per stage in "
             "global stage order (V: 2d stages, stage 2d-1-i on device i; looped: d, interleaved: d x chunks); "
             "groups f=, b=, w=, memory= or time= (f, b and w together) separated by ';'; omitted keys stay 1")
    _add_vocab_flag(simulate_p)

    plot_p = sub.add_parser("plot", help="draw a schedule (PNG, SVG or PDF)")
    _add_selection(plot_p)
    plot_p.add_argument("-o", "--output", required=True, metavar="FILE", help="picture to write (.png/.svg/.pdf)")
    plot_p.add_argument("--memory", nargs="?", const=True, default=None, metavar="FILE",
                        help="draw activation memory over time: into -o alone, or with FILE into FILE "
                             "in addition to the schedule picture")
    plot_p.add_argument("--title", default=None, help="picture title (default: name, sizes, bubble, memory)")
    _add_vocab_flag(plot_p)

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
DELEGATED = {
    "plan": ("megatron_vshape.planner.cli", "cost model + search: predict MFU, bubble and memory of layouts"),
    "optimize": ("megatron_vshape.optimize_cli", "the exact schedule of a small cell (OR-Tools CP-SAT; the solver extra)"),
    "check-flags": ("megatron_vshape.megatron.check_flags",
                    "check pretrain_gpt.py flags (parser + start-up checks, no GPU): accepted, or the refusal"),
    "verify": ("megatron_vshape.verify", "run one iteration on CPU or GPU ranks (--device cuda) and compare with a one-process run"),
}


def _add_vocab_flag(parser) -> None:
    """``--vocab-parallel`` of ``simulate`` and ``plot`` (cli_inputs.costs_of reads it)."""
    parser.add_argument(
        "--vocab-parallel", default=None, metavar="time=0.92",
        help="run the output layer and loss as vocabulary-parallel passes spread over every device (H: forward "
             "and input gradient, a collective of all devices; G: weight gradient): their work over the whole "
             "vocabulary as multiples of one V chunk's F, B, W (f=, b=, w=, or time= for all three) and memory= "
             "what one microbatch holds from H to G, in V-chunk activations; --stage-costs is then the layers' "
             "work alone")
