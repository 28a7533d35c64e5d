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

Messages follow ``schedules.lower``: see :mod:`megatron_vshape.runtime.p2p`. Between two stages of
one rank (the tip of the V) tensors are handed over locally.

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

import contextlib
import time
from dataclasses import dataclass, field

import torch

from megatron_vshape.schedules import (
    SCHEDULES,
    Action,
    Costs,
    DevicePlan,
    Kind,
    Message,
    Payload,
    PlacementKind,
    Schedule,
    ScheduleError,
    Step,
    get_schedule,
    lower,
    validate,
)
from megatron_vshape.schedules.exchange import Op, exchange_programs
from megatron_vshape.schedules.exchange import forward_only_plan as _forward_only_plan

from . import compat
from .active_stage import running_stage
from .p2p import PairGroups, PlanExchange
from .placement import LocalGroup, chunk_specs, sum_tied_embedding_grads, tied_embedding_pair
from .replan import (
    CostProfile,
    PassClock,
    Replan,
    ReplanPolicy,
    agree_on_costs,
    decide,
    measure_comm,
    relative_costs,
    write_costs,
)
from .watchdog import Progress, ScheduleWatchdog


class WeightGradAdapter:
    """The executor's view of the weight-gradient store of ``runtime/wgrad.py``.

    Created lazily, on the first B that defers its W: fused schedules never install the split hook.
    A captured B that defers nothing on a chunk with linear layers raises (no silent fallback to a
    full backward in B); ``counts()`` says how many weight gradients were deferred and run.
    """

    def __init__(self):
        self._store = None

    def _get(self):
        if self._store is None:
            from . import wgrad

            wgrad.enable_wgrad_split()
            self._store = wgrad.WeightGradStore()
        return self._store

    @contextlib.contextmanager
    def capture(self, key, chunk_model, schedule_name: str):
        from . import wgrad

        store = self._get()
        with store.capture(key):
            yield
        wgrad.check_deferred(store, key, chunk_model, schedule_name)

    def run(self, key) -> None:
        self._get().run(key)

    def pending(self) -> list:
        return list(self._store.pending()) if self._store is not None else []

    def counts(self):
        """Weight gradients deferred and run since this executor was built (``wgrad.WgradCounts``)."""
        from . import wgrad

        return self._store.counts() if self._store is not None else wgrad.WgradCounts()

    def check_models(self, models, schedule_name: str) -> None:
        """Reject what the split cannot honour (raises before any compute): DDP settings, TE linears."""
        from . import te_wgrad, wgrad

        for model in models:
            ddp_config = getattr(model, "ddp_config", None)
            if ddp_config is not None:
                wgrad.check_ddp_config(ddp_config, schedule_name)
        te_wgrad.check_te_split(models, schedule_name)


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
    simulator or to measure F/B/W costs. With ``replan`` the executor times its passes during the
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


@dataclass
class _Chunk:
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


