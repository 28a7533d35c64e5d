"""``vshape plan`` from Megatron flags (``-- <flags>`` or ``--from-recipe FILE.sh``): what to search, and
the answer printed as the flags to add to the recipe.

The recipe says the model, the batch, FP8, the attention backend, the DP overlap flags and the
distributed optimizer; the search tries every TP, CP, PP, EP, microbatch size and recomputation
mode (none, selective, full) per schedule, on uneven layouts where the layers do not divide. The
recipe's own parallel sizes and recomputation are not constraints: they are what the plan replaces.
"""

from __future__ import annotations

from dataclasses import dataclass

from .command import command_line
from .costs import CostModel
from .layer_layout_mfu import LayoutComparison
from .megatron_args import ParsedFlags, parse_flags
from .model import GPTModel
from .moe_pairs import run_a2a
from .recipe import recipe_flags
from .search import Grid, ScheduleSearch

# The schedules a recipe plan compares: Megatron's own 1F1B, zero-bubble, and the V family.
RECIPE_SCHEDULES = ("1f1b", "zb-1p", "v-min", "v-half", "v-zb")
RECOMPUTE_MODES = ("none", "selective", "full")
DEFAULT_GPU = "h100"
# The search stops once its best MFU is within 2 % of every unexplored configuration's bound: the
# wide grid has hundreds of near-equal bounds, each a simulation (seconds at large PP).
SEARCH_TOLERANCE = 0.02  # the recipes' own GPU (train_llama3_8b_h100_fp8.sh)


@dataclass(frozen=True)
class RecipeInputs:
    flags: ParsedFlags
    source: str  # "FILE.sh" or "command line"

    @property
    def model(self) -> GPTModel:
        return self.flags.model


def read_inputs(megatron_argv: list[str], from_recipe: str | None, use_megatron: bool = True) -> RecipeInputs:
    """Flags from the recipe file (if any) followed by those after ``--`` (later ones win)."""
    argv = (recipe_flags(from_recipe) if from_recipe else []) + list(megatron_argv)
    return RecipeInputs(parse_flags(argv, use_megatron), from_recipe or "command line")


def cost_model_for(flags: ParsedFlags, base: CostModel) -> CostModel:
    """``base`` (GPU, efficiency, bandwidth) with the recipe's precision, optimizer and DP overlap."""
    return CostModel(base.gpu, base.efficiency, base.bandwidth_efficiency,
                     flags.distributed_optimizer and base.distributed_optimizer, base.blocking_p2p,
                     base.hbm_efficiency, flags.fp8, flags.overlap_grad_reduce, flags.overlap_param_gather,
                     2 if flags.grad_reduce_in_bf16 else 4)


def grid_for(model: GPTModel, tp, pp, dp, micro_batch, cp, ep, recompute) -> Grid:
    """The search grid: the user's lists where given, else every CP up to 8, every EP dividing the
    experts, and every recomputation mode."""
    experts = model.num_experts
    ep_default = tuple(e for e in (1, 2, 4, 8, 16, 32, 64) if experts and experts % e == 0) or (1,)
    return Grid(tp, pp, dp, tuple(micro_batch), tuple(cp or (1, 2, 4, 8)), tuple(ep or ep_default),
                tuple(recompute or RECOMPUTE_MODES), tolerance=SEARCH_TOLERANCE)


def header(inputs: RecipeInputs, cost_model: CostModel, gpus: int, global_batch: int) -> str:
    m, f = inputs.model, inputs.flags
    parts = [f"{m.layers} layers", f"h {m.hidden}", f"{m.heads} heads"]
    if m.groups != m.heads:
        parts.append(f"{m.groups} query groups")
    parts.append(f"FFN {m.shape.ffn_hidden}{' SwiGLU' if m.swiglu else ''}")
    if m.num_experts:
        parts.append(f"{m.num_experts} experts top-{m.moe_topk}")
    if m.pattern:
        parts.append(f"pattern {m.pattern}")
    features = [x for x, on in (("FP8", f.fp8), ("flash attention", f.flash_attention),
                                ("distributed optimizer", cost_model.distributed_optimizer),
                                ("overlap-grad-reduce", f.overlap_grad_reduce),
                                ("overlap-param-gather", f.overlap_param_gather)) if on]
    lines = [f"{inputs.source} ({f.parser}): {', '.join(parts)}, seq {m.seq_length}, vocab {m.padded_vocab} "
             f"({m.total_params / 1e9:.1f}B parameters) on {gpus} x {cost_model.gpu.name}, global batch "
             f"{global_batch}, {cost_model.efficiency:.1%} of peak for the GEMMs; {', '.join(features) or 'bf16'}"]
    lines += [f"note: {n}" for n in f.notes]
    return "\n".join(lines)


def commands(results: list[ScheduleSearch], comparisons: dict) -> str:
    """Per row with a plan: the flags to add to the recipe, with the better of the search's layout
    and the balance search's (which starts from the uniform layout, not the search's); a row with
    ``+vocab`` adds ``--pipeline-vocab-parallel`` (its layout is the layers' own: nothing to balance), one with
    ``+pairs`` ``--overlap-moe-expert-parallel-comm``.
    ``comparisons``: the layout table's entries by row name."""
    lines = ["", "Flags to add to the recipe (per row; later flags override the recipe's own):"]
    for found in sorted(results, key=lambda r: -(r.best.mfu if r.best else -1)):
        if found.best is None:
            continue
        comparison = comparisons.get(found.label)
        layers = found.best.layers_per_stage  # the search's proportional layout (its row's MFU)
        if isinstance(comparison, LayoutComparison) and comparison.balanced_mfu >= found.best.mfu:
            layers = comparison.choice.layers_per_stage  # the balance search found better
        a2a = run_a2a(found.best.pass_times) if found.pairs else 0.0
        flags = command_line(found.schedule, found.best.layout, layers or None, found.vocab_parallel, found.pairs, a2a)
        lines.append(f"{found.label:<16s} {flags}")
    return "\n".join(lines)
