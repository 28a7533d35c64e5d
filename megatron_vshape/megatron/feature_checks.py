"""The flag checks on Megatron features a schedule or ``--cpu`` cannot run with.

What ``--cpu`` cannot run (CUDA-only features, non-gloo backends), which features conflict with a
schedule that splits the backward into B and W, and what the split layer spec on Transformer Engine
needs (no fp8/fp4, TE installed, apex's wgrad kernel under gradient accumulation fusion). Each check
has the signature of :data:`.sizes.Check`; ``checks.CHECKS`` runs them in order.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from importlib import metadata

from . import hybrid_pattern, moe_overlap
from .flags import SPLIT_SPEC_ARG, TE_SPLIT_SPEC_ARG, effective, schedule_of, splits_backward
from .sizes import Sizes
from .startup_schedule import schedule_for_run

TE_DEFERRAL_MIN_VERSION = (2, 3)


def check_cpu_backend(args, sizes) -> str | None:
    if getattr(args, "cpu", False) and effective(args, "distributed_backend") not in (None, "gloo"):
        return f"--cpu needs the gloo backend, not --distributed-backend {args.distributed_backend}; drop that flag or use gloo"
    return None


def check_cpu_features(args, sizes) -> str | None:
    if not getattr(args, "cpu", False):
        return None
    if effective(args, "transformer_impl") not in (None, "local"):
        return "--cpu runs megatron-core's torch layers; use --transformer-impl local (or drop the flag)"
    if getattr(args, "sequence_parallel", False):
        # Megatron's torch norms (the only ones without apex / TE) assert on sequence parallel.
        return "--sequence-parallel needs apex or Transformer Engine norms, which --cpu does not have; drop --sequence-parallel"
    for dest, flag in (("fp16", "--fp16"), ("fp8", "--fp8-format"), ("tp_comm_overlap", "--tp-comm-overlap"),
                       ("use_flash_attn", "--use-flash-attn")):
        if getattr(args, dest, None):
            return f"{flag} is CUDA-only and cannot run with --cpu; drop {flag}"
    return None


def check_moe_tensor_parallel(args, sizes) -> str | None:
    """megatron-core's MoE layer raises at the first training step when TP > 1 runs without sequence parallelism
    (``MoELayer.forward``: "performance may degrade ..."), under every schedule, Megatron's own included: one
    line before any rank computes instead of a traceback per rank at iteration 1."""
    if getattr(args, "num_experts", None) and sizes.tp > 1 and not getattr(args, "sequence_parallel", False):
        return ("--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel (megatron-core's MoE "
                "layer refuses to train without it); add --sequence-parallel" +
                (", which needs a GPU (--cpu cannot take it)" if getattr(args, "cpu", False) else ""))
    return None


def check_context_parallel(args, sizes) -> str | None:
    """Context parallelism splits each sequence over ranks; only TE's attention exchanges the keys and values."""
    if sizes.cp <= 1:
        return None
    if getattr(args, "cpu", False):
        return ("--context-parallel-size needs Transformer Engine's context-parallel attention, which --cpu does not "
                "have; drop --context-parallel-size (or set it to 1)")
    if effective(args, "transformer_impl") == "local":
        return ("--context-parallel-size needs Transformer Engine's attention (megatron's local attention asserts on "
                "it); use --transformer-impl transformer_engine or drop --context-parallel-size")
    seq_length = getattr(args, "seq_length", None)
    if seq_length is not None and seq_length % (2 * sizes.cp):
        return (f"--seq-length {seq_length} must be divisible by 2 x --context-parallel-size = {2 * sizes.cp} "
                "(each rank takes two of the sequence's 2 x CP chunks); change one of them")
    return None


# Features that reduce, overlap or fuse weight gradients at the moment the full backward ends,
# which a deferred W (after B, sometimes much later) breaks. (flag, dest, why)
# --overlap-grad-reduce / --overlap-param-gather and --recompute-granularity run under split schedules
# (buckets launch at their last W: runtime/grad_sync.py; a recomputed layer's W uses what its B recomputed).
_SPLIT_CONFLICTS = (
    ("--delay-wgrad-compute", "delay_wgrad_compute",
     "the schedule defers W itself, in megatron's linear layers; TE's deferral is for its MoE overlap"),
    ("--defer-embedding-wgrad-compute", "defer_embedding_wgrad_compute", "the schedule already defers W"),
    ("--tp-comm-overlap", "tp_comm_overlap",
     "it needs Transformer Engine >= 2.3's linears, which defer W through backward_dw()"),
    ("--cpu-offloading-num-layers", "cpu_offloading_num_layers", "offloading hooks assume a fused backward"),
    ("--moe-grouped-gemm", "moe_grouped_gemm",
     "Transformer Engine's grouped expert GEMM computes its weight gradients itself and is not split yet"),
)


# What Transformer Engine's own linears bring to a split schedule on the TE route (split_route).
_TE_ROUTE_ACCEPTS = frozenset({"tp_comm_overlap", "moe_grouped_gemm"})


def check_split_conflicts(args, sizes) -> str | None:
    name = schedule_of(args)
    if not splits_backward(name):
        return None
    te_route = split_route(args) is SplitRoute.TE_DEFERRAL
    for flag, dest, why in _SPLIT_CONFLICTS:
        if te_route and dest in _TE_ROUTE_ACCEPTS:
            continue
        if getattr(args, dest, None):
            return (f"{flag} conflicts with --pipeline-schedule {name} ({why}); drop {flag} or use a "
                    "schedule without B/W split (1f1b, interleaved-1f1b, gpipe)")
    return None