class ScheduleExecutor:
    """The callable returned by :func:`build_forward_backward_func` (no state shared across instances)."""

    def __init__(self, name, costs, chunks, memory_limit):
        self.schedule_name = name
        self._costs, self._chunks, self._memory_limit = costs, chunks, memory_limit
        self._schedules: dict[tuple[int, int], tuple[Schedule, tuple[DevicePlan, ...]]] = {}
        self._groups: dict[tuple[int, ...], PairGroups] = {}  # per pipeline group (its global ranks)
        self._programs: dict[tuple[int, int, bool], tuple[tuple[Op, ...], ...]] = {}  # p2p, every rank
        self._wgrad = WeightGradAdapter()
        self.last_wgrad_counts = None  # weight gradients deferred / run by the last call (wgrad.WgradCounts)
        self.record_timeline = False
        self.last_timeline: list[tuple[Action, float, float]] = []
        self.cost_profile: CostProfile | None = None  # --pipeline-costs auto
        self.last_replan: Replan | None = None
        self.watchdog: ScheduleWatchdog | None = None

    @property
    def costs(self) -> Costs:
        """The costs the running schedule was built from (measured ones after a re-plan)."""
        return self._costs

    # --- schedule -----------------------------------------------------------------------------

    def schedule(self, num_devices: int, num_microbatches: int) -> Schedule:
        return self._lowered(num_devices, num_microbatches)[0]

    def _lowered(self, num_devices, num_microbatches):
        key = (num_devices, num_microbatches)
        if key not in self._schedules:
            schedule = self._build(num_devices, num_microbatches)
            self._schedules[key] = (schedule, self.lower_plans(schedule))
        return self._schedules[key]

    def lower_plans(self, schedule: Schedule) -> tuple[DevicePlan, ...]:
        """Every rank's plan of ``schedule`` (the exchange programs are derived from all of them)."""
        return lower(schedule)

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

    def exchange_program(self, num_devices: int, num_microbatches: int, forward_only: bool, rank: int):
        """This rank's p2p program (``schedules.exchange``), derived from every rank's plan."""
        key = (num_devices, num_microbatches, forward_only)
        if key not in self._programs:
            plans = self._lowered(num_devices, num_microbatches)[1]
            if forward_only:
                plans = tuple(map(_forward_only_plan, plans))
            self._programs[key] = exchange_programs(plans, self._costs)
        return self._programs[key][rank]

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
        **unused,
    ):
        if adjust_tensor_shapes_fn is not None:
            raise ValueError("adjust_tensor_shapes_fn is not supported by the vshape executor; pass None")
        first = model[0] if isinstance(model, list) else model
        if getattr(getattr(first, "config", None), "defer_embedding_wgrad_compute", False):
            raise ValueError("--defer-embedding-wgrad-compute is not supported with --pipeline-schedule; drop it")
        models = model if isinstance(model, list) else [model]
        before = self._wgrad.counts()
        run = _Iteration(self, forward_step_func, data_iterator, models, num_microbatches,
                         seq_length, micro_batch_size, forward_only, collect_non_loss_data,
                         first_val_step, force_all_reduce, pg_collection)
        losses = run.execute()
        if not forward_only and self.cost_profile is not None:
            self._after_training_call(run)
        self.last_wgrad_counts = self._wgrad.counts() - before
        return losses


    # --- re-planning from measured costs --------------------------------------------------------

    def pass_clock(self, forward_only: bool) -> PassClock | None:
        """A clock for this call's passes while the cost profile measures, else None."""
        profile = self.cost_profile
        if forward_only or profile is None or not profile.measuring():
            return None
        return PassClock(cuda=torch.cuda.is_available())

    def _after_training_call(self, run: _Iteration) -> None:
        profile = self.cost_profile
        if run.clock is not None:
            profile.add(run.clock.seconds())
        profile.training_calls += 1
        if not profile.due():
            return
        profile.done = True
        device = _device()
        comm = measure_comm(run.pp_group, run.tensor_shape, run.dtype, device)
        seconds = agree_on_costs(profile.local_medians(), comm, device)
        costs = relative_costs(seconds, self._costs)
        key = (run.pp_group.size(), run.num_microbatches)
        current = self._lowered(*key)[0]
        self._costs = costs  # from now on every schedule is built from the measured costs
        rebuilt = self._build(*key)
        self.last_replan, chosen = decide(current, rebuilt, costs, profile.training_calls, seconds)
        self._schedules = {key: (chosen, lower(chosen))}
        self._programs.clear()
        output = profile.policy.output
        if output is not None and torch.distributed.get_rank() == 0:
            write_costs(output, self.last_replan, self.schedule_name, *key)


