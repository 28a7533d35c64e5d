"""What ``--pipeline-vocab-parallel`` cannot run, refused in one line before any rank computes (pure Python).

The start-up checks (``checks.check_vocab_parallel``) read the parsed arguments only; megatron-core's
version is read from the imported module when Megatron's argument parsing has imported it (it has, by
the time the plugin's checks run), else the version check waits for the model surgery
(``vocab_surgery.install_vocab_parallel``), which runs it again.
"""

from __future__ import annotations

import math
import sys

from ..vocab_shards import padded_vocab_size, splits_evenly
from . import hybrid_pattern
from .flags import ConfigError

FLAG = "--pipeline-vocab-parallel"
MIN_CORE_VERSION = (0, 19)


def check_vocab_sizes(padded_vocab: int, tp: int, pp: int, divisible_by: int | None = None) -> None:
    """Refuse a padded vocabulary that does not split into ``tp * pp`` equal shards.

    Megatron pads the vocabulary to a multiple of ``--make-vocab-size-divisible-by`` x TP, so a value that
    is a multiple of PP always splits. ``divisible_by``: the value in force, for the suggestion.
    """
    if splits_evenly(padded_vocab, tp, pp):
        return
    parts = tp * pp
    suggestion = math.lcm(divisible_by or 128, pp)
    raise ConfigError(
        f"{FLAG}: the padded vocabulary ({padded_vocab} rows) does not split into {parts} equal shards "
        f"(TP {tp} x PP {pp}), which checkpoints need; set --make-vocab-size-divisible-by to a multiple of "
        f"{pp}, e.g. {suggestion} (Megatron pads to a multiple of it x TP)")


def version_tuple(text: str) -> tuple[int, ...] | None:
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            return None
        parts.append(int(digits))
    return tuple(parts)


def _refusals(args, core_version: str):
    """One line per thing this cannot run (the first is raised)."""
    version = version_tuple(core_version)
    if version is not None and version < MIN_CORE_VERSION:
        yield (f"{FLAG} needs megatron-core 0.19.2 or Megatron-LM main; {version[0]}.{version[1]}.x is not supported; "
               f"upgrade megatron-core or drop {FLAG}")
    if getattr(args, "pipeline_schedule", None) is None:  # 1f1b and interleaved-1f1b run in ours under the flag
        yield (f"{FLAG}: the vocabulary passes run in megatron-vshape's executor, not in Megatron's default "
               "schedule; choose a --pipeline-schedule (e.g. 1f1b or v-half)")
    ckpt_format = getattr(args, "ckpt_format", "torch_dist")
    if ckpt_format not in (None, "torch_dist"):
        yield (f"{FLAG}: checkpoints are written in the torch_dist layout (megatron.core.dist_checkpointing), "
               f"not --ckpt-format {ckpt_format}; use --ckpt-format torch_dist")
    if getattr(args, "mtp_num_layers", None):
        yield (f"{FLAG}: multi-token prediction (--mtp-num-layers) keeps an embedding and an output layer on its "
               "stage; drop --mtp-num-layers")
    pattern = hybrid_pattern.pattern_text(args)
    if pattern and hybrid_pattern.HybridPattern.parse(pattern).mtp:
        yield (f"{FLAG}: the multi-token-prediction part of --hybrid-layer-pattern (after '/') keeps an embedding "
               "and an output layer on its stage; drop it from the pattern")
    if (getattr(args, "context_parallel_size", None) or 1) > 1:
        yield (f"{FLAG}: context parallelism is not checked with the vocabulary passes yet; drop "
               "--context-parallel-size (or set it to 1)")
    for dest, flag, why in _CONFLICTS:
        if getattr(args, dest, None):
            yield f"{FLAG}: {flag} {why}; drop {flag}"
    tp = getattr(args, "tensor_model_parallel_size", None) or 1
    if weight_sharded_beyond_tp(args, tp):
        yield (f"{FLAG}: --tensor-parallel-num-weight-shards above the TP size ({tp}) shards Megatron's embedding "
               f"weight itself; drop it (Megatron then takes the TP size)")
    pp = getattr(args, "pipeline_model_parallel_size", None) or 1
    divisible_by = getattr(args, "make_vocab_size_divisible_by", None) or 128
    padded = getattr(args, "padded_vocab_size", None)
    if padded is None and getattr(args, "vocab_size", None):
        padded = padded_vocab_size(args.vocab_size, divisible_by, tp)
    if padded is not None:
        try:
            check_vocab_sizes(padded, tp, pp, divisible_by)
        except ConfigError as err:
            yield str(err)


