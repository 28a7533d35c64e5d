"""B/W split of megatron-core's linear layers (megatron_vshape.runtime.wgrad).

In-process tests drive megatron's linear autograd function directly (no process group needed);
the equivalence tests build ColumnParallelLinear/RowParallelLinear models and a local-spec
TransformerLayer on 1 or 2 gloo ranks and require bitwise-equal gradients between Megatron's plain
backward and B-inside-capture followed by W, on the installed megatron-core (the executor's exactness on
the other supported version: ``tests/runtime/test_other_megatron_core.py``). The backward on autograd's worker threads
(as on GPU) is tested in ``test_wgrad_threads.py``; Transformer Engine in ``test_te_wiring.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _wgrad_support import Case, equivalence_worker, schedule_worker

from megatron_vshape.runtime.wgrad import (
    WeightGradStore,
    WgradError,
    check_ddp_config,
    disable_wgrad_split,
    enable_wgrad_split,
    wgrad_split_enabled,
)
from megatron_vshape.testing import spawn


def _linear(x, weight, bias):
    from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce

    return linear_with_grad_accumulation_and_async_allreduce(
        x, weight, bias, gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=False
    )


def _layer(seed: int = 0, bias: bool = True):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(6, 5, generator=gen))
    return weight, (torch.nn.Parameter(torch.randn(6, generator=gen)) if bias else None)


def _batch(seed: int):
    gen = torch.Generator().manual_seed(100 + seed)
    return torch.randn(4, 3, 5, generator=gen).requires_grad_(), torch.randn(4, 3, 6, generator=gen)


def _plain_grads(weight, bias, seeds):
    """Megatron's own backward over the given microbatches, gradients accumulated."""
    inputs = []
    for seed in seeds:
        x, dy = _batch(seed)
        torch.autograd.backward(_linear(x, weight, bias), dy)
        inputs.append(x.grad)
    grads = (weight.grad.clone(), None if bias is None else bias.grad.clone())
    weight.grad = None
    if bias is not None:
        bias.grad = None
    return inputs, grads


# --- the hook ---------------------------------------------------------------------------------


def test_enable_is_idempotent_and_disable_restores_megatrons_backward(no_split):
    from megatron.core.tensor_parallel.layers import LinearWithGradAccumulationAndAsyncCommunication as Fn

    original = Fn.backward
    enable_wgrad_split()
    patched = Fn.backward
    enable_wgrad_split()
    assert wgrad_split_enabled() and Fn.backward is patched and patched is not original
    disable_wgrad_split()
    assert not wgrad_split_enabled() and Fn.backward is original


def test_outside_capture_gradients_are_megatrons(split):
    weight, bias = _layer()
    x, dy = _batch(0)
    torch.autograd.backward(_linear(x, weight, bias), dy)
    enabled = (x.grad, weight.grad, bias.grad)
    disable_wgrad_split()
    weight.grad = bias.grad = None
    x, dy = _batch(0)
    torch.autograd.backward(_linear(x, weight, bias), dy)
    assert all(torch.equal(a, b) for a, b in zip(enabled, (x.grad, weight.grad, bias.grad)))


@pytest.mark.parametrize("bias", [True, False])
def test_b_defers_only_the_weight_grad_and_run_applies_it(split, bias):
    weight, bias_param = _layer(bias=bias)
    (ref_dx,), (ref_dw, ref_db) = _plain_grads(weight, bias_param, [0])
    store = WeightGradStore()
    x, dy = _batch(0)
    out = _linear(x, weight, bias_param)
    with store.capture((0, 0)):
        torch.autograd.backward(out, dy)
    assert torch.equal(x.grad, ref_dx)
    assert weight.grad is None, "B must leave the weight grad to W"
    if bias:
        assert torch.equal(bias_param.grad, ref_db), "bias grads stay in B"
    store.run((0, 0))
    assert torch.equal(weight.grad, ref_dw)


def test_runs_accumulate_like_megatron_over_microbatches(split):
    weight, bias = _layer()
    _, (ref_dw, ref_db) = _plain_grads(weight, bias, [0, 1])
    store = WeightGradStore()
    for mb in (0, 1):
        x, dy = _batch(mb)
        out = _linear(x, weight, bias)
        with store.capture((0, mb)):
            torch.autograd.backward(out, dy)
    store.run((0, 1))
    store.run((0, 0))
    assert torch.equal(weight.grad, ref_dw) and torch.equal(bias.grad, ref_db)


def test_same_key_captured_again_after_its_run_accumulates(split):
    weight, bias = _layer()
    _, (ref_dw, _) = _plain_grads(weight, bias, [0, 0])
    store = WeightGradStore()
    for _ in range(2):  # two iterations without zeroing: the key is reused once its W ran
        x, dy = _batch(0)
        out = _linear(x, weight, bias)
        with store.capture((1, 0)):
            torch.autograd.backward(out, dy)
        store.run((1, 0))
    assert torch.equal(weight.grad, ref_dw)


