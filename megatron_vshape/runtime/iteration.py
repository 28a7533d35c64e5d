"""One call of the executor on one rank: the pass loop, p2p delivery, and the gradient finish.

The values it is handed and returns are :mod:`.iteration_types`; the data-parallel reductions it holds back
and starts per chunk are :mod:`.grad_finish`.

:class:`ScheduleExecutor` (``executor.py``) owns what lives across calls (schedules, the lowered
programs, p2p groups, re-planning). Per call it hands an :class:`Iteration` a frozen
:class:`IterationSetup` (this rank's program, the stores and clocks it writes to) and megatron's
:class:`CallArgs`, and gets an :class:`IterationResult` back; the iteration runs this rank's program step
by step (see the executor's docstring for what F, B and W do) and knows nothing of the executor.
"""

from __future__ import annotations

import contextlib
import time

import torch

from megatron_vshape.schedules.core.actions import Action, Kind, VocabKind
from megatron_vshape.schedules.core.schedule import PlacementKind
from megatron_vshape.schedules.lowering.messages import Message, Payload
from megatron_vshape.schedules.lowering.program import VOCAB_CHUNK, ProgramStep

from . import combined_step, compat
from .active_stage import running_stage
from .grad_finish import GradSyncControl, v_pg_collection
from .grad_sync import BucketLauncher
from .iteration_types import CallArgs, Chunk, IterationResult, IterationSetup
from .p2p import PlanExchange, local_device
from .placement import chunk_specs, sum_tied_embedding_grads, tied_embedding_pair
from .timeline import Category
from .vocab_iteration import VocabPasses, vocab_layers_of
from .watchdog import Progress


