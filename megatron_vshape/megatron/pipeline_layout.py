"""``--pipeline-layout uniform|balanced|N0,N1,...`` in training: transformer layers per pipeline stage.

Counts are per *global* stage, in the schedule's stage order: 2d numbers for a V schedule (device
i holds stages i and 2d-1-i), d for 1F1B/ZB, d*v for interleaved-1f1b with v chunks per rank.
``uniform`` (the default) is today's behaviour, untouched. ``balanced`` asks the planner
(:func:`megatron_vshape.planner.balance.choose_layout`) for the counts with the shortest predicted
iteration, the LM head and loss included.

How the counts reach Megatron: :func:`apply` sets Megatron's own ``--pipeline-model-parallel-layout``
(``E``/``t``/``L`` text, looped stage order = our global stage order), from which Megatron derives
the virtual pipeline size and validates the split; on a V the model is built with
:class:`megatron_vshape.runtime.layer_layout.VShapeLayerLayout` (see :mod:`.install`).

Pure Python (no torch, no megatron import): the checks run on every rank before anything starts.
"""

from __future__ import annotations

from ..layout_flag import BALANCED, FLAG, format_layout, parse_layout
from ..schedules.core.schedule import PlacementKind
from ..schedules.generators.registry import SCHEDULES
from . import hybrid_pattern

UNIFORM = "uniform"
# Megatron's own ways of splitting layers unevenly; they do not know the V placement, and Megatron
# refuses most of them next to a layout. (dest, flag)
CONFLICTING_FLAGS = (
    ("decoder_first_pipeline_num_layers", "--decoder-first-pipeline-num-layers"),
    ("decoder_last_pipeline_num_layers", "--decoder-last-pipeline-num-layers"),
    ("pipeline_model_parallel_layout", "--pipeline-model-parallel-layout"),
    ("account_for_embedding_in_pipeline_split", "--account-for-embedding-in-pipeline-split"),
    ("account_for_loss_in_pipeline_split", "--account-for-loss-in-pipeline-split"),
    ("num_layers_per_virtual_pipeline_stage", "--num-layers-per-virtual-pipeline-stage"),
)
_RESOLVED = "_vshape_layout_counts"  # cache on args: counts chosen (None: uniform)


class LayoutError(ValueError):
    """One line naming --pipeline-layout (arguments.py turns it into a ConfigError)."""


def requested(args) -> bool:
    """True when --pipeline-layout asks for anything but today's uniform split."""
    text = getattr(args, "pipeline_layout", None)
    return text is not None and text.strip().lower() != UNIFORM


def _is_v(name: str | None) -> bool:
    return name in SCHEDULES and SCHEDULES[name].placement is PlacementKind.V


def num_stages(args, pp: int) -> int:
    """Global stages of the run's schedule: 2d on a V, d*v for interleaved-1f1b, else d."""
    return SCHEDULES[args.pipeline_schedule].num_stages(pp, getattr(args, "num_virtual_stages_per_pipeline_rank", None) or 1)


def check(args, pp: int) -> str | None:
    """Flag combinations and explicit counts (cheap); ``balanced`` is resolved by :func:`resolve`."""
    if hybrid_pattern.is_hybrid(args):  # HybridModel: the stages are the pattern's '|' segments
        return hybrid_pattern.check(args, pp)
    if not requested(args):
        return None
    text = args.pipeline_layout.strip()
    if args.pipeline_schedule is None:
        return (f"{FLAG} {text} needs --pipeline-schedule (e.g. --pipeline-schedule 1f1b); add it, or use "
                "Megatron's own --pipeline-model-parallel-layout without --pipeline-layout")
    for dest, flag in CONFLICTING_FLAGS:
        if getattr(args, dest, None):
            return f"{flag} cannot be combined with {FLAG} (both set layers per stage); drop {flag}"
    if (getattr(args, "pipeline_costs", None) or "").strip().lower() == "auto":
        # Re-planning times passes per V chunk and keeps the slowest rank: with uneven stages that
        # mixes stage sizes into one base cost and drops the per-stage work (not built yet).
        return (f"--pipeline-costs auto cannot re-plan an uneven {FLAG} yet; give the costs by hand "
                "(--pipeline-costs f=..,b=..,w=..,comm=..) or use the uniform layout")
    if args.pipeline_schedule == "interleaved-1f1b" and not getattr(args, "num_virtual_stages_per_pipeline_rank", None):
        return (f"{FLAG} with interleaved-1f1b counts layers per chunk; give the chunks with "
                "--num-virtual-stages-per-pipeline-rank V (then PP x V numbers)")
    try:
        counts = parse_layout(text, args.num_layers, num_stages(args, pp))
    except ValueError as err:
        return str(err)
    if counts != BALANCED:
        setattr(args, _RESOLVED, _uneven(counts))
    return None


def resolve(args, pp: int, num_microbatches: int) -> str | None:
    """Choose the ``balanced`` counts (the planner simulates the schedule); None when all is well."""
    if not requested(args) or hasattr(args, _RESOLVED) or hybrid_pattern.is_hybrid(args):
        return None
    try:
        model = planner_model(args)
        from ..planner.balance import choose_layout

        limit = getattr(args, "pipeline_memory_limit", None)
        choice = choose_layout(model, args.pipeline_schedule, pp, num_microbatches, memory_limit=limit)
    except LayoutError as err:
        return str(err)
    except ValueError as err:  # ScheduleError, planner input errors: one line
        return f"{FLAG} {BALANCED}: " + " ".join(str(err).split())
    setattr(args, _RESOLVED, _uneven(choice.layers_per_stage))
    return None


