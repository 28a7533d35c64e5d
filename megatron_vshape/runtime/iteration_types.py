"""What the executor and one call's :class:`~.iteration.Iteration` hand each other, as plain values.

:class:`IterationSetup` (this rank's lowered program and what the call writes to) and megatron's
:class:`CallArgs` go in; an :class:`IterationResult` comes out. :class:`Chunk` is the per-call state of one
model chunk (one stage) of the rank; :func:`pipeline_groups` reads the call's groups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron_vshape.schedules.core.actions import Action
from megatron_vshape.schedules.lowering.program import Program

from .p2p import PairGroups
from .replan import PassClock
from .timeline import Timeline
from .watchdog import ScheduleWatchdog
from .wgrad_adapter import WeightGradAdapter


@dataclass(frozen=True)
class PipelineGroups:
    """The call's pipeline group and the sizes of its tensor- and context-parallel groups."""

    pp: object  # torch.distributed.ProcessGroup
    tp_size: int
    cp_size: int


def pipeline_groups(pg_collection) -> PipelineGroups:
    """The groups of megatron's ``pg_collection`` (0.19's ``train_step`` passes one), else parallel_state's."""
    if pg_collection is not None:
        return PipelineGroups(pg_collection.pp, pg_collection.tp.size(), pg_collection.cp.size())
    from megatron.core import parallel_state

    return PipelineGroups(parallel_state.get_pipeline_model_parallel_group(),
                          parallel_state.get_tensor_model_parallel_world_size(),
                          parallel_state.get_context_parallel_world_size())


@dataclass(frozen=True)
class IterationSetup:
    """What the executor hands one call: this rank's program and what the call writes to."""

    schedule_name: str
    program: Program  # every rank's, lowered for this call (training, or forward-only)
    rank: int  # this rank's index in the pipeline group
    groups: PipelineGroups
    wgrad: WeightGradAdapter  # the weight-gradient store the split linears push to
    pair_groups: Callable[[], PairGroups]  # the p2p groups, created and warmed up on first use
    watchdog: ScheduleWatchdog | None = None
    record_passes: bool = False  # keep (action, start, end) of every pass (IterationResult.pass_times)
    spans: Timeline | None = None  # where the wall time goes (timeline.py), when recorded
    clock: PassClock | None = None  # times passes for --pipeline-costs auto, while it measures


@dataclass(frozen=True)
class CallArgs:
    """The arguments of megatron's forward-backward call that the iteration reads."""

    forward_step_func: Callable
    data_iterator: object
    models: list
    num_microbatches: int
    seq_length: int
    micro_batch_size: int
    forward_only: bool
    collect_non_loss_data: bool
    first_val_step: bool | None
    force_all_reduce: bool | None
    pg_collection: object


@dataclass(frozen=True)
class IterationResult:
    losses: list  # megatron's return value: what the loss function reduced, per microbatch
    pass_times: list[tuple[Action, float, float]] | None  # with IterationSetup.record_passes
    tensor_shape: tuple[int, ...]  # of one p2p message (the cost profile measures sending it)
    dtype: torch.dtype
    # With vocabulary passes: (peak bytes held from H to G, the first stage's embeddings' bytes) on this rank
    vocab_bytes: tuple[int, int] | None = None


@dataclass
class Chunk:
    """Per-iteration state of one model chunk (one stage) of this rank."""

    model: torch.nn.Module
    data_iterator: object
    stage: int
    index: int
    vp_stage: int | None
    is_last_stage: bool
    inputs: dict[int, torch.Tensor | None] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    output_grads: dict[int, torch.Tensor | None] = field(default_factory=dict)