class _Iteration:
    """One call of the executor on one rank."""

    def __init__(self, executor: ScheduleExecutor, forward_step_func, data_iterator, models,
                 num_microbatches, seq_length, micro_batch_size, forward_only, collect_non_loss_data,
                 first_val_step, force_all_reduce, pg_collection):
        from megatron.core import parallel_state
        from megatron.core.utils import get_model_config, get_model_type

        self.executor = executor
        self.config = get_model_config(models[0])
        self.model_type = get_model_type(models[0])
        self.models = models
        self.pg_collection = pg_collection
        self.pp_group = pg_collection.pp if pg_collection is not None else (
            parallel_state.get_pipeline_model_parallel_group())
        self.cp_size = pg_collection.cp.size() if pg_collection is not None else (
            parallel_state.get_context_parallel_world_size())
        tp_size = pg_collection.tp.size() if pg_collection is not None else (
            parallel_state.get_tensor_model_parallel_world_size())
        self.rank, num_devices = self.pp_group.rank(), self.pp_group.size()
        self.schedule, plans = executor._lowered(num_devices, num_microbatches)
        self.placement = self.schedule.placement
        self.forward_step_func = forward_step_func
        self.num_microbatches = num_microbatches
        self.forward_only = forward_only
        self.collect_non_loss_data = collect_non_loss_data
        self.first_val_step = first_val_step
        self.force_all_reduce = force_all_reduce
        self.chunks = self._make_chunks(models, data_iterator)
        plan = plans[self.rank]
        self.plan = _forward_only_plan(plan) if forward_only else plan
        self.program = executor.exchange_program(num_devices, num_microbatches, forward_only, self.rank)
        self.deferred = set() if forward_only else _deferred_backwards(self.schedule, self.plan)
        if self.deferred:
            executor._wgrad.check_models(models, executor.schedule_name)
        shape = [seq_length // self.cp_size, micro_batch_size, self.config.hidden_size]
        if self.config.sequence_parallel:
            shape[0] //= tp_size
        self.tensor_shape = tuple(shape)
        self.dtype = self.config.pipeline_dtype or self.config.params_dtype
        self.data_store: dict[int, list] = {}
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=_device())

    def _make_chunks(self, models, data_iterator) -> list[_Chunk]:
        stages = self.placement.stages_per_device[self.rank]
        if len(models) != len(stages):
            raise ValueError(
                f"schedule {self.executor.schedule_name} needs {len(stages)} model chunk(s) per pipeline "
                f"rank, got {len(models)}; build them with megatron_vshape.runtime.placement.build_model_chunks"
            )
        if isinstance(data_iterator, list):
            iterators = data_iterator
        elif len(models) == 1 or data_iterator is None:  # None: a rank that reads no data
            iterators = [data_iterator] * len(models)
        else:
            raise ValueError("data_iterator: pass one iterator per model chunk (a list), as for megatron's virtual pipeline")
        return [
            _Chunk(model, iterator, spec.stage, spec.chunk, spec.vp_stage, spec.post_process)
            for model, iterator, spec in zip(models, iterators, chunk_specs(self.placement, self.rank))
        ]

    def chunk_of(self, stage: int) -> _Chunk:
        return self.chunks[self.placement.chunk_of(stage)]

    # --- main loop ----------------------------------------------------------------------------

    def execute(self):
        timers = self.config.timers
        if timers is not None:
            timers("forward-backward", log_level=1).start(barrier=self.config.barrier_with_L1_time)
        progress = Progress(self.executor.schedule_name, torch.distributed.get_rank(), self.rank)
        watchdog = self.executor.watchdog
        with watchdog.watch(progress) if watchdog is not None else contextlib.nullcontext():
            progress.at("creating and warming up the pipeline's p2p groups")
            exchange = PlanExchange(self.program, self.executor.pair_groups(self.pp_group), self._make_buffer)
            progress.pending = exchange.pending
            result = self._execute(exchange, progress)
        if timers is not None:
            timers("forward-backward").stop()
        return result

    def _execute(self, exchange: PlanExchange, progress: Progress):
        # Tied copies on one rank (V) are summed before any data-parallel reduction starts, so
        # their reductions wait until the whole iteration's backward is done.
        tied_local = self.placement.kind is PlacementKind.V and tied_embedding_pair(self.models) is not None
        last_backward = {} if tied_local else _last_backward_step(self.plan, self.placement)
        first_forward = _first_forward_step(self.plan, self.placement)
        timeline = [] if self.executor.record_timeline else None
        self.clock = clock = self.executor.pass_clock(self.forward_only)
        with _GradSyncControl(self.config, self.models, enabled=not self.forward_only) as grad_sync:
            for index, step in enumerate(self.plan.steps):
                progress.at("the p2p exchange before a pass", index, str(step.action))
                for chunk_index in first_forward.get(index, ()):
                    self._sync_params(chunk_index)
                exchange.advance(index)  # the sends and receives the p2p program posts before this step
                self._receive(step, exchange)
                progress.at("a pass", index, str(step.action))
                start = time.perf_counter()
                timed = clock.start() if clock is not None and self._tells_cost(step.action) else None
                self._run(step.action, exchange, step)
                if timed is not None:
                    clock.stop(step.action.kind, self.placement.layer_scale, timed)
                if timeline is not None:
                    timeline.append((step.action, start, time.perf_counter()))
                progress.finished(str(step.action))
                for chunk_index in last_backward.get(index, ()):
                    grad_sync.start(chunk_index)
            progress.at("the p2p exchange after the last pass")
            exchange.finish()
            if self.executor.watchdog is not None and torch.cuda.is_available():
                # On NCCL the waits above only made the stream wait: let a stuck receive show here,
                # inside the executor, where the watchdog can name it.
                progress.at("the GPU finishing this iteration's p2p")
                torch.cuda.current_stream().synchronize()
            if tied_local and not self.forward_only:
                sum_tied_embedding_grads(self.models)
            for chunk_index in range(len(self.models)):
                grad_sync.start(chunk_index)  # no-op for chunks already started
        if timeline is not None:
            self.executor.last_timeline = timeline
        self._check_drained()
        if not self.forward_only:
            progress.at("the gradient reduction (finalize_model_grads)")
            self._finalize_grads()
        return [item for mb in sorted(self.data_store) for item in self.data_store[mb]]

    def _tells_cost(self, action: Action) -> bool:
        """F always; B and W only when the W was deferred (else B ran the whole backward, W nothing)."""
        if action.kind is Kind.F:
            return True
        return Action(Kind.B, action.stage, action.microbatch) in self.deferred

    def _sync_params(self, chunk_index: int) -> None:
        """Distributed optimizer with overlapped param gather: finish a chunk's gather before its first F."""
        func = self.config.param_sync_func
        if func is None or self.forward_only:
            return
        func = func[chunk_index] if isinstance(func, list) else func
        func(self.models[chunk_index].parameters())

    def _receive(self, step: Step, exchange: PlanExchange) -> None:
        for msg in step.recvs:
            tensor = exchange.recv(msg)
            chunk = self.chunk_of(msg.dst_stage)
            if msg.payload is Payload.ACTIVATION:
                chunk.inputs[msg.microbatch] = tensor.requires_grad_(not self.forward_only)
            else:
                chunk.output_grads[msg.microbatch] = tensor

    def _run(self, action: Action, exchange: PlanExchange, step: Step) -> None:
        # User code (get_batch, loss_func) asks mpu.is_pipeline_first/last_stage() during a pass:
        # the glue answers for the stage named here (see runtime.active_stage).
        with running_stage(action.stage, self.placement.num_stages):
            if action.kind is Kind.F:
                self._forward(action, exchange, step)
            elif action.kind is Kind.B:
                self._backward_input(action, exchange, step)
            else:
                self._backward_weight(action)

    def _forward(self, action: Action, exchange: PlanExchange, step: Step) -> None:
        chunk, mb = self.chunk_of(action.stage), action.microbatch
        input_tensor = chunk.inputs.get(mb) if action.stage > 0 else None
        store: list = []
        output, num_tokens = compat.forward_step(
            forward_step_func=self.forward_step_func, data_iterator=chunk.data_iterator,
            model=chunk.model, num_microbatches=self.num_microbatches, input_tensor=input_tensor,
            forward_data_store=store, config=self.config, cp_group_size=self.cp_size,
            collect_non_loss_data=self.collect_non_loss_data,
            is_first_microbatch=_first_val_step(self.first_val_step, self.forward_only, mb == 0),
            current_microbatch=mb, vp_stage=chunk.vp_stage, is_last_stage=chunk.is_last_stage,
        )
        if store:
            self.data_store.setdefault(mb, []).extend(store)
        self.total_num_tokens += num_tokens
        if not chunk.is_last_stage:
            self._deliver(action, output, Payload.ACTIVATION, exchange, step)
        if self.forward_only:
            chunk.inputs.pop(mb, None)
            return
        chunk.outputs[mb] = output
        if not chunk.is_last_stage:
            _deallocate(output, self.config)

    def _backward_input(self, action: Action, exchange: PlanExchange, step: Step) -> None:
        chunk, mb = self.chunk_of(action.stage), action.microbatch
        output_grad = None if chunk.is_last_stage else chunk.output_grads.pop(mb)
        input_tensor = chunk.inputs.pop(mb, None)
        output = chunk.outputs.pop(mb)
        capture = (self.executor._wgrad.capture((chunk.index, mb), chunk.model, self.executor.schedule_name)
                   if action in self.deferred else contextlib.nullcontext())
        with capture:
            input_grad = compat.backward_step(input_tensor, output, output_grad, self.model_type, self.config)
        if action.stage > 0:
            self._deliver(action, input_grad, Payload.GRADIENT, exchange, step)

    def _backward_weight(self, action: Action) -> None:
        if Action(Kind.B, action.stage, action.microbatch) in self.deferred:
            self.executor._wgrad.run((self.chunk_of(action.stage).index, action.microbatch))

    def _deliver(self, action: Action, tensor, payload: Payload, exchange, step: Step) -> None:
        """Send the output of ``action`` to its consumer, or hand it over on this rank."""
        if step.sends:
            for msg in step.sends:
                exchange.send(msg, tensor)
            return
        consumer = action.stage + 1 if payload is Payload.ACTIVATION else action.stage - 1
        chunk = self.chunk_of(consumer)  # same rank: the tip of the V (or two local stages)
        if payload is Payload.ACTIVATION:
            chunk.inputs[action.microbatch] = tensor.detach().requires_grad_(not self.forward_only)
        else:
            chunk.output_grads[action.microbatch] = tensor

    def _make_buffer(self, msg: Message) -> torch.Tensor:
        return torch.empty(self.tensor_shape, dtype=self.dtype, device=_device())

    def _check_drained(self) -> None:
        left = [(c.stage, sorted(c.outputs)) for c in self.chunks if c.outputs]
        pending = self.executor._wgrad.pending()
        if left or pending:
            raise RuntimeError(f"schedule left work undone: outputs {left}, weight-grad keys {pending}")

    # --- gradients ----------------------------------------------------------------------------

    def _finalize_grads(self) -> None:
        is_v = self.placement.kind is PlacementKind.V
        num_tokens = self.total_num_tokens if self.config.calculate_per_token_loss else None
        if num_tokens is not None and is_v:
            # megatron broadcasts the token count from the last pipeline rank; on a V it lives on rank 0.
            src = torch.distributed.get_process_group_ranks(self.pp_group)[0]
            torch.distributed.broadcast(num_tokens, src=src, group=self.pp_group)
        func = self.config.finalize_model_grads_func
        if func is not None:
            pg_collection = _v_pg_collection(self.pg_collection) if is_v else self.pg_collection
            compat.call_finalize(func, self.models, num_tokens, pg_collection, self.force_all_reduce)


