"""Why ``vshape plan`` found nothing: GPU count vs TP x PP x DP, batch and layer rules, memory.

The search (search.py) only says *that* no layout fits; a user needs the rule that stopped it.
The rules are checked in the order the search applies them, and the first stage that leaves no
candidate is the reason, with the numbers that make it fail.
"""

from __future__ import annotations

from collections import Counter

from ..schedules.generators.registry import SCHEDULES
from .costs import CostModel
from .model import GPTModel
from .moe_pairs import pair_problem
from .parallel_layout import ParallelLayout
from .predict import num_stages, split_name
from .search import Grid, ScheduleSearch, _static_fits, layouts, vocab_problem

TP_SIZES = (1, 2, 4, 8, 16)  # what search.layouts tries


def no_split(gpus: int, grid: Grid, gpus_per_node: int) -> str | None:
    """A one-line reason when no TP x PP x DP split of ``gpus`` exists at all (any schedule), else None."""
    for tp in TP_SIZES:
        if tp > gpus_per_node or gpus % tp or (grid.tp is not None and tp not in grid.tp):
            continue
        for pp in range(2, gpus // tp + 1):
            if (gpus // tp) % pp == 0 and (grid.pp is None or pp in grid.pp) and \
                    (grid.dp is None or gpus // (tp * pp) in grid.dp):
                return None
    tps = [t for t in TP_SIZES if t <= gpus_per_node and (grid.tp is None or t in grid.tp)]
    if not tps:
        return f"--tp: TP must be at most the {gpus_per_node} GPUs of one node; got {','.join(map(str, grid.tp))}"
    restricted = " and the --tp/--pp/--dp given" if any(v is not None for v in (grid.tp, grid.pp, grid.dp)) else ""
    return (f"--gpus {gpus}: no split into TP x PP x DP with TP in {{{', '.join(map(str, tps))}}} dividing it, "
            f"PP >= 2{restricted}; change --gpus or the sizes to try")


def why_nothing(found: ScheduleSearch, model: GPTModel, cost_model: CostModel, gpus: int, global_batch: int,
                grid: Grid) -> str:
    """The first rule that leaves ``found.schedule`` without a layout, with its numbers."""
    reason = no_split(gpus, grid, cost_model.gpu.gpus_per_node)
    if reason is not None:
        return reason
    candidates = list(layouts(model, gpus, global_batch, grid, cost_model.gpu.gpus_per_node))
    if not candidates:
        return (f"--global-batch {global_batch} is not divisible by DP x microbatch size for any split "
                f"(--micro-batch {','.join(map(str, grid.micro_batch))}); use a batch divisible by them")
    problems = {c: _problem(found.schedule, c, model, found.vocab_parallel, found.pairs) for c in candidates}
    runnable = [c for c, problem in problems.items() if problem is None]
    if not runnable:
        text, n = Counter(problems.values()).most_common(1)[0]
        share = "every layout" if n == len(candidates) else f"{n} of {len(candidates)} layouts; the rest fail similar rules"
        return f"no layout can run it: {text} ({share})"
    if not any(_static_fits(c, model, cost_model) for c in runnable):
        return (f"weights, gradients and optimizer state alone exceed {cost_model.gpu.name}'s memory in all "
                f"{len(runnable)} runnable layouts; add GPUs or raise TP x PP")
    if found.evaluated:
        least = min(found.evaluated, key=lambda p: p.memory.peak)
        return (f"every layout simulated is out of memory (least: {least.layout} needs "
                f"{least.memory.peak / 2**30:.1f} GiB of {least.capacity / 2**30:.1f} GiB)")
    return f"the {found.schedule} generator could not build any of the {len(runnable)} runnable layouts"


def _problem(name: str, layout: ParallelLayout, model: GPTModel, vocab_parallel: bool = False,
             pairs: bool = False) -> str | None:
    base, _ = split_name(name)
    minimum = SCHEDULES[base].min_microbatches(layout.pp)
    if layout.num_microbatches < minimum:
        return f"{base} at PP {layout.pp} needs >= {minimum} microbatches; raise --global-batch"
    if vocab_parallel and (problem := vocab_problem(layout, model)) is not None:
        return problem
    problem = layout.problem(model, num_stages(name, layout.pp))
    if problem is None and pairs:  # the flag's own rules after the layout's (a layout that cannot run at all)
        problem = pair_problem(name, layout, model)
    return problem
