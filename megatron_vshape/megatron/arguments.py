"""The plugin's command-line flags, and ``validate``: the checks of :mod:`.checks`, then the defaults resolved.

Pure argparse: no torch or megatron import, so the checks run (and fail) in milliseconds on every
rank before anything is initialised. A bad combination raises :class:`ConfigError` whose message is
one line naming the flag and the fix; entry points turn it into ``exit(2)`` (see :func:`exit_on_error`).
The names every module here shares (schedule names, :class:`ConfigError`, a flag's effective value) are in
:mod:`.flags`, below the checks; this module sits above them.

Flags added by :func:`add_arguments`:

``--pipeline-schedule NAME``  which pipeline schedule runs; default: unset = Megatron's own behaviour.
``--pipeline-memory-limit F``  for ``v-auto``: activation memory cap as a fraction of 1F1B's peak.
``--cpu``                      CPU mode: gloo, torch layers, fp32; see :data:`CPU_OVERRIDES`.
``--[no-]schedule-invariant-dropout``  reseed dropout per (seed, iteration, microbatch, layer);
``--[no-]schedule-invariant-init``     initialise weights per (seed, global layer); both on by default
                               with --pipeline-schedule, so every schedule computes the same losses.
``--pipeline-costs auto|f=..,b=..,w=..,comm=..``  the costs the schedule is built from: measured during
                               the first iterations (``auto``, see ``runtime.replan``) or given by hand.
``--pipeline-costs-iters N``   iterations measured for ``auto`` (after one warm-up; default 3).
``--pipeline-costs-out PATH``  write the measured costs as JSON (``vshape simulate --costs-from PATH``).
``--pipeline-layout uniform|balanced|N0,N1,...``  transformer layers per pipeline stage (see :mod:`.layout`).
``--pipeline-watchdog SECONDS``  report where a stuck pipeline is, on every rank, and end the job
                               (default 300 on GPU, 120 with --cpu; 0 turns it off).
``--pipeline-vocab-parallel``  the vocabulary layers sharded over the pipeline ranks, as passes of the schedule.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

from ..schedules.generators.registry import SCHEDULES
from . import hybrid_pattern, pipeline_layout
from .checks import AFTER_MEGATRON_CHECKS, problems
from .feature_checks import SplitRoute, split_route, split_route_reason, uses_split_spec
from .flags import (
    CPU_DEFAULTS,
    CPU_OVERRIDES,
    MEGATRON_OWN_SCHEDULES,
    SCHEDULE_CHOICES,
    SPLIT_SPEC_ARG,
    TE_SPLIT_SPEC_ARG,
    V_SCHEDULE_NAMES,
    ConfigError,
    DefaultInt,
    DefaultStr,
    effective,
    mark_default,
    schedule_of,
    splits_backward,
)


def _schedule_name(text: str) -> str:
    # Normalise only; unknown names are rejected in validate() with a one-line error instead of
    # argparse's "invalid choice", which would print Megatron's several-hundred-flag usage first.
    return text.strip().lower().replace("_", "-")


def _help_schedules() -> str:
    lines = []
    for name in SCHEDULE_CHOICES:
        engine = "Megatron's own function" if name in MEGATRON_OWN_SCHEDULES else "megatron-vshape executor"
        lines.append(f"{name} ({SCHEDULES[name].description}; runs on {engine})")
    return "; ".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the plugin's flags to ``parser`` (Megatron's ``extra_args_provider`` contract) and return it."""
    group = parser.add_argument_group("megatron-vshape", "pipeline schedules with controllable memory")
    group.add_argument(
        "--pipeline-schedule", type=_schedule_name, default=None, metavar="NAME",
        help="Pipeline schedule, one of: " + _help_schedules() + ". Default: unset, Megatron's own "
        "1F1B (or interleaved 1F1B with virtual pipeline flags), unchanged. V schedules (v-*) place "
        "two model chunks per rank in a V (rank i holds stages i and 2*PP-1-i) and need "
        "--num-layers divisible by 2*PP.",
    )
    group.add_argument(
        "--pipeline-memory-limit", type=float, default=None, metavar="FRACTION",
        help="Only with --pipeline-schedule v-auto: peak activation memory allowed, as a fraction in "
        "(0, 1] of 1F1B's peak (default 1); v-auto picks the lowest-bubble V schedule under it.",
    )
    group.add_argument(
        "--cpu", action="store_true",
        help="CPU mode: train on CPU with the gloo backend (megatron.training 0.19.x), torch layers "
        "(--transformer-impl local), fp32, CUDA-only fusions off, --eval-iters 2 unless given. For tests "
        "and small experiments.",
    )
    group.add_argument(
        "--schedule-invariant-dropout", dest="schedule_invariant_dropout", action="store_true", default=None,
        help="Reseed dropout at each transformer layer's forward from (seed, iteration, microbatch, "
        "global layer), so every schedule computes the same masks and the same losses. Default: on "
        "with --pipeline-schedule, off otherwise.",
    )
    group.add_argument("--no-schedule-invariant-dropout", dest="schedule_invariant_dropout", action="store_false")
    group.add_argument(
        "--schedule-invariant-init", dest="schedule_invariant_init", action="store_true", default=None,
        help="Initialise each transformer layer (and the embedding and output layer) from a stream seeded "
        "by (seed, global layer), so every pipeline placement starts from the same weights. Default: on "
        "with --pipeline-schedule, off otherwise.",
    )
    group.add_argument("--no-schedule-invariant-init", dest="schedule_invariant_init", action="store_false")
    group.add_argument(
        "--pipeline-costs", default=None, metavar="auto|f=..,b=..,w=..,comm=..",
        help="Costs the schedule is built from (F, B, W per V chunk of layers and one p2p message, any "
        "unit). 'auto': time them during the first iterations (max over ranks), rebuild the schedule "
        "and log the old and new predicted bubble. Default: F=B=W=1, comm=0. Only for schedules that "
        "megatron-vshape runs and that split the backward.",
    )
    group.add_argument("--pipeline-costs-iters", type=int, default=3, metavar="N",
                       help="With --pipeline-costs auto: iterations to measure, after one warm-up (default 3).")
    group.add_argument(
        "--pipeline-watchdog", type=float, default=None, metavar="SECONDS",
        help="When a schedule run by megatron-vshape makes no progress (a pass, a p2p operation or the "
        "gradient reduction) for SECONDS, every rank prints one line saying where it is and what it "
        "waits for, and the job ends with exit code 3. Default 300 (120 with --cpu); 0 turns it off.",
    )
    group.add_argument("--pipeline-costs-out", default=None, metavar="PATH",
                       help="With --pipeline-costs auto: write the measured costs here as JSON, for "
                       "`vshape simulate --costs-from PATH`.")
    group.add_argument(
        "--pipeline-layout", default="uniform", metavar="uniform|balanced|N0,N1,...",
        help="Transformer layers per pipeline stage, in the schedule's global stage order: 2*PP numbers for "
        "a V schedule (rank i holds stages i and 2*PP-1-i), PP for 1F1B/ZB, PP*V for interleaved-1f1b. "
        "'uniform' (default): the same on every stage, as today. 'balanced': the counts with the shortest "
        "predicted iteration, counting the embedding, LM head and loss (needs --vocab-size). The first and "
        "last stage may hold 0 layers. Passed to Megatron as its --pipeline-model-parallel-layout.",
    )
    group.add_argument(
        "--pipeline-vocab-parallel", action="store_true", default=False,
        help="Vocabulary parallelism (Yeung et al., MLSys 2025): the input embedding, the output layer and the "
        "cross-entropy are sharded by vocabulary rows over the pipeline ranks (on top of TP) and run as passes "
        "of the schedule on every rank, so neither the first nor the last stage carries them. Every schedule "
        "megatron-vshape runs; with it, 1f1b and interleaved-1f1b run on megatron-vshape's executor too. "
        "Checkpoints keep Megatron's layout (resume with or without the flag).",
    )
    # Mark Megatron's defaults of the flags --cpu changes as "not given": they still *are* Megatron's
    # values (equal strings / ints), so nothing changes for code that never calls validate(), but
    # --cpu can now pick gloo without overriding an explicit --distributed-backend (which it rejects).
    for action in parser._actions:
        if action.dest in CPU_DEFAULTS and action.default is not None:
            action.default = mark_default(action.default)
            if action.type is not None:  # argparse runs string defaults through ``type``: keep the mark
                action.type = _keep_mark(action.type)
    return parser