def check_moe_overlap(args, sizes) -> str | None:
    """--overlap-moe-expert-parallel-comm: where it cannot run (moe_overlap.py)."""
    return moe_overlap.problem(args, lambda: split_route(args) is SplitRoute.TE_DEFERRAL)


def installed_te_version() -> tuple[int, ...] | None:
    """Transformer Engine's version from package metadata (never imports TE), or None."""
    for dist in ("transformer-engine", "transformer_engine", "transformer-engine-torch"):
        try:
            text = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        return tuple(int(p) for p in text.split("+")[0].split(".")[:3] if p.isdigit())
    return None


def apex_wgrad_kernel_installed() -> bool:
    """apex's fused weight-gradient kernel, which megatron's linears need for gradient accumulation fusion."""
    import importlib.util

    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


class SplitRoute(enum.Enum):
    """How a split schedule gets its weight gradients deferred (see docs/transformer-engine.md)."""

    NONE = "no split on Transformer Engine"  # fused schedule, local layers, or the user's own --spec
    SPLIT_SPEC = "split layer spec"  # megatron's linears (its wgrad hook), TE's attention and norms
    TE_DEFERRAL = "TE deferral"  # TE's linears with delay_wgrad_compute, W through backward_dw()


def te_version_of(args) -> tuple[int, ...] | None:
    """The TE version the checks assume: ``vshape check-flags --te-version``, else the installed one."""
    declared = getattr(args, "vshape_te_version", None)
    return tuple(declared) if declared is not None else installed_te_version()


def _keeps_w_order(args) -> bool:
    """Whether the schedule this run trains with (its costs, its layout) runs W in B's order on every
    stage: TE's FIFO needs it. Built once and shared with the check that it builds (``startup_schedule``)."""
    from ..schedules.lowering.validator import keeps_w_order

    sizes = Sizes.from_args(args)
    if sizes.num_microbatches is None or sizes.pp < 1:
        return True  # other checks refuse these sizes
    try:
        return keeps_w_order(schedule_for_run(args, sizes))
    except ValueError:  # ScheduleError, ConfigError of a bad layout: other checks refuse them
        return True


def split_route(args, te_version: Callable[[], tuple | None] | None = None) -> SplitRoute:
    """The route of this run: TE's deferral when TE >= 2.3 and the schedule keeps W in B's order."""
    if not (splits_backward(schedule_of(args)) and effective(args, "transformer_impl") == "transformer_engine"
            and getattr(args, "spec", None) in (None, SPLIT_SPEC_ARG, TE_SPLIT_SPEC_ARG)):
        return SplitRoute.NONE

    if hybrid_pattern.is_hybrid(args):  # HybridModel's split spec has megatron's linears (hybrid_spec)
        return SplitRoute.SPLIT_SPEC
    version = te_version() if te_version is not None else te_version_of(args)
    if version is not None and version[:2] >= TE_DEFERRAL_MIN_VERSION and _keeps_w_order(args):
        return SplitRoute.TE_DEFERRAL
    return SplitRoute.SPLIT_SPEC


def split_route_reason(args) -> str:
    """One line: the route, and on the split layer spec why not TE's deferral (for the log and check-flags)."""
    route = split_route(args)
    if route is not SplitRoute.SPLIT_SPEC:
        return route.value
    version = te_version_of(args)
    if version is None or version[:2] < TE_DEFERRAL_MIN_VERSION:
        found = "not installed" if version is None else ".".join(map(str, version))
        return f"{route.value}: TE's deferred W needs Transformer Engine >= 2.3 (found {found})"
    return (f"{route.value}: --pipeline-schedule {schedule_of(args)} runs some stage's W passes out of B order, "
            "which TE's first-in first-out deferral cannot serve")


def uses_split_spec(args) -> bool:
    """Split schedule on Transformer Engine below 2.3 without a --spec of the user's: the split layer spec."""
    return split_route(args) is SplitRoute.SPLIT_SPEC


def check_te_split(args, sizes, te_version: Callable[[], tuple | None] | None = None,
                   wgrad_kernel: Callable[[], bool] = apex_wgrad_kernel_installed) -> str | None:
    """Split schedules on TE: TE's own linears with TE >= 2.3, else the split layer spec and its limits."""
    if split_route(args, te_version) is not SplitRoute.SPLIT_SPEC:
        return None  # TE's linears (fp8/fp4, fused LayerNorm+Linear, grouped GEMM) or no split on TE
    version = te_version() if te_version is not None else te_version_of(args)
    name = schedule_of(args)
    for dest, flag in (("fp8", "--fp8-format"), ("fp4", "--fp4-format")):
        if getattr(args, dest, None):
            return (f"{flag} needs Transformer Engine's linear layers, which --pipeline-schedule {name} keeps only with "
                    "TE >= 2.3 (its deferred W); upgrade Transformer Engine, drop it or use a schedule without "
                    "B/W split (1f1b, interleaved-1f1b)")
    if version is None:
        return (f"--transformer-impl transformer_engine with --pipeline-schedule {name} uses TE's fused attention "
                "and norms (Transformer Engine not installed); install it or use --transformer-impl local")
    if getattr(args, "gradient_accumulation_fusion", False) and not wgrad_kernel():
        return (f"--pipeline-schedule {name} runs megatron's linear layers, whose gradient accumulation fusion needs "
                "apex's fused_weight_gradient_mlp_cuda (not installed); add --no-gradient-accumulation-fusion or install apex")
    return None