class Iteration:
    """One call of the executor on one rank."""

    def __init__(self, setup: IterationSetup, call: CallArgs):
        from megatron.core.utils import get_model_config, get_model_type

        models = call.models
        self.setup, self.wgrad = setup, setup.wgrad
        self.config = get_model_config(models[0])
        self.model_type = get_model_type(models[0])
        self.models = models
        self.pg_collection = call.pg_collection
        self.pp_group, self.cp_size = setup.groups.pp, setup.groups.cp_size
        self.rank = setup.rank
        self.schedule = setup.program.schedule
        self.placement = self.schedule.placement
        self.forward_step_func = call.forward_step_func
        self.num_microbatches = call.num_microbatches
        self.forward_only = call.forward_only
        self.collect_non_loss_data = call.collect_non_loss_data
        self.first_val_step = call.first_val_step
        self.force_all_reduce = call.force_all_reduce
        self.vocab = self._vocab_passes(call)
        # --overlap-moe-expert-parallel-comm: every training F and B through Megatron's combined 1F1B step, an
        # overlapped pair as one call of it (combined_step.py)
        self.combined = combined_step.enabled(self.config, self.forward_only)
        if self.combined and self.vocab is not None:
            raise ValueError("--overlap-moe-expert-parallel-comm does not run with --pipeline-vocab-parallel; drop one")
        self.chunks = self._make_chunks(models, call.data_iterator)
        self.plan = setup.program.ranks[self.rank]  # this rank's steps and p2p program (the lowering chain's)
        self.deferred = self.plan.deferred()
        if self.deferred:
            self.wgrad.check_models(models, setup.schedule_name)
        # --overlap-grad-reduce with deferred W: buckets launch at their params' last W (grad_sync.py).
        # Tied copies on one rank (V) are summed after the loop, so every chunk's reductions wait for it. The
        # vocabulary shard (chunk VOCAB_CHUNK's) gets G's and D's gradients until the epilogue: only its buckets
        # wait; the chunk's other buckets launch at their last W, the other chunks start as without the flag.
        self.tied_local = self.placement.kind is PlacementKind.V and tied_embedding_pair(models) is not None
        self.after_loop = set(range(len(models))) if self.tied_local else {VOCAB_CHUNK} if self.vocab else set()
        held = self.vocab.layers.parameters() if self.vocab is not None else ()
        self.launcher = BucketLauncher(models, self.plan, self.placement.chunk_of, split=bool(self.deferred),
                                       store_of=lambda: self.wgrad.store, launch_early=not self.tied_local, held=held)
        shape = [call.seq_length // self.cp_size, call.micro_batch_size, self.config.hidden_size]
        if self.config.sequence_parallel:
            shape[0] //= setup.groups.tp_size
        self.tensor_shape = tuple(shape)
        self.dtype = self.config.pipeline_dtype or self.config.params_dtype
        self.data_store: dict[int, list] = {}
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=local_device())

    def _make_chunks(self, models, data_iterator) -> list[Chunk]:
        stages = self.placement.stages_per_device[self.rank]
        if len(models) != len(stages):
            raise ValueError(
                f"schedule {self.setup.schedule_name} needs {len(stages)} model chunk(s) per pipeline "
                f"rank, got {len(models)}; build them with megatron_vshape.runtime.placement.build_model_chunks"
            )
        if isinstance(data_iterator, list):
            iterators = data_iterator
        elif len(models) == 1 or data_iterator is None:  # None: a rank that reads no data
            iterators = [data_iterator] * len(models)
        else:
            raise ValueError("data_iterator: pass one iterator per model chunk (a list), as for megatron's virtual pipeline")
        # With vocabulary passes the last stage's output goes to the H pass like any stage's output to the
        # next: megatron's forward_step applies no loss there and its backward starts from a gradient.
        return [
            Chunk(model, iterator, spec.stage, spec.chunk, spec.vp_stage, spec.post_process and self.vocab is None)
            for model, iterator, spec in zip(models, iterators, chunk_specs(self.placement, self.rank))
        ]

    def _vocab_passes(self, call: CallArgs) -> VocabPasses | None:
        layers = vocab_layers_of(self.models)
        if self.schedule.vocab_parallel != (layers is not None):
            have = "vocabulary shard layers" if layers is not None else "no vocabulary shard layers"
            raise ValueError(f"schedule {self.setup.schedule_name} {'has' if self.schedule.vocab_parallel else 'has no'} "
                             f"vocabulary passes but the model has {have}: build both with --pipeline-vocab-parallel "
                             "or both without")
        if layers is None:
            return None
        programs = tuple(tuple(step.action for step in plan.steps) for plan in self.setup.program.ranks)
        return VocabPasses(layers, self.placement, self.rank, call.num_microbatches, call.micro_batch_size,
                           call.seq_length // self.cp_size, self.config.pipeline_dtype or self.config.params_dtype,
                           call.forward_only, programs)

    def chunk_of(self, stage: int) -> Chunk:
        return self.chunks[self.placement.chunk_of(stage)]

    # --- main loop ----------------------------------------------------------------------------

    def execute(self) -> IterationResult:
        timers = self.config.timers
        if timers is not None:
            timers("forward-backward", log_level=1).start(barrier=self.config.barrier_with_L1_time)
        progress = Progress(self.setup.schedule_name, torch.distributed.get_rank(), self.rank)
        watchdog = self.setup.watchdog
        with watchdog.watch(progress) if watchdog is not None else contextlib.nullcontext():
            progress.at("creating and warming up the pipeline's p2p groups")
            exchange = PlanExchange(self.plan.exchange, self.setup.pair_groups(), self._make_buffer)
            progress.pending = exchange.pending
            losses, pass_times = self._execute(exchange, progress)
        if timers is not None:
            timers("forward-backward").stop()
        vocab = None if self.vocab is None else (self.vocab.peak_held_bytes, self.vocab.embedding_bytes)
        return IterationResult(losses, pass_times, self.tensor_shape, self.dtype, vocab)

    def _execute(self, exchange: PlanExchange, progress: Progress):
        pass_times = [] if self.setup.record_passes else None
        spans = exchange.timeline = self.setup.spans  # where the wall time goes (timeline.py)
        clock = self.setup.clock
        with GradSyncControl(self.config, self.models, enabled=not self.forward_only,
                              launcher=self.launcher) as grad_sync:
            if self.vocab is not None:
                progress.at("the vocabulary prologue (tokens to every rank, embeddings to the first stage)")
                first = self.chunk_of(0) if self.rank == self.vocab.first_rank else None
                iterator = self.vocab.prologue(first.data_iterator if first is not None else None)
                if first is not None:
                    first.data_iterator = iterator
            steps = self.plan.steps
            for index, step in enumerate(steps):
                if index > 0 and steps[index - 1].overlaps_next and self.combined:
                    continue  # the B of a pair: it ran with its F
                # an overlapped pair (its F's step, then its B's) runs as one call of Megatron's combined step
                unit = ((index, step), (index + 1, steps[index + 1])) if step.overlaps_next and self.combined \
                    else ((index, step),)
                progress.at("the p2p exchange before a pass", index, str(step.action))
                for at, part in unit:
                    for chunk_index in part.gathers_params_of:
                        self._sync_params(chunk_index)
                    exchange.advance(at)  # the sends and receives the p2p program posts before this step
                    self._receive(part, exchange)
                progress.at("a pass", index, str(step.action))
                if spans is not None:
                    spans.mark(Category.BOOKKEEPING)
                start = time.perf_counter()
                timed = (clock.start() if clock is not None and len(unit) == 1 and self._tells_cost(step.action)
                         else None)
                if len(unit) == 2:
                    self._pair(step, unit[1][1], exchange)
                else:
                    self._run(step.action, exchange, step)
                if spans is not None:
                    spans.mark(Category(step.action.kind.value), " & ".join(str(part.action) for _, part in unit))
                if timed is not None:
                    clock.stop(step.action.kind, self.placement.layer_scale, timed, step.action.stage)
                for at, part in unit:
                    if pass_times is not None:
                        pass_times.append((part.action, start, time.perf_counter()))
                    progress.finished(str(part.action))
                    self.launcher.after_pass(at, part.action.stage, part.action.kind)
                    for chunk_index in part.reduces_grads_of:  # those in after_loop start after the loop
                        if chunk_index not in self.after_loop:
                            grad_sync.start(chunk_index)
            progress.at("the p2p exchange after the last pass")
            exchange.finish()
            if self.setup.watchdog is not None and torch.cuda.is_available():
                # On NCCL the waits above only made the stream wait: let a stuck receive show here,
                # inside the executor, where the watchdog can name it.
                progress.at("the GPU finishing this iteration's p2p")
                torch.cuda.current_stream().synchronize()
            if self.tied_local and not self.forward_only:
                sum_tied_embedding_grads(self.models)
            if self.vocab is not None:
                progress.at("the vocabulary epilogue (the embeddings' gradients to every rank)")
                self.vocab.epilogue()
            for chunk_index in range(len(self.models)):
                grad_sync.start(chunk_index)  # no-op for chunks already started
        self._check_drained()
        if not self.forward_only:
            progress.at("the gradient reduction (finalize_model_grads)")
            if spans is not None:
                spans.mark(Category.BOOKKEEPING)
            self._finalize_grads()
            if spans is not None:
                spans.mark(Category.GRAD_SYNC)
        return [item for mb in sorted(self.data_store) for item in self.data_store[mb]], pass_times

    def _tells_cost(self, action: Action) -> bool:
        """F always; B and W only when the W was deferred (else B ran the whole backward, W nothing);
        vocabulary passes never (the clock measures the layers' passes)."""
        if isinstance(action.kind, VocabKind):
            return False
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

    def _receive(self, step: ProgramStep, exchange: PlanExchange) -> None:
        for msg in step.recvs:
            tensor = exchange.recv(msg)
            chunk = self.chunk_of(msg.dst_stage)
            if msg.payload is Payload.ACTIVATION:
                chunk.inputs[msg.microbatch] = tensor.requires_grad_(not self.forward_only)
            else:
                chunk.output_grads[msg.microbatch] = tensor

    def _run(self, action: Action, exchange: PlanExchange, step: ProgramStep) -> None:
        # User code (get_batch, loss_func) asks mpu.is_pipeline_first/last_stage() during a pass:
        # the glue answers for the stage named here (see runtime.active_stage).
        if action.kind is VocabKind.H:
            self._vocab_h(action.microbatch)
            return
        if action.kind is VocabKind.G:
            self.vocab.run_g(action.microbatch)
            return
        with running_stage(action.stage, self.placement.num_stages):
            if action.kind is Kind.F:
                self._forward(action, exchange, step)
            elif action.kind is Kind.B:
                self._backward_input(action, exchange, step)
            else:
                self._backward_weight(action)

    def _forward(self, action: Action, exchange: PlanExchange, step: ProgramStep) -> None:
        chunk, mb = self.chunk_of(action.stage), action.microbatch
        input_tensor = chunk.inputs.get(mb) if action.stage > 0 else None
        store: list = []
        forward_step_func = self.forward_step_func
        last = action.stage == self.placement.num_stages - 1
        if self.vocab is not None and action.stage == 0:
            self.vocab.hand_embedding(mb)
        if self.vocab is not None and last:
            forward_step_func = self.vocab.wrap_last_forward(forward_step_func, mb)
        if self.combined:
            output, num_tokens, _ = combined_step.combined_step(
                forward_step_func=forward_step_func, config=self.config, num_microbatches=self.num_microbatches,
                forward_data_store=store, f_chunk=chunk, f_input=input_tensor,
                collect_non_loss_data=self.collect_non_loss_data, is_first_microbatch=mb == 0, current_microbatch=mb,
                cp_size=self.cp_size)
        else:
            output, num_tokens = compat.forward_step(
                forward_step_func=forward_step_func, data_iterator=chunk.data_iterator,
                model=chunk.model, num_microbatches=self.num_microbatches, input_tensor=input_tensor,
                forward_data_store=store, config=self.config, cp_group_size=self.cp_size,
                collect_non_loss_data=self.collect_non_loss_data,
                is_first_microbatch=_first_val_step(self.first_val_step, self.forward_only, mb == 0),
                current_microbatch=mb, vp_stage=chunk.vp_stage, is_last_stage=chunk.is_last_stage,
            )
        self._keep_loss_step(mb, store, num_tokens)
        self._after_forward(action, output, exchange, step)

    def _after_forward(self, action: Action, output, exchange: PlanExchange, step: ProgramStep) -> None:
        """An F's output: to its consumer, and kept for its B (or, with vocabulary passes, for its H)."""
        chunk, mb = self.chunk_of(action.stage), action.microbatch
        last = action.stage == self.placement.num_stages - 1
        if self.vocab is not None and last:
            self.vocab.record_labels(mb)
            chunk.outputs[mb] = output  # its H reads it (and deallocates it when training)
            if self.forward_only:
                chunk.inputs.pop(mb, None)
            return
        if not chunk.is_last_stage:
            self._deliver(action, output, Payload.ACTIVATION, exchange, step)
        if self.forward_only:
            chunk.inputs.pop(mb, None)
            return
        chunk.outputs[mb] = output
        if not chunk.is_last_stage:
            _deallocate(output, self.config)

    def _b_operands(self, chunk, mb: int, step: ProgramStep):
        """What a B of ``chunk`` for microbatch ``mb`` takes (its forward's input and output, the output's
        gradient), removed from the chunk's buffers, and the capture that holds its weight gradients for W."""
        output_grad = None if chunk.is_last_stage else chunk.output_grads.pop(mb)
        input_tensor = chunk.inputs.pop(mb, None)
        output = chunk.outputs.pop(mb)
        capture = (self.wgrad.capture((chunk.index, mb), chunk.model, self.setup.schedule_name)
                   if step.defers_w else contextlib.nullcontext())
        return input_tensor, output, output_grad, capture

    def _backward_input(self, action: Action, exchange: PlanExchange, step: ProgramStep) -> None:
        chunk, mb = self.chunk_of(action.stage), action.microbatch
        input_tensor, output, output_grad, capture = self._b_operands(chunk, mb, step)
        with capture, self.launcher.deferred_b(step.defers_w):
            if self.combined:
                _, _, input_grad = combined_step.combined_step(
                    forward_step_func=self.forward_step_func, config=self.config,
                    num_microbatches=self.num_microbatches, forward_data_store=[], b_chunk=chunk,
                    b_input=input_tensor, b_output=output, b_output_grad=output_grad, cp_size=self.cp_size)
            else:
                input_grad = compat.backward_step(input_tensor, output, output_grad, self.model_type, self.config)
        self._after_backward(action, input_grad, exchange, step)

    def _after_backward(self, action: Action, input_grad, exchange: PlanExchange, step: ProgramStep) -> None:
        """A B's input gradient: to the previous stage (or, on the first stage, the vocabulary embedding's)."""
        mb = action.microbatch
        if action.stage > 0:
            self._deliver(action, input_grad, Payload.GRADIENT, exchange, step)
        elif self.vocab is not None:
            self.vocab.take_embedding_grad(mb)

    def _pair(self, f_step: ProgramStep, b_step: ProgramStep, exchange: PlanExchange) -> None:
        """An overlapped F&B pair: one call of Megatron's combined step (combined_step.py). The B's weight
        gradients are captured for its W as for a B alone; the stage that answers Megatron's first/last-stage
        questions is the F's (its batch and loss are the ones read during the call)."""
        forward, backward = f_step.action, b_step.action
        f_chunk, b_chunk = self.chunk_of(forward.stage), self.chunk_of(backward.stage)
        f_mb, b_mb = forward.microbatch, backward.microbatch
        f_input = f_chunk.inputs.get(f_mb) if forward.stage > 0 else None
        b_input, b_output, output_grad, capture = self._b_operands(b_chunk, b_mb, b_step)
        store: list = []
        with running_stage(forward.stage, self.placement.num_stages), capture, \
                self.launcher.deferred_b(b_step.defers_w):
            output, num_tokens, input_grad = combined_step.combined_step(
                forward_step_func=self.forward_step_func, config=self.config, num_microbatches=self.num_microbatches,
                forward_data_store=store, f_chunk=f_chunk, f_input=f_input, b_chunk=b_chunk, b_input=b_input,
                b_output=b_output, b_output_grad=output_grad, collect_non_loss_data=self.collect_non_loss_data,
                is_first_microbatch=f_mb == 0, current_microbatch=f_mb, cp_size=self.cp_size)
        self._keep_loss_step(f_mb, store, num_tokens)
        with running_stage(forward.stage, self.placement.num_stages):
            self._after_forward(forward, output, exchange, f_step)
        with running_stage(backward.stage, self.placement.num_stages):
            self._after_backward(backward, input_grad, exchange, b_step)

    def _vocab_h(self, mb: int) -> None:
        """H(k): on the last stage's rank its output goes in and the gradient for its B comes out."""
        holder = self.rank == self.vocab.last_rank
        chunk = self.chunk_of(self.placement.num_stages - 1) if holder else None
        hidden = chunk.outputs[mb] if holder else None
        grad = self.vocab.run_h(mb, hidden, self._vocab_loss(chunk, mb) if holder else None)
        if not holder:
            return
        if self.forward_only:
            chunk.outputs.pop(mb)
            return
        chunk.output_grads[mb] = grad
        _deallocate(hidden, self.config)

    def _vocab_loss(self, chunk: Chunk, mb: int):
        """The script's loss function on the H pass's per-token loss, as megatron's forward_step applies it
        on a last stage (scaling, token count, reported values); training: d(objective)/d(per-token loss)."""

        def loss(per_token_loss: torch.Tensor, loss_func):
            leaf = per_token_loss.detach().requires_grad_(not self.forward_only)
            if self.config.timers is not None:  # forward_step_calc_loss stops the timer forward_step starts
                self.config.timers("forward-compute", log_level=2).start()
            store: list = []
            with running_stage(chunk.stage, self.placement.num_stages):
                output, num_tokens = compat.forward_step_calc_loss(
                    chunk.model, leaf, loss_func, self.config, chunk.vp_stage, self.collect_non_loss_data,
                    self.num_microbatches, store, self.cp_size)
            self._keep_loss_step(mb, store, num_tokens)
            if self.forward_only:
                return None
            return compat.backward_step(leaf, output, None, self.model_type, self.config)

        return loss

    def _keep_loss_step(self, mb: int, store: list, num_tokens) -> None:
        """What megatron's loss step of microbatch ``mb`` reported (the call's return value) and its tokens."""
        if store:
            self.data_store.setdefault(mb, []).extend(store)
        self.total_num_tokens += num_tokens

    def _backward_weight(self, action: Action) -> None:
        if Action(Kind.B, action.stage, action.microbatch) in self.deferred:
            index = self.chunk_of(action.stage).index
            self.wgrad.run((index, action.microbatch), self.launcher.weight_done(index))

    def _deliver(self, action: Action, tensor, payload: Payload, exchange, step: ProgramStep) -> None:
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
        pending = self.wgrad.pending()
        if left or pending:
            raise RuntimeError(f"schedule left work undone: outputs {left}, weight-grad keys {pending}")
        if self.vocab is not None:
            self.vocab.check_drained()

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
            pg_collection = v_pg_collection(self.pg_collection) if is_v else self.pg_collection
            compat.call_finalize(func, self.models, num_tokens, pg_collection, self.force_all_reduce)


def _deallocate(output, config) -> None:
    if getattr(config, "deallocate_pipeline_outputs", False) and isinstance(output, torch.Tensor):
        output.data = torch.empty((1,), device=output.device, dtype=output.dtype)


def _first_val_step(first_val_step, forward_only, cond: bool) -> bool:
    if first_val_step is not None and forward_only:
        return first_val_step and cond
    return cond
