"""One call of the executor on one rank: the pass loop, p2p delivery, and the gradient finish.

:class:`ScheduleExecutor` (``executor.py``) owns what lives across calls (schedules, lowered plans,
p2p groups and programs, re-planning); an :class:`Iteration` is built per call from them and runs
this rank's plan action by action (see the executor's docstring for what F, B and W do).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from megatron_vshape.schedules.core.actions import Action, Kind
from megatron_vshape.schedules.core.schedule import PlacementKind, Schedule
from megatron_vshape.schedules.lowering.exchange import forward_only_plan as _forward_only_plan
from megatron_vshape.schedules.lowering.messages import DevicePlan, Message, Payload, Step

from . import compat, te_wgrad
from .active_stage import running_stage
from .grad_sync import BucketLauncher
from .p2p import PlanExchange, local_device
from .placement import LocalGroup, chunk_specs, sum_tied_embedding_grads, tied_embedding_pair
from .timeline import Category
from .watchdog import Progress

if TYPE_CHECKING:
    from .executor import ScheduleExecutor


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


class Iteration:
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
        self.deferred = set() if forward_only else (
            _deferred_backwards(self.schedule, self.plan, split_remote_pairs=not executor.fuse_remote_pairs)
            | te_wgrad.te_deferred_backwards(self.plan, models))
        if self.deferred:
            executor._wgrad.check_models(models, executor.schedule_name)
        # --overlap-grad-reduce with deferred W: buckets launch at their params' last W (grad_sync.py).
        # Tied copies on one rank (V) are summed after the loop, so their reductions all wait for it.
        tied_local = self.placement.kind is PlacementKind.V and tied_embedding_pair(models) is not None
        self.launcher = BucketLauncher(models, self.plan, self.placement.chunk_of, split=bool(self.deferred),
                                       launch_early=not tied_local)
        shape = [seq_length // self.cp_size, micro_batch_size, self.config.hidden_size]
        if self.config.sequence_parallel:
            shape[0] //= tp_size
        self.tensor_shape = tuple(shape)
        self.dtype = self.config.pipeline_dtype or self.config.params_dtype
        self.data_store: dict[int, list] = {}
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=local_device())

    def _make_chunks(self, models, data_iterator) -> list[Chunk]:
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
            Chunk(model, iterator, spec.stage, spec.chunk, spec.vp_stage, spec.post_process)
            for model, iterator, spec in zip(models, iterators, chunk_specs(self.placement, self.rank))
        ]

    def chunk_of(self, stage: int) -> Chunk:
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
        spans = exchange.timeline = self.executor.current_timeline  # where the wall time goes (timeline.py)
        self.clock = clock = self.executor.pass_clock(self.forward_only)
        with _GradSyncControl(self.config, self.models, enabled=not self.forward_only,
                              launcher=self.launcher) as grad_sync:
            for index, step in enumerate(self.plan.steps):
                progress.at("the p2p exchange before a pass", index, str(step.action))
                for chunk_index in first_forward.get(index, ()):
                    self._sync_params(chunk_index)
                exchange.advance(index)  # the sends and receives the p2p program posts before this step
                self._receive(step, exchange)
                progress.at("a pass", index, str(step.action))
                if spans is not None:
                    spans.mark(Category.BOOKKEEPING)
                start = time.perf_counter()
                timed = clock.start() if clock is not None and self._tells_cost(step.action) else None
                self._run(step.action, exchange, step)
                if spans is not None:
                    spans.mark(Category(step.action.kind.value), str(step.action))
                if timed is not None:
                    clock.stop(step.action.kind, self.placement.layer_scale, timed, step.action.stage)
                if timeline is not None:
                    timeline.append((step.action, start, time.perf_counter()))
                progress.finished(str(step.action))
                self.launcher.after_pass(index, step.action.stage, step.action.kind, self.executor._wgrad.store)
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
            if spans is not None:
                spans.mark(Category.BOOKKEEPING)
            self._finalize_grads()
            if spans is not None:
                spans.mark(Category.GRAD_SYNC)
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
        with capture, self.launcher.deferred_b(action in self.deferred):
            input_grad = compat.backward_step(input_tensor, output, output_grad, self.model_type, self.config)
        if action.stage > 0:
            self._deliver(action, input_grad, Payload.GRADIENT, exchange, step)

    def _backward_weight(self, action: Action) -> None:
        if Action(Kind.B, action.stage, action.microbatch) in self.deferred:
            index = self.chunk_of(action.stage).index
            self.executor._wgrad.run((index, action.microbatch),
                                     self.launcher.weight_done(index, self.executor._wgrad.store))

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
        return torch.empty(self.tensor_shape, dtype=self.dtype, device=local_device())

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

    def __init__(self, config, models, enabled: bool, launcher: BucketLauncher | None = None):
        self.config, self.models, self.enabled, self.launcher = config, models, enabled, launcher
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
        if self.launcher is not None and self.launcher.launch_rest(chunk_index):
            return  # a split backward: bucket by bucket, what is not launched yet (grad_sync.py)
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


def _deferred_backwards(schedule: Schedule, plan: DevicePlan, split_remote_pairs: bool = True) -> set[Action]:
    """B actions that leave their weight gradients to the store, for their W pass to compute.

    A B directly followed by its own W runs as one ordinary backward, but only when its input gradient
    stays on this rank (first stage, or the consumer is local): the fused backward sends that gradient
    only after the weight gradients too, so for a consumer on another rank it would arrive W's
    duration later than the schedule (and the simulator) assume. Fused-backward schedules (1F1B,
    GPipe, interleaved) are simulated that way and never split. ``split_remote_pairs=False`` is the old
    policy (every such pair fused), kept for the benchmarks' side-by-side rows.
    """
    if schedule.fused_backward:
        return set()
    steps = plan.steps
    deferred = set()
    for i, step in enumerate(steps):
        action = step.action
        if action.kind is Kind.B:
            follows = i + 1 < len(steps) and steps[i + 1].action == Action(Kind.W, action.stage, action.microbatch)
            if not follows or (split_remote_pairs and step.sends):
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