def test_w_adds_into_main_grad_when_present(split):
    weight, bias = _layer()
    _, (ref_dw, _) = _plain_grads(weight, bias, [0])
    weight.main_grad = torch.ones_like(weight)  # as megatron DDP attaches it
    store = WeightGradStore()
    x, dy = _batch(0)
    out = _linear(x, weight, bias)
    with store.capture("k"):
        torch.autograd.backward(out, dy)
    assert torch.equal(weight.main_grad, torch.ones_like(weight))
    store.run("k")
    assert weight.grad is None
    assert torch.equal(weight.main_grad, torch.ones_like(weight).add_(ref_dw))


def test_layers_megatron_defers_itself_keep_megatrons_path(split):
    """defer_embedding_wgrad_compute (output layer): Megatron buffers grad_output itself; no W task."""
    from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce

    weight, _ = _layer()
    buffer = []
    x, dy = _batch(0)
    out = linear_with_grad_accumulation_and_async_allreduce(
        x, weight, None, gradient_accumulation_fusion=True, allreduce_dgrad=False, sequence_parallel=False,
        grad_output_buffer=buffer, wgrad_deferral_limit=0,
    )
    store = WeightGradStore()
    with store.capture((0, 0)):
        torch.autograd.backward(out, dy)
    assert len(buffer) == 1 and torch.equal(buffer[0], dy)
    assert torch.equal(x.grad, dy.matmul(weight))
    store.run((0, 0))
    assert weight.grad is None, "no W task: Megatron computes this weight grad from its buffer later"


# --- the store --------------------------------------------------------------------------------


def test_pending_lists_keys_in_capture_order_and_clear_drops_them(split):
    weight, bias = _layer()
    store = WeightGradStore()
    for key in [(1, 0), (0, 0), (1, 1)]:
        x, dy = _batch(0)
        out = _linear(x, weight, bias)
        with store.capture(key):
            torch.autograd.backward(out, dy)
    assert store.pending() == [(1, 0), (0, 0), (1, 1)]
    store.run((0, 0))
    assert store.pending() == [(1, 0), (1, 1)]
    store.clear()
    assert store.pending() == []
    with pytest.raises(WgradError, match=r"run\(\(1, 0\)\)"):
        store.run((1, 0))


def test_run_of_unknown_key_raises_and_names_pending_keys(split):
    store = WeightGradStore()
    with store.capture((0, 0)):
        pass
    with pytest.raises(WgradError, match=r"nothing captured.*\[\(0, 0\)\]"):
        store.run((0, 5))


def test_a_key_runs_once(split):
    store = WeightGradStore()
    with store.capture((0, 0)):
        pass
    store.run((0, 0))  # a chunk without local linear layers: an empty W, not an error
    with pytest.raises(WgradError):
        store.run((0, 0))


def test_capture_misuse_is_refused(split):
    store = WeightGradStore()
    with store.capture((0, 0)):
        with pytest.raises(WgradError, match="do not nest"):
            with WeightGradStore().capture((0, 1)):
                pass
    with pytest.raises(WgradError, match="has not run yet"):
        with store.capture((0, 0)):
            pass
    with pytest.raises(WgradError, match="only valid inside"):
        store.defer(lambda: None)


def test_capture_needs_the_hook(no_split):
    with pytest.raises(WgradError, match="enable_wgrad_split"):
        with WeightGradStore().capture((0, 0)):
            pass


def test_failed_b_leaves_no_w(split):
    store = WeightGradStore()
    with pytest.raises(ZeroDivisionError):
        with store.capture((0, 0)):
            store.defer(lambda: None)
            1 / 0  # noqa: B018
    assert store.pending() == []


def test_stores_are_independent(split):
    weight, bias = _layer()
    first, second = WeightGradStore(), WeightGradStore()
    x, dy = _batch(0)
    out = _linear(x, weight, bias)
    with first.capture((0, 0)):
        torch.autograd.backward(out, dy)
    with second.capture((0, 0)):
        pass
    second.run((0, 0))
    assert weight.grad is None and first.pending() == [(0, 0)]


def test_ddp_overlap_grad_reduce_is_accepted_and_fsdp_rejected():
    from megatron.core.distributed import DistributedDataParallelConfig

    check_ddp_config(DistributedDataParallelConfig(overlap_grad_reduce=True), "v-half")  # grad_sync.py launches
    with pytest.raises(WgradError, match="--pipeline-schedule v-half.*Megatron-FSDP"):
        check_ddp_config(DistributedDataParallelConfig(use_megatron_fsdp=True), "v-half")


