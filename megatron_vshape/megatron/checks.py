"""The checks on how the plugin's flags combine with Megatron's (pure argparse, no torch or megatron).

Each check takes the parsed args and the derived :class:`Sizes` and returns one line naming the flag
and the fix, or None. :func:`problems` runs them in order; ``arguments.validate`` raises the first as
a :class:`~.flags.ConfigError` before Megatron's own ``validate_args`` runs.

This module holds the checks on sizes, layouts, schedules and run options, and the order they run in;
the checks on Megatron features (``--cpu``, B/W split conflicts, Transformer Engine) are in
``feature_checks``, what every check reads in ``sizes`` and ``flags``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable

from ..schedules.generators.registry import SCHEDULES
from . import hybrid_pattern, moe_overlap, pipeline_layout
from .feature_checks import (
    check_context_parallel,
    check_cpu_backend,
    check_cpu_features,
    check_moe_overlap,
    check_moe_tensor_parallel,
    check_split_conflicts,
    check_te_split,
)
from .flags import (
    AUTO_SCHEDULE,
    MEGATRON_OWN_SCHEDULES,
    SCHEDULE_CHOICES,
    V_SCHEDULE_NAMES,
    ConfigError,
    arg_or,
    parse_pipeline_costs,
    schedule_of,
    splits_backward,
)
from .sizes import Check, Sizes
from .startup_schedule import schedule_for_run
from .vocab_checks import vocab_parallel_problem


def check_known_schedule(args, sizes) -> str | None:
    name = schedule_of(args)
    if name is not None and name not in SCHEDULE_CHOICES:
        return f"--pipeline-schedule: unknown schedule {name!r}; use one of {', '.join(SCHEDULE_CHOICES)}"
    return None


def check_pipeline_size(args, sizes) -> str | None:
    name = schedule_of(args)
    if name is not None and sizes.pp < 2:
        return (f"--pipeline-schedule {name} needs --pipeline-model-parallel-size >= 2 (got {sizes.pp}); "
                "raise it or drop --pipeline-schedule")
    return None


def check_world_size(args, sizes) -> str | None:
    model_parallel = sizes.tp * sizes.pp * sizes.cp
    if sizes.world % model_parallel:
        return (f"--pipeline-model-parallel-size: world size {sizes.world} is not a multiple of TP x PP x CP = "
                f"{model_parallel}; launch a multiple of {model_parallel} ranks")
    return None


def check_memory_limit(args, sizes) -> str | None:
    limit = getattr(args, "pipeline_memory_limit", None)
    name = schedule_of(args)
    if limit is not None and name != AUTO_SCHEDULE:
        return f"--pipeline-memory-limit applies only to --pipeline-schedule {AUTO_SCHEDULE}; drop it or switch schedule"
    if limit is not None and not 0.0 < limit <= 1.0:
        return f"--pipeline-memory-limit must be in (0, 1] (a fraction of 1F1B's peak); got {limit}"
    return None


def accounted_layers(args) -> int:
    """Transformer layers plus the embedding / loss when Megatron counts them as layers in the split."""
    extra = int(bool(getattr(args, "account_for_embedding_in_pipeline_split", False)))
    extra += int(bool(getattr(args, "account_for_loss_in_pipeline_split", False)))
    return getattr(args, "num_layers", 0) + extra


def check_pipeline_layout(args, sizes) -> str | None:
    return pipeline_layout.check(args, sizes.pp)


def check_layout_resolves(args, sizes) -> str | None:
    """``--pipeline-layout balanced``: the planner simulates the schedule, so only on a valid combination."""
    return pipeline_layout.resolve(args, sizes.pp, sizes.num_microbatches)


def check_v_layers(args, sizes) -> str | None:
    name = schedule_of(args)
    if name not in V_SCHEDULE_NAMES or getattr(args, "num_layers", None) is None or pipeline_layout.requested(args):
        return None
    if hybrid_pattern.is_hybrid(args):  # the pattern sets the layers (check_pipeline_layout checks it)
        return None
    total, chunks = accounted_layers(args), 2 * sizes.pp
    if total % chunks:
        counted = "" if total == args.num_layers else f" (+{total - args.num_layers} for embedding/loss = {total})"
        return (f"--num-layers {args.num_layers}{counted} must be divisible by 2 x --pipeline-model-parallel-size "
                f"= {chunks} for {name} (two V chunks per rank); use a multiple of {chunks}, or add "
                "--pipeline-layout balanced to train uneven stages")
    return None


_VIRTUAL_FLAGS = (
    ("num_layers_per_virtual_pipeline_stage", "--num-layers-per-virtual-pipeline-stage"),
    ("num_virtual_stages_per_pipeline_rank", "--num-virtual-stages-per-pipeline-rank"),
    ("virtual_pipeline_model_parallel_size", "--virtual-pipeline-model-parallel-size"),
    ("pipeline_model_parallel_layout", "--pipeline-model-parallel-layout"),
)


def check_v_layout_flags(args, sizes) -> str | None:
    """V schedules fix the virtual pipeline (2 chunks in a V) and the uniform layer split themselves."""
    name = schedule_of(args)
    if name not in V_SCHEDULE_NAMES:
        return None
    for dest, flag in (
        *_VIRTUAL_FLAGS,
        ("decoder_first_pipeline_num_layers", "--decoder-first-pipeline-num-layers"),
        ("decoder_last_pipeline_num_layers", "--decoder-last-pipeline-num-layers"),
        ("microbatch_group_size_per_vp_stage", "--microbatch-group-size-per-virtual-pipeline-stage"),
    ):
        if getattr(args, dest, None) is not None:
            return f"{flag} cannot be combined with --pipeline-schedule {name} (it sets 2 V chunks per rank itself); drop {flag}"
    return None


def check_single_chunk_flags(args, sizes) -> str | None:
    """Looped schedules other than interleaved-1f1b run one model chunk per rank."""
    name = schedule_of(args)
    if name is None or name in V_SCHEDULE_NAMES or name == "interleaved-1f1b":
        return None
    for dest, flag in _VIRTUAL_FLAGS:
        if getattr(args, dest, None) is not None:
            return (f"{flag} gives each rank several model chunks, but {name} runs one; drop {flag} or use "
                    "--pipeline-schedule interleaved-1f1b")
    return None


def check_interleaved_has_chunks(args, sizes) -> str | None:
    if schedule_of(args) != "interleaved-1f1b" or hybrid_pattern.is_hybrid(args):  # HybridModel: the '|' segments
        return None
    if not any(getattr(args, d, None) for d in (
            "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
            "virtual_pipeline_model_parallel_size", "pipeline_model_parallel_layout")):
        return ("--pipeline-schedule interleaved-1f1b needs virtual pipeline chunks; add "
                "--num-virtual-stages-per-pipeline-rank 2 (or another chunk count)")
    return None


def check_microbatches(args, sizes) -> str | None:
    name = schedule_of(args)
    if name is None:
        return None
    if sizes.num_microbatches is None:
        mbs = arg_or(args, "micro_batch_size", 1)
        return (f"--global-batch-size {args.global_batch_size} must be a multiple of --micro-batch-size x "
                f"data-parallel size = {mbs} x {sizes.dp}; change either")
    m, mbs, spec = sizes.num_microbatches, arg_or(args, "micro_batch_size", 1), SCHEDULES[name]
    problem = spec.check(sizes.pp, m)  # the schedule's own size rule (PP = its devices)
    if problem:
        fit = spec.nearest_microbatches(sizes.pp, m)
        return (f"--global-batch-size gives {m} microbatches at PP={sizes.pp}: {problem}; "
                f"use --global-batch-size {fit * mbs * sizes.dp} ({fit} microbatches)")
    return None



def check_pipeline_costs(args, sizes) -> str | None:
    spec, name = getattr(args, "pipeline_costs", None), schedule_of(args)
    if getattr(args, "pipeline_costs_out", None) and spec != "auto":
        return "--pipeline-costs-out writes measured costs; add --pipeline-costs auto or drop --pipeline-costs-out"
    if spec is None:
        return None
    if not splits_backward(name):
        return (f"--pipeline-costs applies to schedules megatron-vshape builds from costs (zb-*, v-*); "
                f"{name or 'the default 1f1b'} does not depend on them; drop --pipeline-costs")
    if spec.strip().lower() == "auto":
        iters = getattr(args, "pipeline_costs_iters", 3)
        if iters < 1:
            return f"--pipeline-costs-iters must be >= 1; got {iters}"
        return None
    try:
        parse_pipeline_costs(spec, moe_overlap.wants_pairs(args))
    except ConfigError as err:
        return str(err)
    return None


WATCHDOG_DEFAULT_SECONDS = {"gpu": 300.0, "cpu": 120.0}


def check_watchdog(args, sizes) -> str | None:
    seconds = getattr(args, "pipeline_watchdog", None)
    if seconds is not None and not (math.isfinite(seconds) and seconds >= 0):
        return f"--pipeline-watchdog must be a number of seconds >= 0 (0 turns it off); got {seconds}"
    return None


def watchdog_seconds(args) -> float:
    """The watchdog timeout in force (0: off)."""
    seconds = getattr(args, "pipeline_watchdog", None)
    if seconds is None:
        return WATCHDOG_DEFAULT_SECONDS["cpu" if getattr(args, "cpu", False) else "gpu"]
    return seconds


def check_save_writable(args, sizes) -> str | None:
    """Refuse an unwritable --save now, not at the first save after hours of training.

    Megatron creates the missing directories itself, so the nearest existing ancestor must be a
    directory we can create a file in (a real probe: catches read-only mounts that mode bits miss).
    """
    save = getattr(args, "save", None)
    if not save:
        return None
    import os
    import tempfile

    probe = os.path.abspath(save)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"--save {save}: {probe} exists and is not a directory; give a directory path"
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as err:
        return f"--save {save}: cannot write into {probe} ({err.strerror}); give a writable directory"
    return None


# The CLI's flag names in generator messages, and the training flags that set the same thing.
_TRAINING_FLAG_NAMES = (("--memory-limit", "--pipeline-memory-limit"), ("--costs", "--pipeline-costs"))


def check_vocab_parallel(args, sizes) -> str | None:
    """``--pipeline-vocab-parallel``: what it cannot run with (vocab_checks.py)."""
    if not getattr(args, "pipeline_vocab_parallel", False):
        return None
    return vocab_parallel_problem(args)


def check_schedule_builds(args, sizes) -> str | None:
    """Build (and validate) the schedule for the run's PP and microbatch count, as iteration 1 will.

    Any ScheduleError a config can cause (v-auto under an unreachable --pipeline-memory-limit, a
    generator that cannot meet its caps at this size) then fails at start-up on every rank, with
    the training flags' names, instead of as a traceback at iteration 1. Runs only on an
    otherwise valid combination (see :func:`problems`); large sizes print progress on rank 0.
    """
    name = schedule_of(args)
    if name is None or name in MEGATRON_OWN_SCHEDULES or sizes.num_microbatches is None:
        return None
    import os

    from ..progress import phase
    from ..schedules.core import inputs
    from ..schedules.lowering.validator import validate

    where = f"--pipeline-schedule {name} at PP={sizes.pp} with {sizes.num_microbatches} microbatches"
    try:
        size = inputs.Size(sizes.pp, sizes.num_microbatches, 2, devices_flag="--pipeline-model-parallel-size",
                           microbatches_flag="microbatches (--global-batch-size / (--micro-batch-size x DP))")
        size.check()
        rank0 = os.environ.get("RANK", "0") == "0"
        with phase(f"checking {where} ({size.passes:,} passes)", size.large and rank0, prefix="megatron-vshape"):
            validate(schedule_for_run(args, sizes))
    except ValueError as err:  # ScheduleError, InvalidSchedule, InputError
        text = " ".join(str(err).split())
        for cli_flag, training_flag in _TRAINING_FLAG_NAMES:
            text = text.replace(cli_flag + " ", training_flag + " ").replace(cli_flag + ":", training_flag + ":")
        return f"{where}: {text}"
    return None


CHECKS: tuple[Check, ...] = (
    check_pipeline_size, check_world_size, check_memory_limit, check_pipeline_layout, check_v_layers,
    check_v_layout_flags, check_single_chunk_flags, check_interleaved_has_chunks, check_microbatches, check_cpu_backend,
    check_cpu_features, check_moe_tensor_parallel, check_context_parallel, check_split_conflicts, check_te_split,
    check_moe_overlap, check_pipeline_costs, check_watchdog, check_save_writable, check_vocab_parallel,
)
# Checks that read what Megatron's validate_args derives (the padded vocabulary, megatron-core 0.19's
# default --tensor-parallel-num-weight-shards): run before it, like every check, and again after it (and before
# any rank builds a model), so a refusal is one line whichever of the two sees the problem first.
AFTER_MEGATRON_CHECKS: tuple[Check, ...] = (check_vocab_parallel,)
# Run only when CHECKS found nothing: building the schedule can take seconds at large sizes.
FINAL_CHECKS: tuple[Check, ...] = (check_layout_resolves, check_schedule_builds)


def problems(args: argparse.Namespace, checks: Iterable[Check] = CHECKS) -> list[str]:
    """Every problem with ``args`` (one line each), in check order; empty when the combination is valid."""
    sizes = Sizes.from_args(args)
    unknown = check_known_schedule(args, sizes)
    if unknown:  # the other checks look the schedule up; one clear line is enough
        return [unknown]
    found = [msg for check in checks if (msg := check(args, sizes)) is not None]
    if not found and checks is CHECKS:
        for check in FINAL_CHECKS:  # in order, first problem only: the schedule check needs the layout
            if (msg := check(args, sizes)) is not None:
                found = [msg]
                break
    return found