def weight_sharded_beyond_tp(args, tp: int) -> bool:
    """Whether GTP shards each weight further than TP does. megatron-core 0.19's validation sets
    ``tensor_parallel_num_weight_shards`` to the TP size when the flag is not given (and derives
    ``gtp_weight_remat_size`` = shards // TP = 1): that default is TP's own sharding, which the vocabulary
    shards are built on, not weight sharding. So the rule reads the same before and after Megatron's
    validation."""
    shards = getattr(args, "tensor_parallel_num_weight_shards", None)
    return (getattr(args, "gtp_weight_remat_size", None) or 1) > 1 or (shards is not None and shards > tp)


# (dest, flag, why it cannot run): features that use Megatron's output layer or embedding weight.
_CONFLICTS = (
    ("defer_embedding_wgrad_compute", "--defer-embedding-wgrad-compute",
     "defers the weight gradient of Megatron's output layer, which the vocabulary shards replace"),
    ("use_mup", "--use-mup", "scales the logits of Megatron's output layer, which the vocabulary passes do not"),
    ("logit_dtype", "--output-logit-dtype", "sets the dtype of Megatron's output-layer GEMM, which the "
     "vocabulary passes replace (they compute in the weights' dtype, the loss in fp32)"),
    ("use_megatron_fsdp", "--use-megatron-fsdp", "shards the parameters itself"),
    ("use_torch_fsdp2", "--use-torch-fsdp2", "shards the parameters itself"),
    ("init_model_with_meta_device", "--init-model-with-meta-device",
     "leaves the weights whose rows the shards start from uninitialised"),
    ("overlap_moe_expert_parallel_comm", "--overlap-moe-expert-parallel-comm",
     "runs Megatron's combined schedule plan, which computes the loss in the model chunk"),
    ("logits_save_dir", "--logits-save-dir", "hooks Megatron's output layer"),
    ("logits_load_dir", "--logits-load-dir", "hooks Megatron's output layer"),
)


def check_vocab_parallel(args, core_version: str | None = None) -> None:
    """Raise :class:`ConfigError` (one line naming the flag and the fix) for what ``--pipeline-vocab-parallel``
    cannot run; ``core_version``: megatron-core's version (default: the imported one's)."""
    problem = vocab_parallel_problem(args, core_version)
    if problem is not None:
        raise ConfigError(problem)


def vocab_parallel_problem(args, core_version: str | None = None) -> str | None:
    """The first thing ``--pipeline-vocab-parallel`` cannot run with ``args`` (one line), or None;
    ``core_version``: megatron-core's version (default: the imported module's, when it is imported)."""
    if core_version is None:
        core = sys.modules.get("megatron.core")
        core_version = getattr(core, "__version__", "") if core is not None else ""
    return next(_refusals(args, core_version), None)


# The distributed optimizer's checkpoint formats that keep its state in the flat layout of each chunk's DP
# buckets (Megatron's default, ``dp_reshardable``, and older ones): the flag puts other parameters in them.
BUCKET_FORMATS = frozenset({"dp_reshardable", "dp_zero_gather_scatter", "fully_sharded_bucket_space"})


def check_optimizer_checkpoint_across_flag(saved_with_flag: bool, loading_with_flag: bool,
                                           optimizer_format: str | None) -> None:
    """Refuse, in one line, to load a distributed optimizer's bucket-layout state across the flag (Megatron
    would stop every rank with "Global shape mismatch ... bucket_idx_0.param")."""
    if saved_with_flag == loading_with_flag or optimizer_format not in BUCKET_FORMATS:
        return
    saved, loading = ("with", "does not use it") if saved_with_flag else ("without", "uses it")
    raise ConfigError(
        f"{FLAG}: the checkpoint was saved {saved} the flag and this run {loading}, but its distributed-"
        f"optimizer state is in the {optimizer_format} format (each chunk's DP buckets, which the flag changes); "
        "save it with --dist-ckpt-optim-fully-reshardable (the state by parameter name), resume under the "
        "saving run's flag, or add --no-load-optim (a fresh optimizer)")
