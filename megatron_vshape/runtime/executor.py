"""One executor for every schedule: a drop-in for megatron-core's forward-backward functions.

``build_forward_backward_func("v-half")`` returns a callable with the signature of megatron-core's
schedule functions (``forward_step_func, data_iterator, model, num_microbatches, seq_length,
micro_batch_size, ..., forward_only``, plus the keywords 0.19's ``train_step`` passes). On each
call it takes this pipeline rank's program from the schedule core (built once per
(pipeline size, number of microbatches) and cached in the callable) and runs it action by action:

* ``F`` runs megatron's ``forward_step`` on the stage's model chunk;
* ``B`` runs megatron's ``backward_step``; when the schedule splits the backward (and the W does not
  come right after), it runs inside the weight-gradient store's ``capture`` so the linear layers
  only compute input gradients;
* ``W`` runs the stored weight-gradient work of that (chunk, microbatch).

What a rank runs is the lowering chain's :class:`~megatron_vshape.schedules.lowering.program.Program`
(its steps with their messages, which B defer W, where chunks gather parameters and start gradient
reduction, and the p2p program: :mod:`megatron_vshape.runtime.p2p`), the same program the NCCL model
checks. Between two stages of one rank (the tip of the V) tensors are handed over locally.

Return value (megatron's convention): the list of what the loss function reduced, one entry per
microbatch in microbatch order, on the rank that holds the *last stage*, and ``[]`` elsewhere. On a
looped placement that is the last pipeline rank; **on a V placement it is pipeline rank 0**.

Model chunks: ``model`` is the list of this rank's chunks in local order (see
:mod:`megatron_vshape.runtime.placement`), one data iterator per chunk (or one iterator when the
rank has a single chunk). Gradients are reduced once every backward of a chunk is done (DDP,
``finalize_model_grads``); with tied embeddings on a V, both copies live on rank 0 and their
gradients are summed locally before the data-parallel reduction (so it also holds for the
distributed optimizer's reduce-scatter, whose shards need not line up between the two copies).
"""

from __future__ import annotations

import torch

from megatron_vshape.schedules.core.actions import Action
from megatron_vshape.schedules.core.schedule import Costs, Schedule, ScheduleError
from megatron_vshape.schedules.generators.registry import SCHEDULES, get_schedule
from megatron_vshape.schedules.lowering.messages import DevicePlan, lower
from megatron_vshape.schedules.lowering.program import Program, lower_program
from megatron_vshape.schedules.lowering.validator import validate

from . import te_wgrad
from .iteration import Iteration
from .iteration_types import CallArgs, IterationResult, IterationSetup, pipeline_groups
from .p2p import PairGroups, local_device
from .replan import (
    CostProfile,
    PassClock,
    Replan,
    ReplanPolicy,
    agree_on_costs,
    decide,
    measure_comm,
    relative_costs,
    timed_iterators,
    write_costs,
)
from .timeline import Category, Timeline
from .watchdog import ScheduleWatchdog
from .wgrad_adapter import WeightGradAdapter


def build_forward_backward_func(
    schedule_name: str,
    costs: Costs = Costs(),
    chunks: int = 2,
    memory_limit: float | None = None,
    executor_type: type[ScheduleExecutor] | None = None,
    record_timeline: bool = False,
    replan: ReplanPolicy | None = None,
    watchdog: ScheduleWatchdog | None = None,
) -> ScheduleExecutor:
    """A megatron-style forward-backward function running ``schedule_name``.

    ``executor_type`` is a :class:`ScheduleExecutor` subclass to build instead (the tests' check that
    a deliberately corrupted plan is caught overrides :meth:`ScheduleExecutor.lower_plans`). With ``record_timeline`` the callable
    keeps ``last_timeline``: (action, start, end) wall-clock seconds of each pass of the last call
    on this rank (CPU timing; on GPU it measures launch, not kernel time), to compare with the
    simulator or to measure F/B/W costs, and ``last_spans``: the call's whole wall time split into
    passes, waits for receives and sends, bookkeeping and the gradient reduction
    (:mod:`.timeline`). With ``replan`` the executor times its passes during the
    first training iterations and rebuilds the schedule from the measured costs (:mod:`.replan`).
    With ``watchdog`` a pipeline that stops moving is reported on every rank and the job ends
    (:mod:`.watchdog`).
    """
    if schedule_name not in SCHEDULES:
        raise ScheduleError(
            f"--pipeline-schedule: unknown schedule {schedule_name!r}; choose one of: {', '.join(SCHEDULES)}"
        )
    executor = (executor_type or ScheduleExecutor)(schedule_name, costs, chunks, memory_limit)
    executor.record_timeline = record_timeline
    executor.cost_profile = CostProfile(replan) if replan is not None else None
    executor.watchdog = watchdog
    return executor