class _GradSyncControl:
    """Holds back data-parallel gradient reduction until every backward of a chunk is done."""

    def __init__(self, config, models, enabled: bool):
        self.config, self.models, self.enabled = config, models, enabled
        self._stack = contextlib.ExitStack()
        self._started: set[int] = set()

    def __enter__(self):
        if not self.enabled:
            return self
        no_sync = self.config.no_sync_func
        funcs = no_sync if isinstance(no_sync, list) else (
            [no_sync] if no_sync is not None else [m.no_sync for m in self.models if hasattr(m, "no_sync")])
        for func in funcs:
            self._stack.enter_context(func())
        return self

    def start(self, chunk_index: int) -> None:
        """All W of chunk ``chunk_index`` are done: launch its (overlapped) reduction now."""
        if not self.enabled or chunk_index in self._started:
            return
        self._started.add(chunk_index)
        model = self.models[chunk_index]
        ddp_config = getattr(model, "ddp_config", None)
        if ddp_config is None or not ddp_config.overlap_grad_reduce:
            return  # finalize_model_grads reduces synchronously
        grad_sync = self.config.grad_sync_func
        if isinstance(grad_sync, list):
            grad_sync[chunk_index](model.parameters())
        elif grad_sync is not None:
            grad_sync(model.parameters())
        else:
            model.start_grad_sync()

    def __exit__(self, *exc):
        self._stack.close()
        return False


