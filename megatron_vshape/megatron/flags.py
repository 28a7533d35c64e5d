"""The vocabulary every part of the plugin's Megatron glue shares: the schedule names, what a flag's
value means (given or defaulted, its value under ``--cpu``), ``--pipeline-costs``' parser, and
:class:`ConfigError`, the one-line error every check raises.

The bottom of ``megatron/``: pure argparse, no torch or megatron, and nothing of the other modules
here. The flags themselves are added (and their combinations checked) above it, in ``arguments``,
``checks`` and ``feature_checks``.
"""

from __future__ import annotations

import argparse

from ..schedules.core.schedule import Costs, PlacementKind
from ..schedules.generators.registry import SCHEDULES, fuses_backward

# Schedules that keep Megatron's own forward_backward functions (install() does not replace them).
MEGATRON_OWN_SCHEDULES = ("1f1b", "interleaved-1f1b")
# The adaptive V schedule, the one that takes --pipeline-memory-limit.
AUTO_SCHEDULE = "v-auto"
SCHEDULE_CHOICES = tuple(SCHEDULES)
V_SCHEDULE_NAMES = tuple(n for n, s in SCHEDULES.items() if s.placement is PlacementKind.V)
# Megatron's --spec for split schedules on Transformer Engine (see megatron_vshape.megatron.layer_spec).
SPLIT_SPEC_ARG = ["megatron_vshape.megatron.layer_spec", "gpt_split_layer_spec"]

# What --cpu always changes: CUDA-only fusions off.
CPU_OVERRIDES = {
    "gradient_accumulation_fusion": False,  # the fused wgrad kernel is CUDA-only
    "no_persist_layer_norm": True,
    "bias_gelu_fusion": False,
    "bias_swiglu_fusion": False,
    "masked_softmax_fusion": False,
    "bias_dropout_fusion": False,
    "apply_rope_fusion": False,
    "cross_entropy_loss_fusion": False,
}


# Megatron's --spec for split schedules on Transformer Engine >= 2.3 (TE's linears, TE's deferred W).
TE_SPLIT_SPEC_ARG = ["megatron_vshape.megatron.layer_spec", "gpt_te_split_layer_spec"]


class ConfigError(ValueError):
    """An invalid flag combination; ``str(err)`` is a single line: ``--flag: problem; fix``."""


# Flags whose default --cpu changes, unless given: dest -> value under --cpu.
CPU_DEFAULTS = {
    "distributed_backend": "gloo",
    "transformer_impl": "local",
    "eval_iters": 2,  # a tiny CPU run should not spend most of its time in 2 x 100 evaluation steps
}


class DefaultStr(str):
    """A string default that was not given on the command line."""


class DefaultInt(int):
    """An int default that was not given on the command line."""


def mark_default(value):
    if isinstance(value, str):
        return DefaultStr(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return DefaultInt(value)
    return value


def was_given(args, dest: str) -> bool:
    """False when ``dest`` still holds the default add_arguments marked."""
    return not isinstance(getattr(args, dest, None), (DefaultStr, DefaultInt))


def effective(args, dest: str):
    """The value ``dest`` has once resolve_defaults ran (``--cpu`` replaces defaults not given)."""
    value = getattr(args, dest, None)
    if getattr(args, "cpu", False) and dest in CPU_DEFAULTS and not was_given(args, dest):
        return CPU_DEFAULTS[dest]
    return value


def arg_or(args: argparse.Namespace, name: str, default):
    """``args.name``, or ``default`` when it is missing or None (flags Megatron has not parsed yet)."""
    value = getattr(args, name, None)
    return default if value is None else value


def schedule_of(args) -> str | None:
    """The --pipeline-schedule given (None: Megatron's default schedule)."""
    return getattr(args, "pipeline_schedule", None)


def splits_backward(name: str | None) -> bool:
    """Whether schedule ``name`` runs B and W apart (megatron-vshape's zb-* and v-* schedules)."""
    if name is None or name in MEGATRON_OWN_SCHEDULES:
        return False
    return not fuses_backward(name)


def parse_pipeline_costs(text: str, pairs: bool = False):
    """``Costs`` from ``--pipeline-costs f=..,b=..`` (``auto`` is handled by the caller). ``pairs``: the run
    builds overlapped F&B pairs (``--overlap-moe-expert-parallel-comm`` under a V schedule, moe_overlap.py),
    the only case an ``a2a`` shapes anything."""
    try:
        costs = Costs.parse(text)
    except ValueError as err:
        raise ConfigError(f"--pipeline-costs: {str(err).removeprefix('--costs: ')}") from None
    if costs.a2a and not pairs:  # without pairs a2a would only stretch F and B in the order's timing
        raise ConfigError("--pipeline-costs: a2a (the MoE all-to-all that overlapped F&B pairs hide) places pairs only "
                          "with --overlap-moe-expert-parallel-comm under a V schedule; add that flag or drop a2a")
    return costs