def test_store_counts_the_tasks_still_holding_each_weight(split):
    """The executor launches a weight's bucket when no pending W task holds it (grad_sync.py)."""
    weight, bias = _layer()
    store = WeightGradStore()
    for mb in range(2):
        x, dy = _batch(mb)
        with store.capture((0, mb)):
            torch.autograd.backward(_linear(x, weight, bias), dy)
    assert store.holds(weight) == 2 and store.weights_owed(lambda key: key[0] == 0) == {id(weight)}
    seen = []
    store.run((0, 0), after_task=lambda task: seen.append(store.holds(task.weight)))
    store.run((0, 1), after_task=lambda task: seen.append(store.holds(task.weight)))
    assert seen == [1, 0] and store.weights_owed(lambda key: True) == set()


# --- megatron models on gloo ranks ----------------------------------------------------------

MLP_CASES = [
    Case("mlp", bias=True),
    Case("mlp", bias=False),
    Case("mlp", bias=True, ddp=True),
    Case("mlp", bias=False, ddp=True, fusion=True),
    Case("mlp", bias=True, ddp=True, bf16=True),
]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("tp", "sp", "cases"),
    [
        pytest.param(1, False, MLP_CASES, id="mlp-tp1"),
        pytest.param(2, False, MLP_CASES, id="mlp-tp2"),
        pytest.param(2, True, MLP_CASES, id="mlp-tp2-sp"),
        # The local spec's torch LayerNorm refuses sequence parallelism, hence TP=2 without SP.
        pytest.param(2, False, [Case("gpt_layer"), Case("gpt_layer", ddp=True)], id="gpt-layer-tp2"),
    ],
)
def test_split_gradients_equal_megatrons_bitwise(tp, sp, cases):
    checked = spawn(equivalence_worker, tp, (tp, sp, cases), timeout=200)
    assert checked == [[str(c) for c in cases]] * tp


SPLIT_SCHEDULES = ["zb-h1", "zb-2p", "v-min", "v-half", "v-zb"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_schedules_b_and_w_orders_give_plain_backward_grads():
    """Every stage of each split schedule in one process, B and W in the schedule's order."""
    (most_pending,) = spawn(schedule_worker, 1, (SPLIT_SCHEDULES, 4, 8), timeout=200)
    assert set(most_pending) == set(SPLIT_SCHEDULES)
    # W really waited: several (stage, microbatch) keys were pending at once.
    assert all(count > 1 for count in most_pending.values()), most_pending


def test_w_refuses_tensors_modified_in_place_after_b(split):
    weight, bias = _layer()
    x, dy = _batch(0)
    inner = x * 1.0  # a non-leaf activation, as between two layers
    out = _linear(inner, weight, bias)
    store = WeightGradStore()
    with store.capture((0, 0)):
        torch.autograd.backward(out, dy)
    with torch.no_grad():
        inner.mul_(2)
    with pytest.raises(WgradError, match="modified in place between its B and its W"):
        store.run((0, 0))


# --- scripts/bench_wgrad.py -----------------------------------------------------------------

BENCH = Path(__file__).resolve().parent.parent / "scripts" / "bench_wgrad.py"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_script_writes_its_json(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--model", "mlp", "--hidden", "64", "--heads", "4", "--seq", "16", "--iters", "2", "--warmup", "0",
            "--threads", "1", "--json", str(out)]
    proc = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=170,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "B + W" in proc.stdout
    result = json.loads(out.read_text())
    assert result["hidden"] == 64 and result["iters"] == 2
    assert result["b_plus_w_over_fused"] == pytest.approx((result["b_ms"] + result["w_ms"]) / result["fused_ms"])


def test_bench_script_rejects_bad_sizes_naming_the_flags(capsys, monkeypatch):
    """In-process (the script's argument parser): a subprocess would spend seconds importing torch first."""
    spec = importlib.util.spec_from_file_location("bench_wgrad", BENCH)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_wgrad", bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--hidden", "30", "--heads", "4"])
    assert exit_info.value.code == 2
    assert "--hidden 30 must be a multiple of --heads 4" in capsys.readouterr().err


def test_deferred_grad_refuses_a_copied_weight():
    """Saved-tensor hooks hand backward a copy of the weight: landing the gradient there would
    lose it silently, so the W pass must refuse."""
    import torch

    from megatron_vshape.runtime.wgrad import WgradError, accumulate_weight_grad

    param = torch.nn.Parameter(torch.zeros(2, 2))
    accumulate_weight_grad(param, torch.ones(2, 2))
    accumulate_weight_grad(param, torch.ones(2, 2))
    assert torch.equal(param.grad, torch.full((2, 2), 2.0))
    with pytest.raises(WgradError, match="saved-tensor hooks"):
        accumulate_weight_grad(param.detach().clone(), torch.ones(2, 2))