def _deferred_backwards(schedule: Schedule, plan: DevicePlan) -> set[Action]:
    """B actions whose W runs later (so B must leave the weight gradients to the store)."""
    if schedule.fused_backward:
        return set()
    actions = [s.action for s in plan.steps]
    deferred = set()
    for i, action in enumerate(actions):
        if action.kind is Kind.B:
            follows = i + 1 < len(actions) and actions[i + 1] == Action(Kind.W, action.stage, action.microbatch)
            if not follows:
                deferred.add(action)
    return deferred


def _last_backward_step(plan: DevicePlan, placement) -> dict[int, list[int]]:
    """Step index -> chunks whose last backward pass (B or W) is that step."""
    last: dict[int, int] = {}
    for index, step in enumerate(plan.steps):
        if step.action.kind is not Kind.F:
            last[step.action.stage] = index
    out: dict[int, list[int]] = {}
    for stage, index in last.items():
        out.setdefault(index, []).append(placement.chunk_of(stage))
    return out


def _first_forward_step(plan: DevicePlan, placement) -> dict[int, list[int]]:
    """Step index -> chunks whose first forward pass is that step."""
    first: dict[int, int] = {}
    for index, step in enumerate(plan.steps):
        if step.action.kind is Kind.F:
            first.setdefault(step.action.stage, index)
    out: dict[int, list[int]] = {}
    for stage, index in first.items():
        out.setdefault(index, []).append(placement.chunk_of(stage))
    return out


def _v_pg_collection(pg_collection):
    """Process groups for finalize on a V: no cross-rank embedding group (tied copies are local)."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    if pg_collection is None:
        pg_collection = ProcessGroupCollection()
        pg_collection.tp = parallel_state.get_tensor_model_parallel_group()
        pg_collection.pp = parallel_state.get_pipeline_model_parallel_group()
        pg_collection.cp = parallel_state.get_context_parallel_group()
        pg_collection.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    else:
        import copy

        pg_collection = copy.copy(pg_collection)
    pg_collection.embd = LocalGroup()  # tied copies are summed locally after finalize
    pg_collection.pos_embd = None
    return pg_collection


def _deallocate(output, config) -> None:
    if getattr(config, "deallocate_pipeline_outputs", False) and isinstance(output, torch.Tensor):
        output.data = torch.empty((1,), device=output.device, dtype=output.dtype)


def _first_val_step(first_val_step, forward_only, cond: bool) -> bool:
    if first_val_step is not None and forward_only:
        return first_val_step and cond
    return cond


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
