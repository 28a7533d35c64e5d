"""The B/W split works on the backward path Megatron takes on a GPU, and fails loudly when it does not.

On CUDA, autograd runs ``Function.backward`` on a per-device worker thread that sees none of the
caller's ContextVars or thread-locals, and megatron.training's backward goes through
``custom_backward`` (``Variable._execution_engine.run_backward``), which does not stash the caller's
context for that thread either. ``megatron_vshape.testing.autograd_threads.backward_on_new_threads`` reproduces this on CPU by
running every ``run_backward`` on a new, bare thread.
"""

from __future__ import annotations

import threading

import pytest
import torch
from _gpu_path_workers import threaded_executor_worker

from megatron_vshape.runtime.wgrad import (
    WeightGradStore,
    WgradCounts,
    WgradError,
)
from megatron_vshape.testing import ModelSettings, RunSpec, reference_worker, spawn
from megatron_vshape.testing.autograd_threads import backward_on_new_threads


def _layer_and_batch():
    from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce

    gen = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(6, 5, generator=gen))
    x = torch.randn(4, 3, 5, generator=gen).requires_grad_()
    dy = torch.randn(4, 3, 6, generator=gen)

    def forward():
        return linear_with_grad_accumulation_and_async_allreduce(
            x, weight, None, gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=False)

    return weight, x, dy, forward


def _megatron_backward(output, grad):
    """What megatron's backward_step does with deallocate_pipeline_outputs=True."""
    from megatron.core.pipeline_parallel.schedules import custom_backward

    output.data = torch.empty((1,), dtype=output.dtype)  # megatron's deallocate_output_tensor
    custom_backward(output, grad)


@pytest.mark.parametrize("backward", ["custom_backward", "torch.autograd.backward"])
def test_b_defers_the_weight_grad_when_the_backward_runs_on_another_thread(split, backward):
    weight, x, dy, forward = _layer_and_batch()
    torch.autograd.backward(forward(), dy)
    ref_dw, ref_dx = weight.grad.clone(), x.grad.clone()
    weight.grad = x.grad = None

    store = WeightGradStore()
    out = forward()
    with backward_on_new_threads() as engine, store.capture((0, 0)):
        if backward == "custom_backward":
            _megatron_backward(out, dy)
        else:
            torch.autograd.backward(out, dy)
    assert engine.threads_used == 1, "the backward did not run on a separate thread"
    assert weight.grad is None, "B computed the weight gradient: the capture was not seen from the backward's thread"
    assert torch.equal(x.grad, ref_dx)
    assert store.counts() == WgradCounts(deferred=1, run=0)
    store.run((0, 0))
    assert torch.equal(weight.grad, ref_dw)
    assert store.counts() == WgradCounts(deferred=1, run=1)


def test_a_second_capture_from_another_thread_is_refused(split):
    """One process-wide capture: another executor (thread) capturing meanwhile must not share it."""
    errors = []

    def other_executor():
        try:
            with WeightGradStore().capture((0, 0)):
                pass
        except WgradError as err:
            errors.append(str(err))

    store = WeightGradStore()
    with store.capture((1, 2)):
        thread = threading.Thread(target=other_executor)
        thread.start()
        thread.join(10)
    assert errors and "while capture((1, 2)) is in force" in errors[0]
    with WeightGradStore().capture((0, 0)):  # released once the block ends
        pass


def test_failed_b_does_not_count_as_deferred(split):
    store = WeightGradStore()
    with pytest.raises(ZeroDivisionError), store.capture((0, 0)):
        store.defer(lambda: None)
        1 / 0  # noqa: B018
    assert store.counts() == WgradCounts()


# --- the executor, as megatron.training runs it on a GPU ---------------------------------------------

_SPEC = RunSpec(schedules=("v-zb",), pp=2, microbatches=4, model=ModelSettings(num_layers=4))
# One rank (both V chunks on it): a rank that raises cannot leave a peer waiting for its messages.
_BLIND_SPEC = RunSpec(schedules=("v-zb",), pp=1, microbatches=4, model=ModelSettings(num_layers=4))


@pytest.fixture(scope="module")
def reference_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("wgrad_threads") / "reference.pt")
    spawn(reference_worker, 1, ([(_SPEC.model, path)], _SPEC.microbatches), timeout=120)
    return path


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_executor_splits_with_megatrons_backward_on_worker_threads(reference_path):
    """v-zb at PP=2, custom_backward on a new thread per backward: W GEMMs run and grads are exact."""
    per_rank = spawn(threaded_executor_worker, 2, (_SPEC, reference_path, False), timeout=180)
    for row in per_rank:
        assert row["threads_used"] > 0, row
        assert row["w_gemms"] > 0, f"no deferred weight-gradient GEMM ran on pp rank {row['pp_rank']}: {row}"
        assert row["counts"]["deferred"] == row["counts"]["run"] == row["w_gemms"], row
        assert row["result"]["max_grad_rel_err"] <= 1e-6, row


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_executor_refuses_a_b_that_defers_nothing(reference_path):
    """If the backward cannot see the capture, the first B raises instead of running the full backward."""
    per_rank = spawn(threaded_executor_worker, 1, (_BLIND_SPEC, reference_path, True), timeout=180)
    for row in per_rank:
        assert "deferred no weight gradient" in row["error"], row
        assert row["w_gemms"] == 0, row