def _keep_mark(convert):
    @functools.wraps(convert)
    def typed(value):
        result = convert(value)
        return mark_default(result) if isinstance(value, (DefaultStr, DefaultInt)) else result

    return typed


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Apply --cpu's settings and unmark the defaults add_arguments marked. Idempotent."""
    cpu = getattr(args, "cpu", False)
    for dest in CPU_DEFAULTS:
        value = getattr(args, dest, None)
        if isinstance(value, (DefaultStr, DefaultInt)):  # plain values again: args get pickled into checkpoints
            setattr(args, dest, effective(args, dest) if cpu else type(value).__mro__[1](value))
    if cpu:
        for dest, value in CPU_OVERRIDES.items():
            if hasattr(args, dest):
                setattr(args, dest, value)
    if schedule_of(args) in V_SCHEDULE_NAMES:
        # Megatron builds two model chunks per rank (vp_stage 0 and 1); install() gives them V layers.
        args.num_virtual_stages_per_pipeline_rank = 2
    pipeline_layout.apply(args)  # uneven --pipeline-layout: Megatron's own layout flag (2 chunks follow from it)
    if hybrid_pattern.is_hybrid(args):
        # HybridModel: torch layers on CPU, megatron's linears for a split schedule on TE (hybrid_spec).
        args.spec = hybrid_pattern.spec_arg(args, splits_backward(schedule_of(args)))
    elif split_route(args) is SplitRoute.TE_DEFERRAL:
        # TE >= 2.3: TE's own linears, each deferring its W to backward_dw() (layer_spec's TE split spec).
        args.spec = list(TE_SPLIT_SPEC_ARG)
    elif uses_split_spec(args):
        # TE's linears would keep W in B: megatron's linears with TE attention and norms instead
        # (megatron_vshape.megatron.layer_spec), through Megatron's own --spec.
        args.spec = list(SPLIT_SPEC_ARG)
        if getattr(args, "rank", 0) == 0:  # one line saying why TE's own deferral is not used
            print(f" [vshape] {split_route_reason(args)}", flush=True)
    for dest in ("schedule_invariant_dropout", "schedule_invariant_init"):
        if getattr(args, dest, None) is None:
            setattr(args, dest, schedule_of(args) is not None)
    return args


def validate(args: argparse.Namespace) -> argparse.Namespace:
    """Check the combination (raising ConfigError with the first problem), then resolve defaults.

    Call it before Megatron's own validate_args, so our one-line errors come before its asserts.
    """
    if getattr(args, "_vshape_validated", False):  # idempotent: resolve_defaults sets VPP for V schedules
        return args
    found = problems(args)
    if found:
        raise ConfigError(found[0])
    resolve_defaults(args)
    args._vshape_validated = True
    return args


def validate_after_megatron(args: argparse.Namespace) -> None:
    """The checks that read what Megatron's own validation derived, again (raising ConfigError)."""
    found = problems(args, AFTER_MEGATRON_CHECKS)
    if found:
        raise ConfigError(found[0])


def exit_on_error(func: Callable, *a, **kw):
    """Run ``func``; on ConfigError print ``error: <line>`` to stderr and exit 2 (every rank does this)."""
    try:
        return func(*a, **kw)
    except ConfigError as err:
        print(f"megatron-vshape error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
