"""``--overlap-moe-expert-parallel-comm`` under the project's schedules (issue 43): which run it, and its costs.

Megatron's own interleaved 1F1B runs the flag with its combined 1F1B. Under a V schedule the executor runs
every training F and B, and each overlapped F&B pair, through the same ``combined_forward_backward_step``
(``runtime/combined_step.py``), and the schedule is built with the pairs (``schedules/generators/pairing.py``,
at an all-to-all cost of ``DEFAULT_A2A`` x F unless ``--pipeline-costs`` gives an ``a2a``).

Refused in one line:

* one-chunk schedules (gpipe, zb-h1, zb-1p, zb-2p): Megatron's config check wants virtual stages at PP > 1
  (its combined 1F1B is for its interleaved order), and these place one model chunk per pipeline rank;
* HybridModel (``--hybrid-layer-pattern``): it has no schedule plans (megatron-core 0.19.2, main at d98e8a64);
* Transformer Engine's deferral route: its linears defer W through ``backward_dw()``, which the schedule plan
  calls inside the pair (the split layer spec's megatron linears keep W for the schedule);
* a megatron-core without ``combined_1f1b.combined_forward_backward_step`` (0.16.1).

``--pipeline-vocab-parallel`` with the flag is refused by ``vocab_checks.py``.
"""

from __future__ import annotations

from ..planner.moe_pairs import FLAG, PAIRING_SCHEDULES  # the plan's +pairs rows: the same schedules
from . import hybrid_pattern
from .flags import MEGATRON_OWN_SCHEDULES, schedule_of

# The all-to-all time of each F and each B in units of F, when --pipeline-costs gives none: about DeepSeek-V3's
# 1:1 of computation to communication with expert parallelism across nodes (issue 43). It only shapes the
# order (where pairs go); the run's numbers come from running it.
DEFAULT_A2A = 1.0


def wants_pairs(args) -> bool:
    """True when this run's schedule is built with overlapped F&B pairs (the flag, under a V schedule)."""
    return bool(getattr(args, "overlap_moe_expert_parallel_comm", False)) and schedule_of(args) in PAIRING_SCHEDULES


def combined_step_missing() -> str | None:
    """Why the running megatron-core cannot run the flag under the executor (None: it can)."""
    from .patches import PATCHES, Group, problem

    return next((why for patch in PATCHES if patch.group is Group.MOE_OVERLAP
                 if (why := problem(patch)) is not None), None)


def problem(args, te_deferral) -> str | None:
    """One line when ``--overlap-moe-expert-parallel-comm`` cannot run with this schedule and model
    (``te_deferral()``: whether the run takes Transformer Engine's deferral route; the start-up check is
    ``feature_checks.check_moe_overlap``)."""
    if not getattr(args, "overlap_moe_expert_parallel_comm", False):
        return None
    name = schedule_of(args)
    if name is None or (name in MEGATRON_OWN_SCHEDULES and not getattr(args, "pipeline_vocab_parallel", False)):
        return None  # Megatron's own schedule: its own rules
    if name not in PAIRING_SCHEDULES:
        return (f"{FLAG} runs under the V schedules ({', '.join(PAIRING_SCHEDULES)}) and Megatron's interleaved-1f1b: "
                f"--pipeline-schedule {name} places one model chunk per pipeline rank, and Megatron's combined 1F1B "
                "needs virtual stages at PP > 1; use one of those schedules or drop the flag")
    if hybrid_pattern.is_hybrid(args):
        return (f"{FLAG} needs the model's schedule plans, which HybridModel ({hybrid_pattern.PATTERN_FLAG}) does not "
                "have; drop the flag")
    if te_deferral():
        return (f"{FLAG} under --pipeline-schedule {name} needs the split layer spec's linears (Transformer Engine's "
                "deferral computes W inside the combined step's backward_dw()); use --spec "
                "megatron_vshape.megatron.layer_spec gpt_te_split_layer_spec or drop the flag")
    missing = combined_step_missing()
    if missing is not None:
        import megatron.core

        version = getattr(megatron.core, "__version__", "unknown")
        return (f"{FLAG} under --pipeline-schedule {name} runs Megatron's combined 1F1B step, which megatron-core "
                f"{version} does not have ({missing}); use megatron-core >= 0.19 or drop the flag")
    return None

