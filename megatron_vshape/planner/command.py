"""The answer as a command: the flags to add to the user's recipe for one planned configuration.

Megatron-LM's own flags for the parallel sizes, the microbatch size and recomputation, and the
plugin's ``--pipeline-schedule`` / ``--pipeline-layout`` (megatron_vshape.megatron.arguments), with
``--pipeline-vocab-parallel`` for a run with vocabulary parallelism and ``--overlap-moe-expert-parallel-comm``
for a run with overlapped F&B pairs, with the all-to-all the row placed its pairs for as
``--pipeline-costs a2a=X`` (the recipe brings what Megatron wants with it: bf16, an alltoall or
flex dispatcher). Later flags win in argparse, so
appending these to a recipe's command line overrides its own sizes.
"""

from __future__ import annotations

from ..layout_flag import format_layout
from .parallel_layout import ParallelLayout
from .predict import recompute_mode, split_name
from .rows import RowKind


def recipe_flags(schedule: str, layout: ParallelLayout, layers_per_stage: tuple[int, ...] | None = None,
                 vocab_parallel: bool = False, pairs: bool = False, a2a: float = 0.0) -> list[str]:
    """Flags (words) that make a Megatron run use ``schedule`` on ``layout`` with ``layers_per_stage``
    (and vocabulary parallelism with ``vocab_parallel``, F&B pairs with ``pairs``, placed for an all-to-all of
    ``a2a`` x F: ``moe_pairs.run_a2a``)."""
    base, _ = split_name(schedule)
    flags = [
        "--tensor-model-parallel-size", str(layout.tp), "--pipeline-model-parallel-size", str(layout.pp),
        "--context-parallel-size", str(layout.cp), "--expert-model-parallel-size", str(layout.ep),
        "--micro-batch-size", str(layout.micro_batch), "--global-batch-size", str(layout.global_batch),
    ]
    if layout.tp > 1:
        flags.append("--sequence-parallel")  # the cost model assumes it (activations split over TP)
    flags += ["--pipeline-schedule", base]
    if layers_per_stage:
        flags += ["--pipeline-layout", format_layout(layers_per_stage)]
    flag = RowKind(vocab_parallel, pairs).flag
    if flag is not None:
        flags.append(flag)
    if pairs and a2a > 0:  # the run places its pairs for 1 x F unless told the all-to-all the plan costed
        flags += ["--pipeline-costs", f"a2a={a2a:.3g}"]
    mode = recompute_mode(schedule, layout)
    if mode == "selective":
        flags += ["--recompute-granularity", "selective"]
    elif mode == "full":
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    return flags


def command_line(schedule: str, layout: ParallelLayout, layers_per_stage: tuple[int, ...] | None = None,
                 vocab_parallel: bool = False, pairs: bool = False, a2a: float = 0.0) -> str:
    return " ".join(recipe_flags(schedule, layout, layers_per_stage, vocab_parallel, pairs, a2a))
