"""Every Megatron attribute megatron-vshape replaces or calls by keyword, with the signature it expects.

The wrappers live next to the code that needs them (``install.py``, ``cpu_mode.py``,
``training_cpu.py``, ``runtime/wgrad.py``); this table is what they assume about Megatron. :func:`check`
compares it with the running Megatron before anything is replaced, so a rename or a signature change
in a new megatron-core stops start-up with one line naming the attribute, instead of a wrapper that
silently passes the wrong arguments or never runs.

A version the table fits but CI has not tested gets a one-line warning naming the tested ones.

To support a new megatron-core: run ``tests/megatron/test_patches.py`` on it, fix the wrappers whose
entry fails, update the entry, and add the version to ``TESTED``.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import importlib
import inspect
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .flags import ConfigError


@dataclass(frozen=True)
class TestedVersion:
    """A megatron CI tests: a release by its version, or a commit of Megatron-LM main by its files.

    main carries the version of its next release (``package_info`` said 0.20.0 at d98e8a64, long before a
    0.20.0 release), so the version alone would bless that release untested. A commit is recognised by
    :func:`source_fingerprint`: the files of every module the table names, byte for byte. A git checkout's
    version also carries ``+<short hash>``; a copy without ``.git`` does not, so the files decide.
    """

    version: str  # megatron.core.__version__ without its local part (``+<git hash>``)
    commit: str | None = None  # Megatron-LM main at this commit (a pre-release)
    fingerprint: str | None = None  # source_fingerprint() at that commit

    def __str__(self) -> str:
        return self.version if self.commit is None else f"{self.version} (main at {self.commit})"


# main's fingerprint covers the modules PATCHES names: an entry for another module changes it, and CI (which
# asserts main is recognised) then asks for main to be tested again. Recompute on a copy of that checkout:
#   PYTHONPATH=/copy/of/Megatron-LM python -c "from megatron_vshape.megatron.patches import source_fingerprint as f; print(f())"
TESTED = (
    TestedVersion("0.16.1"),
    TestedVersion("0.19.2"),
    TestedVersion("0.20.0", commit="d98e8a64",
                  fingerprint="e07ba6df26acb3c291115a42638f0ab2ef5a9a8e93c7100694e6b5430928ab7e"),
)
TESTED_VERSIONS = tuple(str(tested) for tested in TESTED)


class Match(enum.Enum):
    EXACT = "exactly"  # the wrapper re-declares the parameters and calls Megatron by name
    LEADING = "starting with"  # the wrapper names the first ones and passes the rest through
    CONTAINS = "including"  # the wrapper sets these keywords


class Group(enum.Enum):
    GPU = "install"  # install(): every run on megatron.training
    WGRAD = "wgrad"  # the executor's B/W split (megatron-core only)
    CPU = "cpu"  # enable_cpu_mode(): --cpu and the CPU tests (megatron-core only)
    TRAINING_CPU = "training-cpu"  # enable_training_cpu_mode(): --cpu with megatron.training
    HYBRID = "hybrid"  # hybrid_spec.install(): runs with --hybrid-layer-pattern (HybridModel)
    MOE_OVERLAP = "moe-overlap"  # --overlap-moe-expert-parallel-comm under a V schedule (runtime/combined_step.py)


@dataclass(frozen=True)
class Patch:
    module: str
    attribute: str  # may be dotted: "Class.method"
    params: tuple[str, ...] | None  # None: only the attribute must exist
    group: Group
    match: Match = Match.EXACT


_FBF = ("pp_size", "vp_size")  # megatron-core 0.19 appends schedule_pg_collection; the wrapper passes all through
_LINEAR = "LinearWithGradAccumulationAndAsyncCommunication.backward"
_RANDOM = "megatron.core.tensor_parallel.random"
_DISTOPT = "megatron.core.optimizer.distrib_optimizer"
_FULLY_PARALLEL = "megatron.core.dist_checkpointing.strategies.fully_parallel"
_PP_UTILS = "megatron.core.pipeline_parallel.utils"
_COMBINED = "megatron.core.pipeline_parallel.combined_1f1b"
_PLANS = "megatron.core.models.common.model_chunk_schedule_plan"
_COMBINED_STEP = ("forward_step_func", "data_iterator", "f_model", "num_microbatches", "input_tensor",
                  "forward_data_store", "b_model", "b_input_tensor", "b_output_tensor", "b_output_tensor_grad",
                  "config", "f_model_chunk_id", "pre_forward", "pre_backward", "post_forward", "post_backward",
                  "collect_non_loss_data", "checkpoint_activations_microbatch", "is_first_microbatch",
                  "current_microbatch")
_FORWARD_STEP = ("forward_step_func", "data_iterator", "model", "num_microbatches", "input_tensor",
                 "forward_data_store", "config", "cp_group_size", "collect_non_loss_data",
                 "checkpoint_activations_microbatch", "is_first_microbatch", "current_microbatch", "vp_stage",
                 "is_last_stage")

PATCHES: tuple[Patch, ...] = (
    Patch("megatron.core.pipeline_parallel", "get_forward_backward_func", _FBF, Group.GPU, Match.LEADING),
    Patch("megatron.core.pipeline_parallel.schedules", "get_forward_backward_func", _FBF, Group.GPU, Match.LEADING),
    Patch("megatron.training.training", "get_forward_backward_func", _FBF, Group.GPU, Match.LEADING),
    Patch("megatron.training.arguments", "parse_args", ("extra_args_provider", "ignore_unknown_args"), Group.GPU),
    Patch("megatron.training.arguments", "validate_args", ("args", "defaults"), Group.GPU),
    Patch("megatron.training.training", "get_model", ("model_provider_func",), Group.GPU, Match.LEADING),
    Patch("megatron.training.models.gpt", "GPTModelBuilder.build_model",
          ("self", "pg_collection", "pre_process", "post_process", "vp_stage"), Group.GPU),
    Patch("megatron.core.parallel_state", "is_pipeline_first_stage", ("ignore_virtual", "vp_stage"), Group.GPU),
    Patch("megatron.core.parallel_state", "is_pipeline_last_stage", ("ignore_virtual", "vp_stage"), Group.GPU),
    Patch("megatron.core.tensor_parallel.layers", _LINEAR, ("ctx", "grad_output"), Group.WGRAD),
    # Not replaced, but called by keyword from runtime/compat.py: a rename must stop start-up.
    Patch("megatron.core.pipeline_parallel.schedules", "forward_step", _FORWARD_STEP, Group.WGRAD),
    Patch("megatron.core.pipeline_parallel.schedules", "backward_step",
          ("input_tensor", "output_tensor", "output_tensor_grad", "config"), Group.WGRAD, Match.CONTAINS),
    Patch(_RANDOM, "CudaRNGStatesTracker", None, Group.CPU),
    Patch(_RANDOM, "_MODEL_PARALLEL_RNG_TRACKER_NAME", None, Group.CPU),
    Patch(_RANDOM, "_get_cuda_rng_state", None, Group.CPU),
    Patch(_RANDOM, "_set_cuda_rng_state", ("new_state",), Group.CPU, Match.LEADING),
    # cpu_mode._install_torch_adam_checkpoints: distributed-optimizer checkpoints with torch's Adam
    Patch(_DISTOPT, "HAVE_APEX_OR_TE", None, Group.CPU),
    Patch(_DISTOPT, "DistributedOptimizer.state_dict", ("self",), Group.CPU),
    Patch(_DISTOPT, "DistributedOptimizer.load_state_dict", ("self", "state_dict"), Group.CPU),
    Patch(_DISTOPT, "DistributedOptimizer._set_main_param_and_optimizer_states", ("self", "model_param", "tensors"),
          Group.CPU),
    # cpu_streams: not replaced, but Megatron's combined 1F1B (--overlap-moe-expert-parallel-comm) creates its
    # communication stream here and runs its schedule nodes on streams and events: what the CPU stand-ins
    # serve. A rename must stop start-up, so the stand-ins are checked against the new code.
    Patch(_PP_UTILS, "set_streams", ("comm_stream",), Group.CPU, Match.CONTAINS),
    Patch(_PP_UTILS, "get_comm_stream", (), Group.CPU),
    Patch(_PP_UTILS, "ScheduleNode", None, Group.CPU),
    # runtime/combined_step.py: the executor's F, B and F&B pairs under --overlap-moe-expert-parallel-comm call
    # Megatron's combined 1F1B step by position and keyword (issue 43). Checked when the flag runs under a V
    # schedule (moe_overlap.check_moe_overlap): a megatron-core without it refuses the flag in one line.
    COMBINED_STEP := Patch(_COMBINED, "combined_forward_backward_step", _COMBINED_STEP, Group.MOE_OVERLAP,
                           Match.LEADING),
    # ... and replaces schedules.forward_step_calc_loss for that call, adding is_last_stage (and cp_group_size):
    # the combined step asks parallel_state, which does not know a V's last stage outside megatron.training.
    Patch("megatron.core.pipeline_parallel.schedules", "forward_step_calc_loss",
          ("model", "output_tensor", "loss_func", "config", "vp_stage", "collect_non_loss_data", "num_microbatches",
           "forward_data_store", "cp_group_size", "is_last_stage"), Group.MOE_OVERLAP),
    # dropout_seed.attach_plan_reseeding: the schedule plans' runs, wrapped so that schedule-invariant dropout
    # reaches the layers the combined step runs from the plan's nodes (their forward hooks never fire there)
    Patch(_PLANS, "TransformerLayerSchedulePlan.run",
          ("f_layer", "b_layer", "f_input", "b_grad", "is_last_layer_in_bwd"), Group.MOE_OVERLAP),
    Patch(_PLANS, "TransformerModelChunkSchedulePlan.run",
          ("f_schedule_plan", "b_schedule_plan", "b_grad", "pre_forward", "pre_backward", "post_forward",
           "post_backward"), Group.MOE_OVERLAP),
    # model_chunks.install_checkpoint_fixes: a V's tied copies in a fully parallel save; the fully_reshardable
    # optimizer save's bucket offsets (megatron-core < 0.20)
    Patch(_FULLY_PARALLEL, "distribute_main_replicas_with_precomputed_distribution",
          ("sharded_state_dict", "parallelization_group", "precomputed_distribution"), Group.GPU),
    Patch(_FULLY_PARALLEL, "FullyParallelSaveStrategyWrapper.apply_saving_parallelization",
          ("self", "sharded_state_dict"), Group.GPU),
    Patch(_FULLY_PARALLEL, "_sharded_tensor_shard_id", None, Group.GPU),
    Patch(_DISTOPT, "DistributedOptimizer.sharded_param_state_fully_reshardable", ("self", "model_sharded_state_dict"),
          Group.GPU, Match.LEADING),
    Patch(_DISTOPT, "DistributedOptimizer.get_parameter_state_dp_zero", None, Group.GPU),
    # model_chunks._install_optimizer_format_check: bucket-layout optimizer state across --pipeline-vocab-parallel
    Patch("megatron.training.checkpointing", "_load_base_checkpoint", ("load_dir", "args", "rank0"), Group.GPU,
          Match.LEADING),
    Patch("megatron.core.dist_checkpointing", "load_content_metadata", ("preloaded_state_dict",), Group.GPU,
          Match.CONTAINS),
    Patch("megatron.training.initialize", "initialize_megatron", ("allow_no_cuda",), Group.TRAINING_CPU,
          Match.CONTAINS),
    Patch("megatron.training.training", "initialize_megatron", ("allow_no_cuda",), Group.TRAINING_CPU,
          Match.CONTAINS),
    Patch("megatron.core.datasets.utils", "compile_helpers", (), Group.GPU),  # dataset_helpers.install()
    Patch("megatron.training.arguments", "get_device_arch_version", (), Group.TRAINING_CPU),
    Patch("megatron.training.models.hybrid", "HybridModelBuilder.build_model",
          ("self", "pg_collection", "pre_process", "post_process", "vp_stage"), Group.HYBRID),
    Patch("megatron.core.models.hybrid.hybrid_layer_allocation", "select_pipeline_segment",
          ("main_pattern", "pp_group", "vp_stage"), Group.HYBRID, Match.LEADING),
    Patch("megatron.core.models.hybrid.hybrid_block", "TENorm", None, Group.HYBRID),  # replaced with --cpu
)


class PatchError(ConfigError):
    """A Megatron attribute the project replaces is missing or has another signature (exit 2, one line)."""


def _megatron_version() -> str:
    import megatron.core

    return getattr(megatron.core, "__version__", "unknown")


def source_fingerprint() -> str:
    """sha256 over the source files of the modules the table names, in the running megatron's tree.

    Found by path, not imported: the same files give the same answer whatever has been imported so far.
    """
    import megatron.core

    root = Path(megatron.core.__file__).resolve().parents[2]  # the directory that holds megatron/
    digest = hashlib.sha256()
    for module in sorted({patch.module for patch in PATCHES}):
        base = root.joinpath(*module.split("."))
        source = next((path for path in (base.with_suffix(".py"), base / "__init__.py") if path.is_file()), None)
        digest.update(module.encode() + b"\0" + (source.read_bytes() if source is not None else b"") + b"\0")
    return digest.hexdigest()


def tested_as(version: str, fingerprint=source_fingerprint) -> TestedVersion | None:
    """The entry of ``TESTED`` the running megatron is (None: untested). ``fingerprint`` is called only
    for a version whose tested entry is a commit of main."""
    release = version.split("+")[0]
    for tested in TESTED:
        if tested.version == release and (tested.fingerprint is None or fingerprint() == tested.fingerprint):
            return tested
    return None


def untested_warning(version: str) -> str | None:
    """The one line for a megatron the table fits but CI has not tested (None when it was tested)."""
    if tested_as(version) is not None:
        return None
    return (f"megatron-vshape warning: megatron-core {version} is untested (tested: {', '.join(TESTED_VERSIONS)}); "
            "every Megatron attribute megatron-vshape replaces matches it")


def _resolve(patch: Patch):
    target = importlib.import_module(patch.module)
    for part in patch.attribute.split("."):
        target = getattr(target, part)
    return target


def _parameters(target) -> tuple[str, ...]:
    # A wrapper installed earlier carries __wrapped__ (functools.wraps): signature() sees Megatron's.
    return tuple(inspect.signature(target).parameters)


def _matches(patch: Patch, actual: tuple[str, ...]) -> bool:
    expected = patch.params
    if patch.match is Match.EXACT:
        return actual == expected
    if patch.match is Match.LEADING:
        return actual[: len(expected)] == expected
    return set(expected) <= set(actual)


def problem(patch: Patch) -> str | None:
    """Why ``patch`` does not fit the running Megatron (None when it does)."""
    name = f"{patch.module}.{patch.attribute}"
    try:
        target = _resolve(patch)
    except (ImportError, AttributeError) as err:
        return f"{name} is missing ({type(err).__name__}: {err})"
    if patch.params is None:
        return None
    try:
        actual = _parameters(target)
    except (TypeError, ValueError):
        return f"{name} has no inspectable signature"
    if not _matches(patch, actual):
        return f"{name} takes ({', '.join(actual)}); expected parameters {patch.match.value} ({', '.join(patch.params)})"
    return None


def check(*groups: Group) -> None:
    """Raise :class:`PatchError` (one line) on the first entry of ``groups`` the running Megatron breaks.

    When every entry fits a version CI has not tested, rank 0 prints :func:`untested_warning` (once).
    """
    for patch in PATCHES:
        if patch.group in groups:
            why = problem(patch)
            if why is not None:
                raise PatchError(f"megatron-core {_megatron_version()} is not supported: {why} "
                                 f"(megatron-vshape is tested with megatron-core {', '.join(TESTED_VERSIONS)})")
    _warn_if_untested()


@functools.cache  # once per process
def _warn_if_untested() -> None:
    warning = untested_warning(_megatron_version())
    if warning is not None and os.environ.get("RANK", "0") == "0":
        print(warning, file=sys.stderr, flush=True)
