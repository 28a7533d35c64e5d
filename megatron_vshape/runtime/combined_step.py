"""The executor's F, B and overlapped F&B pair through Megatron's own combined 1F1B step (issue 43).

With ``--overlap-moe-expert-parallel-comm`` Megatron runs every training pass of its interleaved schedule
through ``combined_1f1b.combined_forward_backward_step``: the script's ``forward_step`` returns the GPT model's
schedule plan (``return_schedule_plan=True``), and the plan's ``run`` executes one microbatch's forward and
another's backward layer by layer, each expert-parallel all-to-all (dispatch, combine) on the communication
stream under the other pass's attention or MLP compute. The executor calls that same function, not a copy:

* an overlapped pair (``ProgramStep.overlaps_next``): the F's chunk as ``f_model``, the B's as ``b_model``;
* an F alone: ``b_model`` None; a B alone: ``f_model`` None. Every training F and B takes this path when
  the flag is on, as in Megatron: a forward built as a schedule plan is only undone by the plan's backward,
  and every all-to-all of the expert communicator then comes from one place (the NCCL model's expert
  queue, ``schedules/lowering/exchange.py``);
* evaluation calls run the plain forward, as Megatron's schedules do (``not forward_only``).

**The B/W split stays.** Megatron's own deferral (``delay_wgrad_compute``, run by the plan's
``backward_dw()``) needs Transformer Engine's linears. Here the executor holds the B's weight-gradient
capture around the whole combined call: the project's split hook in megatron's linears
(``runtime/wgrad_linear.py``) queues the B's linear weight gradients (attention, experts, dense MLP) for
its W pass, which the schedule may put anywhere later; the plan's ``backward_dw()`` calls do nothing
without ``delay_wgrad_compute``. The F half computes no weight gradient, so the capture holds only the B's.
With Transformer Engine's linears (the TE route) the plan's ``backward_dw()`` would compute them inside the
pair: that route refuses the flag at start-up (``megatron/feature_checks.py``).
"""

from __future__ import annotations

import contextlib
import functools


def enabled(config, forward_only: bool) -> bool:
    """True when this call runs its passes through Megatron's combined step (training with the flag)."""
    return bool(getattr(config, "overlap_moe_expert_parallel_comm", False)) and not forward_only


@contextlib.contextmanager
def _loss_step_of(f_chunk, cp_size: int):
    """Megatron's loss step inside the combined step, told whether the F's chunk is a last stage.

    ``combined_forward_backward_step`` calls ``schedules.forward_step_calc_loss`` without ``is_last_stage``,
    so Megatron asks ``parallel_state`` (pipeline rank and virtual stage). On a V the last stage is chunk 1 of
    pipeline rank 0, which only the glue's stage predicates know (``megatron/model_chunks.py``, installed for
    megatron.training); the executor knows it for every caller, as it tells Megatron's ``forward_step``
    (``compat.forward_step(..., is_last_stage=)``). Replaced for the call only (``patches.py`` lists it)."""
    from megatron.core.pipeline_parallel import schedules

    original = schedules.forward_step_calc_loss
    is_last = f_chunk is not None and f_chunk.is_last_stage

    @functools.wraps(original)
    def forward_step_calc_loss(*args, **kwargs):
        kwargs.setdefault("cp_group_size", cp_size)
        kwargs["is_last_stage"] = is_last
        return original(*args, **kwargs)

    schedules.forward_step_calc_loss = forward_step_calc_loss
    try:
        yield
    finally:
        schedules.forward_step_calc_loss = original


def combined_step(*, forward_step_func, config, num_microbatches: int, forward_data_store: list,
                  f_chunk=None, f_input=None, b_chunk=None, b_input=None, b_output=None, b_output_grad=None,
                  collect_non_loss_data: bool = False, is_first_microbatch: bool = False,
                  current_microbatch: int | None = None, cp_size: int = 1):
    """One call of Megatron's ``combined_forward_backward_step``: the F of ``f_chunk`` (a
    ``iteration_types.Chunk``, or None) and the B of ``b_chunk`` (or None) together.

    Returns ``(output, num_tokens, input_grad)``: the F's output (the loss on a last stage, carrying the
    schedule plan its B reads back), its token count, and the B's input gradient (None on a first stage).
    """
    from megatron.core.pipeline_parallel.combined_1f1b import combined_forward_backward_step
    from megatron.core.pipeline_parallel.utils import set_streams

    # What Megatron's combined schedules do first (once per process: it keeps the stream it made).
    set_streams(high_priority=getattr(config, "high_priority_a2a_comm_stream", False))
    with _loss_step_of(f_chunk, cp_size):
        output, num_tokens, input_grad = combined_forward_backward_step(
            forward_step_func,
            f_chunk.data_iterator if f_chunk is not None else None,
            f_chunk.model if f_chunk is not None else None,
            num_microbatches,
            f_input,
            forward_data_store,
            b_chunk.model if b_chunk is not None else None,
            b_input,
            b_output,
            b_output_grad,
            config,
            f_model_chunk_id=f_chunk.vp_stage if f_chunk is not None else None,
            collect_non_loss_data=collect_non_loss_data,
            checkpoint_activations_microbatch=None,
            is_first_microbatch=is_first_microbatch,
            current_microbatch=current_microbatch,
        )
    return output, num_tokens, input_grad