def counts(args) -> tuple[int, ...] | None:
    """The layer counts in force (None: the uniform split, Megatron's default path)."""
    return getattr(args, _RESOLVED, None)


def _uneven(layers) -> tuple[int, ...] | None:
    layers = tuple(int(n) for n in layers)
    return None if len(set(layers)) == 1 else layers


def planner_model(args):
    """The planner's GPT description of the run (for ``balanced`` and for per-stage work)."""
    from ..planner.model import GPTModel

    vocab = getattr(args, "padded_vocab_size", None) or getattr(args, "vocab_size", None)
    if not vocab:
        raise LayoutError(f"{FLAG} {BALANCED} weighs the LM head by the vocabulary, unknown before the tokenizer "
                          "loads; give --vocab-size N or explicit counts N0,N1,...")
    if not args.num_layers:  # HybridModel: the layers come from --hybrid-layer-pattern, not GPT's FLOPs model
        raise LayoutError(f"{FLAG} {BALANCED} weighs GPT layers; this model gives no --num-layers")
    return GPTModel("training", args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length, vocab)


def stage_works(args, layers):
    """Per-stage work multipliers of ``layers`` from the planner's FLOPs model (LM head included, unless
    --pipeline-vocab-parallel spreads it over every rank: then the layers' alone), or None when the
    planner cannot describe the model (the caller then scales by layer count)."""
    try:
        model = planner_model(args)
        from ..planner.balance import stage_work
    except (ImportError, ValueError):
        return None
    # With --pipeline-vocab-parallel the stages hold the layers alone (no head, no logits), as the planner costs it.
    return stage_work(model, layers, vocab_parallel=bool(getattr(args, "pipeline_vocab_parallel", False)))


def vocab_work(args):
    """The vocabulary passes' work under --pipeline-vocab-parallel, from the planner's FLOPs model: the LM
    head's F, B, W over the whole vocabulary per V chunk's layers, and the logits a microbatch holds from
    its H to its G per V chunk's activation. Default costs (time 1) when the model is not known."""
    from ..schedules.core.schedule import VocabWork

    try:
        model = planner_model(args)
        from ..planner.balance import StageExtras
    except (ImportError, ValueError):
        return VocabWork(1.0, 1.0, 1.0, 0.0)
    chunk_layers = model.layers / (2 * max(1, int(getattr(args, "pipeline_model_parallel_size", 1) or 1)))
    head = StageExtras.from_flops(model).head
    memory = model.logits_bytes(1, 1) / (chunk_layers * model.activation_bytes(1, 1, False))
    return VocabWork(*(x / chunk_layers for x in head), memory=memory)


def apply(args) -> None:
    """Hand uneven counts to Megatron as its own layout (before Megatron's validate_args); on HybridModel
    as the pattern's '|' segments (:func:`hybrid_pattern.apply`)."""
    if hybrid_pattern.is_hybrid(args):
        hybrid_pattern.apply(args)
        return
    layers = counts(args)
    if layers is None:
        return
    args.pipeline_model_parallel_layout = megatron_layout_text(layers)
    # Megatron derives the virtual pipeline size from the layout and refuses both at once.
    args.num_virtual_stages_per_pipeline_rank = None


def megatron_layout_text(layers) -> str:
    """Megatron's ``--pipeline-model-parallel-layout`` for ``layers``: ``E`` first, ``L`` last, ``|`` between stages."""
    stages = ["t" * int(n) for n in layers]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "L"
    return "|".join(stages)


def describe(args) -> str:
    """One line for the start-up log."""
    layers = counts(args)
    if layers is None:
        return "pipeline layout: uniform"
    where = " (V: device i holds stages i and 2d-1-i)" if _is_v(args.pipeline_schedule) else ""
    return f"pipeline layout: {format_layout(layers)} transformer layers per stage{where}"


# A stage without transformer layers still runs its embedding or head; the schedule core takes
# only positive multipliers, so such a stage counts as this fraction of a uniform stage.
MIN_STAGE_WORK = 1e-3


def layout_costs(costs, layers, works=None):
    """``costs`` with per-stage work for a schedule whose stages hold ``layers`` transformer layers.

    ``costs`` are for one uniform stage (``sum(layers) / len(layers)`` layers). ``works`` (one
    ``StageWork`` per stage, e.g. :func:`stage_works`, which adds the LM head) replaces the default:
    F, B, W and memory in proportion to each stage's layer count. Without ``works`` a uniform layout
    returns ``costs`` unchanged, so today's schedules are built.
    """
    from ..schedules.core.schedule import StageWork

    layers = tuple(layers)
    if works is None:
        if len(set(layers)) == 1:
            return costs
        unit = sum(layers) / len(layers)
        works = tuple(StageWork(*(max(n / unit, MIN_STAGE_WORK),) * 4) for n in layers)
    return costs.with_stages(works)


def schedule_costs(args, costs):
    """The costs the run's schedule is built from: ``costs`` plus per-stage work when the layout is uneven
    (the planner's FLOPs model with the LM head, or layer counts alone when it cannot describe the model)."""
    layers = counts(args)
    if layers is None:
        return costs
    return layout_costs(costs, layers, stage_works(args, layers))