class ScheduleExecutor:
    """The callable returned by :func:`build_forward_backward_func` (no state shared across instances)."""

    def __init__(self, name, costs, chunks, memory_limit):
        self.schedule_name = name
        self._costs, self._chunks, self._memory_limit = costs, chunks, memory_limit
        self._schedules: dict[tuple[int, int], tuple[Schedule, tuple[DevicePlan, ...]]] = {}
        self._groups: dict[tuple[int, ...], PairGroups] = {}  # per pipeline group (its global ranks)
        self._programs: dict[tuple[int, int, bool, bool], Program] = {}  # (d, m, forward_only, defer every W)
        self._wgrad = WeightGradAdapter()
        self.last_wgrad_counts = None  # weight gradients deferred / run by the last call (wgrad.WgradCounts)
        self.last_vocab_bytes = None  # --pipeline-vocab-parallel: IterationResult.vocab_bytes of the last call
        self.record_timeline = False
        self.last_timeline: list[tuple[Action, float, float]] = []
        self.current_timeline: Timeline | None = None  # the running call's spans (record_timeline)
        self.last_spans: Timeline | None = None  # the last call's spans (runtime/timeline.py)
        self.eager_waits = False  # wait for each p2p batch at once (the old policy; benchmarks compare)
        # Run a B and its directly following W as one backward even when B's input gradient goes to another
        # rank, which then gets it W's duration late (the old policy; benchmarks compare).
        self.fuse_remote_pairs = False
        self.cost_profile: CostProfile | None = None  # --pipeline-costs auto
        self.last_replan: Replan | None = None
        self.watchdog: ScheduleWatchdog | None = None
        self._loaders: list = []  # this call's timed data iterators, while the cost profile measures

    @property
    def costs(self) -> Costs:
        """The costs the running schedule was built from (measured ones after a re-plan)."""
        return self._costs

    # --- schedule -----------------------------------------------------------------------------

    def schedule(self, num_devices: int, num_microbatches: int) -> Schedule:
        return self._planned(num_devices, num_microbatches)[0]

    def _planned(self, num_devices, num_microbatches) -> tuple[Schedule, tuple[DevicePlan, ...]]:
        """The schedule at this size and its messages level (built once, until a re-plan)."""
        key = (num_devices, num_microbatches)
        if key not in self._schedules:
            schedule = self._build(num_devices, num_microbatches)
            self._schedules[key] = (schedule, self.lower_plans(schedule))
        return self._schedules[key]

    def lower_plans(self, schedule: Schedule) -> tuple[DevicePlan, ...]:
        """The first pass of the lowering chain, every rank's messages (the tests' hook to corrupt a plan)."""
        return lower(schedule)

    def program(self, num_devices: int, num_microbatches: int, forward_only: bool = False,
                defer_every_w: bool = False) -> Program:
        """Every rank's program for a call: the lowering chain run on the schedule (cached)."""
        key = (num_devices, num_microbatches, forward_only, defer_every_w)
        if key not in self._programs:
            schedule, plans = self._planned(num_devices, num_microbatches)
            self._programs[key] = lower_program(
                schedule, self._costs, forward_only_call=forward_only, defer_every_w=defer_every_w,
                split_remote_pairs=not self.fuse_remote_pairs, eager_waits=self.eager_waits, plans=plans)
        return self._programs[key]

    def _build(self, num_devices: int, num_microbatches: int) -> Schedule:
        extra = {} if self._memory_limit is None else {"memory_limit": self._memory_limit}
        schedule = get_schedule(self.schedule_name, num_devices, num_microbatches, self._costs, self._chunks, **extra)
        validate(schedule)
        return schedule

    def pair_groups(self, pp_group) -> PairGroups:
        """The p2p groups of ``pp_group``, created and warmed up on first use (collective over all ranks)."""
        key = tuple(torch.distributed.get_process_group_ranks(pp_group))
        if key not in self._groups:
            self._groups[key] = PairGroups.create(pp_group)
        return self._groups[key]

    # --- megatron signature -------------------------------------------------------------------

    def __call__(
        self,
        *,
        forward_step_func,
        data_iterator,
        model,
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        decoder_seq_length: int | None = None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
        first_val_step: bool | None = None,
        adjust_tensor_shapes_fn=None,
        force_all_reduce: bool | None = False,
        p2p_communicator=None,
        pg_collection=None,
    ):
        if adjust_tensor_shapes_fn is not None:
            raise ValueError("adjust_tensor_shapes_fn is not supported by the vshape executor; pass None")
        first = model[0] if isinstance(model, list) else model
        if getattr(getattr(first, "config", None), "defer_embedding_wgrad_compute", False):
            raise ValueError("--defer-embedding-wgrad-compute is not supported with --pipeline-schedule; drop it")
        self.current_timeline = Timeline() if self.record_timeline else None
        self._loaders = []
        if not forward_only and self.cost_profile is not None and self.cost_profile.measuring():
            data_iterator, self._loaders = timed_iterators(data_iterator)  # batch loading, out of F
        models = model if isinstance(model, list) else [model]
        before = self._wgrad.counts()
        groups = pipeline_groups(pg_collection)
        program = self.program(groups.pp.size(), num_microbatches, forward_only,
                               defer_every_w=te_wgrad.defers_every_w(models))
        setup = IterationSetup(
            schedule_name=self.schedule_name, program=program, rank=groups.pp.rank(), groups=groups,
            wgrad=self._wgrad, pair_groups=lambda: self.pair_groups(groups.pp), watchdog=self.watchdog,
            record_passes=self.record_timeline, spans=self.current_timeline, clock=self.pass_clock(forward_only))
        call = CallArgs(forward_step_func, data_iterator, models, num_microbatches, seq_length, micro_batch_size,
                        forward_only, collect_non_loss_data, first_val_step, force_all_reduce, pg_collection)
        result = Iteration(setup, call).execute()
        if result.pass_times is not None:
            self.last_timeline = result.pass_times
        self.last_vocab_bytes = result.vocab_bytes
        if not forward_only and self.cost_profile is not None:
            self._after_training_call(setup.clock, result, groups.pp, num_microbatches)
        self.last_wgrad_counts = self._wgrad.counts() - before
        if self.current_timeline is not None:
            self.current_timeline.mark(Category.BOOKKEEPING, "return")
            self.last_spans, self.current_timeline = self.current_timeline, None
        return result.losses


    # --- re-planning from measured costs --------------------------------------------------------

    def pass_clock(self, forward_only: bool) -> PassClock | None:
        """A clock for this call's passes while the cost profile measures, else None."""
        profile = self.cost_profile
        if forward_only or profile is None or not profile.measuring():
            return None
        return PassClock(cuda=torch.cuda.is_available(), loaders=self._loaders)

    def _after_training_call(self, clock: PassClock | None, run: IterationResult, pp_group,
                             num_microbatches: int) -> None:
        profile = self.cost_profile
        if clock is not None:
            profile.add(clock.seconds())
        profile.training_calls += 1
        if not profile.due():
            return
        profile.done = True
        device = local_device()
        comm = measure_comm(pp_group, run.tensor_shape, run.dtype, device)
        key = (pp_group.size(), num_microbatches)
        current = self._planned(*key)[0]
        seconds, stage_seconds = agree_on_costs(profile.local_table(current.num_stages), comm, device)
        costs = relative_costs(seconds, self._costs)
        self._costs = costs  # from now on every schedule is built from the measured costs
        rebuilt = self._build(*key)
        self.last_replan, chosen = decide(current, rebuilt, costs, profile.training_calls, seconds, stage_seconds)
        self._schedules = {key: (chosen, self.lower_plans(chosen))}
        self._programs.clear()
        output = profile.policy.output
        if output is not None and torch.distributed.get_rank() == 0:
            write_costs(output, self.last_replan, self.schedule_name, *key)
