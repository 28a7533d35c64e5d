"""The flag checks on Megatron features a schedule or ``--cpu`` cannot run with.

What ``--cpu`` cannot run (CUDA-only features, non-gloo backends), which features conflict with a
schedule that splits the backward into B and W, and what the split layer spec on Transformer Engine
needs (no fp8/fp4, TE installed, apex's wgrad kernel under gradient accumulation fusion). Each check
has the signature of :data:`.sizes.Check`; ``checks.CHECKS`` runs them in order.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata

from .arguments import SPLIT_SPEC_ARG, effective
from .sizes import schedule_of, splits_backward


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


# Features that reduce, overlap or fuse weight gradients at the moment the full backward ends,
# which a deferred W (after B, sometimes much later) breaks. (flag, dest, why)
# --overlap-grad-reduce / --overlap-param-gather and --recompute-granularity run under split schedules
# (buckets launch at their last W: runtime/grad_sync.py; a recomputed layer's W uses what its B recomputed).
_SPLIT_CONFLICTS = (
    ("--delay-wgrad-compute", "delay_wgrad_compute",
     "the schedule defers W itself, in megatron's linear layers; TE's deferral is for its MoE overlap"),
    ("--defer-embedding-wgrad-compute", "defer_embedding_wgrad_compute", "the schedule already defers W"),
    ("--tp-comm-overlap", "tp_comm_overlap", "TE's userbuffer overlap is not wired to deferred W yet"),
    ("--overlap-moe-expert-parallel-comm", "overlap_moe_expert_parallel_comm", "it has its own wgrad schedule"),
    ("--cpu-offloading-num-layers", "cpu_offloading_num_layers", "offloading hooks assume a fused backward"),
    ("--moe-grouped-gemm", "moe_grouped_gemm",
     "Transformer Engine's grouped expert GEMM computes its weight gradients itself and is not split yet"),
)


def check_split_conflicts(args, sizes) -> str | None:
    name = schedule_of(args)
    if not splits_backward(name):
        return None
    for flag, dest, why in _SPLIT_CONFLICTS:
        if getattr(args, dest, None):
            return (f"{flag} conflicts with --pipeline-schedule {name} ({why}); drop {flag} or use a "
                    "schedule without B/W split (1f1b, interleaved-1f1b, gpipe)")
    return None


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


def uses_split_spec(args) -> bool:
    """Split schedule on Transformer Engine without a --spec of the user's: the split layer spec is used."""
    return (splits_backward(schedule_of(args)) and effective(args, "transformer_impl") == "transformer_engine"
            and getattr(args, "spec", None) in (None, SPLIT_SPEC_ARG))


def check_te_split(args, sizes, te_version: Callable[[], tuple | None] = installed_te_version,
                   wgrad_kernel: Callable[[], bool] = apex_wgrad_kernel_installed) -> str | None:
    """Split schedules on TE get the split layer spec (megatron linears, TE attention and norms)."""
    if not uses_split_spec(args):
        return None
    name = schedule_of(args)
    for dest, flag in (("fp8", "--fp8-format"), ("fp4", "--fp4-format")):
        if getattr(args, dest, None):
            return (f"{flag} needs Transformer Engine's linear layers, which --pipeline-schedule {name} replaces by "
                    "megatron's (they split B and W); drop it or use a schedule without B/W split (1f1b, interleaved-1f1b)")
    if te_version() is None:
        return (f"--transformer-impl transformer_engine with --pipeline-schedule {name} uses TE's fused attention "
                "and norms (Transformer Engine not installed); install it or use --transformer-impl local")
    if getattr(args, "gradient_accumulation_fusion", False) and not wgrad_kernel():
        return (f"--pipeline-schedule {name} runs megatron's linear layers, whose gradient accumulation fusion needs "
                "apex's fused_weight_gradient_mlp_cuda (not installed); add --no-gradient-accumulation-fusion or install apex")
    return None

