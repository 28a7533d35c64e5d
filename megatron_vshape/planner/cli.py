"""``vshape plan``: predict MFU, bubble and memory per schedule and search the best layout.

Examples::

    vshape plan --model 98.5b --seq 3072 --gpus 40 --global-batch 640 --flash-attention
    vshape plan --layers 32 --hidden 4096 --heads 32 --seq 4096 --gpu h100 --gpus 16 --global-batch 256
    vshape plan --model 9.6b --gpus 16 --global-batch 64 --tp 1 --pp 16 --micro-batch 4 --schedules 1f1b,v-half
    vshape plan --gpus 64 --gpu h100 --global-batch-size 512 -- --num-layers 32 --hidden-size 4096 ...
    vshape plan --from-recipe examples/llama/train_llama3_8b_h100_fp8.sh --gpus 64

Everything after ``--`` is read as Megatron-LM flags (its own parser where megatron.training is
installed); ``--from-recipe`` reads them out of a launch script (see planner/recipe.py). Then the
search also covers CP, EP and the recomputation mode, and prints the flags to add to the recipe.

Every schedule gets two rows: without and with ``--pipeline-vocab-parallel`` (the row named
``SCHEDULE +vocab``: the vocabulary layers on every pipeline device, planner/vocab.py); ``--no-vocab-parallel``
drops the second. For a MoE model each V schedule gets a third, with ``--overlap-moe-expert-parallel-comm``
(``SCHEDULE +pairs``: overlapped F&B pairs hide the expert all-to-all, planner/moe_pairs.py);
``--no-moe-pairs`` drops it. The rows are sorted by MFU, so the first is the plan's pick (a tie keeps the
row with fewer flags first).

Bad input ends with one line on stderr naming the flag and the fix, exit status 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

from ..cli_parser import OneLineParser, UsageError, usage_error
from ..layout_flag import format_layout
from ..progress import phase
from ..schedules.core import inputs
from ..schedules.core.schedule import ScheduleError
from .costs import CostModel, calibrate_efficiency
from .explain import no_split, why_nothing
from .hardware import GPUS, get_gpu
from .layer_layout_mfu import LayersAlone, LayoutComparison, compare_layouts
from .model import PRESETS, GPTModel, get_model
from .moe_pairs import FLAG as PAIRS_FLAG
from .paired_run import PairedRun
from .predict import Prediction, planner_schedule_names, split_name
from .recipe_plan import (
    DEFAULT_GPU,
    RECIPE_SCHEDULES,
    RECOMPUTE_MODES,
    RecipeInputs,
    commands,
    cost_model_for,
    grid_for,
    header,
    read_inputs,
)
from .row_pool import run_all, usable_cpus
from .rows import PAIRS, VOCAB, row_kinds
from .search import Grid, ScheduleSearch, layouts, search
from .vocab import FLAG as VOCAB_FLAG

PAPER_SCHEDULES = ("1f1b", "1f1b-r", "v-min", "v-half", "v-zb")
# The one published number the cost model is calibrated from (paper, arXiv v1): the 9.6B model's
# F pass over one V chunk (one layer) at microbatch 4, sequence 1024, on an A100: 12.96 ms.
PAPER_F_MS = 12.96
# Above this many (schedule, layout) candidates the search takes seconds to minutes: show progress.
LARGE_SEARCH = 200


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 1,2,4")
    return values


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in RECOMPUTE_MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"{text!r}: give some of {','.join(RECOMPUTE_MODES)}")
    return modes


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="vshape plan", description=__doc__.split("\n\n")[0])
    m = p.add_argument_group("model")
    m.add_argument("--model", help=f"preset: {', '.join(PRESETS)} (the paper's models)")
    m.add_argument("--layers", type=int)
    m.add_argument("--hidden", type=int)
    m.add_argument("--heads", type=int)
    m.add_argument("--seq", type=int, help="sequence length (default: 1024 or the preset's)")
    m.add_argument("--vocab", type=int, default=51200)
    m.add_argument("--flash-attention", action="store_true",
                   help="no stored s x s attention scores (drops the 5as term of the activation model)")
    m.add_argument("--from-recipe", metavar="FILE.sh",
                   help="read Megatron flags (model, batch, FP8, DP overlap) from a launch script; flags after -- win")
    h = p.add_argument_group("hardware and batch")
    h.add_argument("--gpu", help=f"one of {', '.join(GPUS)} (default a100; {DEFAULT_GPU} with Megatron flags)")
    h.add_argument("--gpus", type=int, required=True, help="total GPU count")
    h.add_argument("--global-batch", "--global-batch-size", dest="global_batch", type=int,
                   help="sequences per iteration (default: the recipe's --global-batch-size)")
    c = p.add_argument_group("cost model")
    c.add_argument("--efficiency", type=float,
                   help="achievable fraction of peak FLOP/s for the GEMMs; memory-bound kernels are timed from HBM "
                   f"bandwidth (default: calibrated from the paper's {PAPER_F_MS} ms)")
    c.add_argument("--calibrate-f-ms", type=float, help="measured F time of --calibrate-layers layers, in ms")
    c.add_argument("--calibrate-model", default="9.6b", help="preset the measurement is for (default 9.6b)")
    c.add_argument("--calibrate-micro-batch", type=int, default=4)
    c.add_argument("--calibrate-layers", type=int, default=1)
    c.add_argument("--bandwidth-efficiency", type=float, default=0.7, help="achievable fraction of link bandwidth")
    c.add_argument("--no-distributed-optimizer", action="store_true",
                   help="optimizer state not sharded over DP (18 bytes/parameter everywhere)")
    s = p.add_argument_group("search")
    s.add_argument("--schedules",
                   help=f"comma-separated, or 'all' ({', '.join(planner_schedule_names())}); default "
                   f"{','.join(PAPER_SCHEDULES)}, or {','.join(RECIPE_SCHEDULES)} with Megatron flags")
    s.add_argument("--tp", type=_int_list, help="TP sizes to try (default: every divisor up to 8)")
    s.add_argument("--pp", type=_int_list, help="PP sizes to try (default: every divisor >= 2)")
    s.add_argument("--dp", type=_int_list, help="DP sizes to try (default: what is left)")
    s.add_argument("--micro-batch", type=_int_list, default=[1, 2, 4, 8], help="microbatch sizes (default 1,2,4,8)")
    s.add_argument("--cp", type=_int_list, help="CP sizes to try (Megatron flags only; default 1,2,4,8)")
    s.add_argument("--ep", type=_int_list, help="EP sizes to try (Megatron flags only; default: divisors of the experts)")
    s.add_argument("--recompute", type=_modes, help="recomputation modes to try, of none,selective,full "
                   "(Megatron flags only; default all three)")
    s.add_argument("--all", action="store_true", help="also print every configuration evaluated")
    s.add_argument("--json", type=Path, metavar="FILE", help="write the results as JSON")
    s.add_argument("--no-layouts", action="store_true",
                   help="skip the layer-layout comparison (uniform vs balanced) of each schedule's best layout")
    s.add_argument("--no-vocab-parallel", action="store_true",
                   help=f"skip the rows with {VOCAB_FLAG} (the vocabulary layers on every pipeline device)")
    s.add_argument("--no-moe-pairs", action="store_true",
                   help=f"skip the rows with {PAIRS_FLAG} (overlapped F&B pairs; MoE models, V schedules)")
    s.add_argument("--jobs", type=int, metavar="N",
                   help="processes to search the rows on (default: every usable CPU for a large search, else 1); "
                        "the answer is the same")
    return p


# (dest, flag, low, high): every size the planner takes, bounded so that no product overflows and
# no search runs for hours. Real models sit far inside (the paper's largest: 98.5B on 40 GPUs).
_COUNTS = (
    ("layers", "--layers", 1, 4096), ("hidden", "--hidden", 1, 1 << 18), ("heads", "--heads", 1, 1 << 12),
    ("seq", "--seq", 1, 1 << 22), ("vocab", "--vocab", 1, 1 << 22), ("gpus", "--gpus", 2, 1 << 16),
    ("global_batch", "--global-batch", 1, 1 << 22), ("calibrate_micro_batch", "--calibrate-micro-batch", 1, 1 << 12),
    ("calibrate_layers", "--calibrate-layers", 1, 4096), ("jobs", "--jobs", 1, 1024),
)
_FRACTIONS = (("efficiency", "--efficiency"), ("bandwidth_efficiency", "--bandwidth-efficiency"))


def check_numbers(args) -> None:
    """Every number in range and finite, or InputError naming the flag (before any model is built)."""
    for dest, flag, low, high in _COUNTS:
        if getattr(args, dest) is not None:
            inputs.count(flag, getattr(args, dest), low, high)
    for dest, flag in _FRACTIONS:
        if getattr(args, dest) is not None:
            inputs.real(flag, getattr(args, dest), 0.0, 1.0, low_open=True)
    if args.calibrate_f_ms is not None:
        inputs.real("--calibrate-f-ms", args.calibrate_f_ms, 1e-6, 1e7)
    for dest, flag, high in (("tp", "--tp", 1 << 16), ("pp", "--pp", 1 << 16), ("dp", "--dp", 1 << 16),
                             ("micro_batch", "--micro-batch", 1 << 12)):
        for value in getattr(args, dest) or ():
            inputs.count(flag, value, 1, high)


def resolve(args, megatron_argv: list[str]) -> None:
    """Read Megatron flags (after ``--`` or from ``--from-recipe``) into ``args.recipe`` and fill the
    batch, flash attention and schedules from them unless given; plain mode checks its own flags."""
    args.recipe: RecipeInputs | None = None
    if megatron_argv or args.from_recipe:
        if args.model or args.layers or args.hidden or args.heads:
            raise UsageError("give the model either as Megatron flags (after -- or --from-recipe) or as "
                             "--model/--layers/--hidden/--heads, not both")
        args.recipe = read_inputs(megatron_argv, args.from_recipe)
        args.global_batch = args.global_batch or args.recipe.flags.global_batch
        args.flash_attention = args.flash_attention or args.recipe.flags.flash_attention
        args.schedules = args.schedules or ",".join(RECIPE_SCHEDULES)
    else:
        for dest, flag in (("cp", "--cp"), ("ep", "--ep"), ("recompute", "--recompute")):
            if getattr(args, dest):
                raise UsageError(f"{flag} applies to Megatron flags (after -- or --from-recipe); the paper's "
                                 "grid has no CP, EP or recomputation modes (use the 1f1b-r schedule)")
        args.schedules = args.schedules or ",".join(PAPER_SCHEDULES)
    if args.global_batch is None:
        raise UsageError("--global-batch-size: required (the recipe does not give one)")


def model_from_args(args) -> GPTModel:
    if getattr(args, "recipe", None) is not None:
        model = args.recipe.model
        return model.with_seq(args.seq) if args.seq else model
    shape = (args.layers, args.hidden, args.heads)
    if args.model and any(v is not None for v in shape):
        raise UsageError("give either --model or --layers/--hidden/--heads, not both")
    if args.model:
        model = get_model(args.model)
        return model.with_seq(args.seq) if args.seq else model
    if any(v is None for v in shape):
        raise UsageError("give --model PRESET or all of --layers, --hidden and --heads")
    return GPTModel("custom", args.layers, args.hidden, args.heads, args.seq or 1024, args.vocab)


def cost_model_from_args(args) -> CostModel:
    recipe = getattr(args, "recipe", None)
    gpu = get_gpu(args.gpu or (DEFAULT_GPU if recipe is not None else "a100"))
    if args.efficiency is not None and args.calibrate_f_ms is not None:
        raise UsageError("give either --efficiency or --calibrate-f-ms, not both")
    if args.efficiency is not None:
        efficiency = args.efficiency
    else:
        ms = PAPER_F_MS if args.calibrate_f_ms is None else args.calibrate_f_ms
        reference_gpu = get_gpu("a100") if args.calibrate_f_ms is None else gpu
        efficiency = calibrate_efficiency(reference_gpu, get_model(args.calibrate_model),
                                          args.calibrate_micro_batch, ms / 1e3, args.calibrate_layers)
    base = CostModel(gpu, efficiency, args.bandwidth_efficiency, not args.no_distributed_optimizer)
    return base if recipe is None else cost_model_for(recipe.flags, base)


def _schedules(text: str) -> list[str]:
    names = planner_schedule_names() if text.strip() == "all" else [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        split_name(name)
    return names


def _row(pred: Prediction) -> str:
    mem = pred.memory
    flag = "  OOM" if pred.oom else ""
    return (f"{str(pred.layout):24s} MFU {pred.mfu:6.2%}  bubble {pred.bubble_rate:6.2%}  "
            f"iter {pred.iteration_time:7.2f} s  peak {mem.peak / 2**30:5.1f} GiB "
            f"(activations {mem.peak_activation / 2**30:5.1f}){flag}")


def report(results: list[ScheduleSearch], show_all: bool, reasons: dict[str, str] | None = None) -> str:
    """One line per row (a schedule, and its ``+vocab`` and ``+pairs`` variants), best first (sorted() is
    stable: a tie keeps the order of ``results``, the schedule's own row before its variants); ``reasons``
    says why a row found nothing (by row name)."""
    lines = []
    empty: dict[str, dict[str, str]] = {}  # variant rows that found nothing, by suffix: one line each at the end
    for found in sorted(results, key=lambda r: -(r.best.mfu if r.best else -1)):
        head = f"{found.label:<16s} "
        why = (reasons or {}).get(found.label, found.reason)
        if found.best is None and found.label != found.schedule:
            empty.setdefault(found.label.removeprefix(found.schedule + " "), {})[found.label] = why
            continue
        lines.append(head + (_row(found.best) if found.best else "nothing fits: " + why)
                     + f"   [{len(found.evaluated)} simulated, {found.skipped} pruned]")
        if show_all:
            lines.extend("    " + _row(p) for p in sorted(found.evaluated, key=lambda p: -p.mfu))
    for suffix, rows in empty.items():
        if len(set(rows.values())) == 1:
            lines.append(f"{suffix + ' rows':<16s} nothing fits for {', '.join(rows)}: {next(iter(rows.values()))}")
        else:
            lines.extend(f"{label:<16s} nothing fits: {why}" for label, why in rows.items())
    return "\n".join(lines)


def _grid(args) -> Grid:
    if getattr(args, "recipe", None) is not None:
        return grid_for(args.recipe.model, args.tp, args.pp, args.dp, args.micro_batch, args.cp, args.ep,
                        args.recompute)
    return Grid(args.tp, args.pp, args.dp, tuple(args.micro_batch))


def run(args) -> list[ScheduleSearch]:
    check_numbers(args)
    model = model_from_args(args)
    cost_model = cost_model_from_args(args)
    grid = _grid(args)
    names = _schedules(args.schedules)
    reason = no_split(args.gpus, grid, cost_model.gpu.gpus_per_node)
    if reason is not None:  # nothing can fit for any schedule: a usage error, not an answer
        raise UsageError(reason)
    layouts_to_try = len(list(layouts(model, args.gpus, args.global_batch, grid, cost_model.gpu.gpus_per_node)))
    large = layouts_to_try * len(names) > LARGE_SEARCH
    rows = [(name, kind) for name in names
            for kind in row_kinds(name, model, not args.no_vocab_parallel, not args.no_moe_pairs)]
    pieces = [functools.partial(search, [name], model, cost_model, args.gpus, args.global_batch, grid,
                                args.flash_attention, kind.vocab_parallel, kind.pairs) for name, kind in rows]
    jobs = args.jobs = plan_jobs(args, large)  # resolved once: the layout comparisons use it too
    label = (f"searching {len(names)} schedules, {len(rows)} rows (up to {layouts_to_try} layouts each) on "
             f"{jobs} process{'es' if jobs > 1 else ''}")
    with phase(label, large, prefix="vshape plan"):
        found = run_all(pieces, jobs, [_weight(name, kind) for name, kind in rows])
    return [result for results in found for result in results]


def plan_jobs(args, large: bool) -> int:
    """``--jobs``, or by default every usable CPU for a large search (a small one is done before the processes
    would start)."""
    if args.jobs is not None:
        return args.jobs
    return usable_cpus() if large else 1


def _weight(name: str, kind) -> float:
    """A guess of a row's search time, to hand out the heavy rows first: the V families build their orders
    from stage costs per layout (seconds at PP 32), a +vocab row places its H passes too."""
    base, _ = split_name(name)
    return (3.0 if base.startswith("v-") else 1.0) + (1.0 if kind.vocab_parallel or kind.pairs else 0.0)


Comparison = LayoutComparison | LayersAlone | PairedRun | str


def layout_comparisons(results: list[ScheduleSearch], model: GPTModel, cost_model: CostModel,
                       flash_attention: bool, jobs: int = 1) -> dict[str, Comparison]:
    """Per row with a best layout (by row name): reference vs balanced layer layout, or why there is none;
    for a ``+vocab`` row its own run on the layers alone (nothing to balance), for a ``+pairs`` row its own run
    on the search's layout (the balance search does not cost pairs), each next to the schedule's best run
    without the flag. The balance searches run on ``jobs`` processes (row_pool.py)."""
    out: dict[str, Comparison] = {}
    plain = [found for found in results if found.best is not None and not found.vocab_parallel and not found.pairs]
    pieces = [functools.partial(_compared, found.schedule, model, cost_model, found.best.layout, flash_attention)
              for found in plain]
    for found, comparison in zip(plain, run_all(pieces, jobs, [_weight(f.schedule, f) for f in plain])):
        out[found.label] = comparison
    for found in results:
        if found.best is not None and found.vocab_parallel:
            out[found.label] = LayersAlone(found.best)
        elif found.best is not None and found.pairs:
            out[found.label] = PairedRun(found.best)
    return out


def _compared(schedule: str, model: GPTModel, cost_model: CostModel, layout, flash_attention: bool) -> Comparison:
    try:
        return compare_layouts(schedule, model, cost_model, layout, flash_attention)
    except ValueError as error:  # ScheduleError included; recomputing schedules are not modelled
        return " ".join(str(error).split())


def runs_of_the_flags(results: list[ScheduleSearch], comparisons: dict[str, Comparison]) -> None:
    """Where the layout table's balanced layout beats the search's own, the flags recommend it
    (``recipe_plan.commands``): the schedule's row shows that run (the same prediction), so both tables agree.
    A ``+vocab`` or ``+pairs`` row's line is its own run already; it learns the best run without the flag (the
    row above, after this swap) to compare with."""
    for found in results:
        comparison = comparisons.get(found.label)
        if found.best is not None and isinstance(comparison, LayoutComparison) \
                and comparison.balanced_mfu > found.best.mfu:
            found.best = comparison.balanced
    without = {r.schedule: r.best for r in results if r.label == r.schedule}
    for found in results:
        comparison = comparisons.get(found.label)
        if isinstance(comparison, (LayersAlone, PairedRun)):
            comparisons[found.label] = type(comparison)(comparison.run, without.get(found.schedule))


def layout_report(comparisons: dict[str, Comparison]) -> str:
    lines = ["", "Layer layout of each best configuration, with the embedding, LM head and loss costed on their own "
             "stages (--pipeline-layout uniform|balanced):"]
    if any(isinstance(c, LayersAlone) for c in comparisons.values()):
        lines.append(f"(+vocab rows, {VOCAB_FLAG}: every device runs 1/p of the embedding, LM head and loss, so the "
                     "stages hold the layers alone and their layout is the layers' own: uniform is even)")
    if any(isinstance(c, PairedRun) for c in comparisons.values()):
        lines.append(f"(+pairs rows, {PAIRS_FLAG}: the search's layout, costed with the pairs; the balance search "
                     "does not cost them)")
    for name, c in comparisons.items():
        if isinstance(c, str):
            lines.append(f"{name:<16s} not compared: {c}")
            continue
        if isinstance(c, (LayersAlone, PairedRun)):
            versus = "" if c.without is None else \
                f"  (x{c.without.iteration_time / c.run.iteration_time:.3f} vs without the flag, MFU {c.without.mfu:6.2%})"
            where = "layers alone" if isinstance(c, LayersAlone) else "search's layout"
            lines.append(f"{name:<16s} {where} {format_layout(c.run.layers_per_stage)}: iter {c.run.iteration_time:7.2f} s "
                         f"MFU {c.run.mfu:6.2%}{versus}")
            continue
        choice = c.choice
        lines.append(f"{name:<16s} {c.choice.reference_name} {format_layout(choice.reference_layers)}: iter "
                     f"{c.reference_iteration:7.2f} s MFU {c.reference_mfu:6.2%}  ->  balanced "
                     f"{format_layout(choice.layers_per_stage)}: iter {c.balanced_iteration:7.2f} s MFU "
                     f"{c.balanced_mfu:6.2%} (x{c.reference_iteration / c.balanced_iteration:.3f})")
    return "\n".join(lines)


def split_argv(argv: list[str] | None) -> tuple[list[str], list[str]]:
    """(vshape plan's own words, the Megatron flags after the first ``--``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    at = argv.index("--")
    return argv[:at], argv[at + 1:]


def main(argv: list[str] | None = None) -> int:
    own, megatron_argv = split_argv(argv)
    try:
        args = build_parser().parse_args(own)
        resolve(args, megatron_argv)
        results = run(args)
    except (UsageError, ValueError, ScheduleError) as error:
        return usage_error(error)
    model, cost_model = model_from_args(args), cost_model_from_args(args)
    if args.recipe is not None:
        print(header(args.recipe, cost_model, args.gpus, args.global_batch))
    else:
        print(f"{model.name} ({model.total_params / 1e9:.1f}B parameters, seq {model.seq_length}) on "
              f"{args.gpus} x {cost_model.gpu.name}, global batch {args.global_batch}, "
              f"{cost_model.efficiency:.1%} of peak for the GEMMs")
    reasons = {r.label: why_nothing(r, model, cost_model, args.gpus, args.global_batch, _grid(args))
               for r in results if r.best is None}
    comparisons = {} if args.no_layouts else layout_comparisons(results, model, cost_model, args.flash_attention,
                                                                args.jobs)
    runs_of_the_flags(results, comparisons)
    if comparisons:
        kinds = [kind for kind in (VOCAB, PAIRS) if any(r.label.endswith(" " + kind.suffix) for r in results)]
        print("Each row is the run its flags give (printed at the end; its --pipeline-layout included"
              + "".join(f", {kind.flag} in the {kind.suffix} rows'" for kind in kinds) + "):")
    print(report(results, args.all, reasons))
    if comparisons:
        print(layout_report(comparisons))
    if args.recipe is not None:
        print(commands(results, comparisons))
    if args.json:
        records = [{"schedule": r.schedule, "vocab_parallel": r.vocab_parallel, "moe_pairs": r.pairs,
                    "best": r.best.to_json() if r.best else None,
                    "reason": reasons.get(r.label, r.reason),
                    "layout": _layout_json(comparisons.get(r.label)),
                    "evaluated": [p.to_json() for p in r.evaluated]} for r in results]
        args.json.write_text(json.dumps(records, indent=2))
    return 0


def _layout_json(comparison: Comparison | None):
    if comparison is None or isinstance(comparison, str):
        return None if comparison is None else {"error": comparison}
    return comparison.to_json()


if __name__ == "__main__":
    sys.exit(main())
