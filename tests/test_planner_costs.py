"""The cost model's runtime mechanisms: memory-bound kernels in F and B (not W), Megatron's blocking
p2p for its own 1F1B, and the paper's bubble (compute share of the pipeline's time)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_vshape.planner import CostModel, ParallelLayout, calibrate_efficiency, get_gpu, get_model, predict
from megatron_vshape.planner.cli import PAPER_F_MS
from megatron_vshape.planner.exposed_p2p import blocking_costs
from megatron_vshape.planner.predict import chunk_costs
from megatron_vshape.planner.simcache import run_pipeline

A100 = get_gpu("a100")
MODEL = get_model("9.6b")  # h 5120, 40 heads, seq 1024
PURE_PIPELINE = ParallelLayout(1, 1, 16, 4, 4 * 256)  # the paper's 9.6B run: 16 GPUs on two nodes, 256 microbatches


@pytest.fixture(scope="module")
def calibrated() -> CostModel:
    return CostModel(A100, calibrate_efficiency(A100, MODEL, 4, PAPER_F_MS / 1e3))


def test_elementwise_bytes_follow_the_per_token_count():
    h, a, s, b = 5120, 40, 1024, 4
    f, bwd = MODEL.elementwise_bytes(b, flash_attention=False)
    assert f == (38 * h + 13 * a * s) * b * s
    assert bwd == (58 * h + 19 * a * s) * b * s
    # flash attention keeps the a x s scores on chip: only Q, K, V, O (and their gradients) move
    assert MODEL.elementwise_bytes(b, flash_attention=True) == (46 * h * b * s, 74 * h * b * s)


def test_memory_bound_kernels_make_w_cheaper_and_b_dearer_than_their_flops(calibrated):
    times = calibrated.pass_times(MODEL, PURE_PIPELINE)
    f_flops, b_flops, w_flops = MODEL.layer_flops(4)
    f_bytes, b_bytes = MODEL.elementwise_bytes(4, flash_attention=False)
    hbm = A100.hbm_bandwidth * 0.8
    # the calibration point still holds, and its GEMM share sets the efficiency
    assert times.f == pytest.approx(PAPER_F_MS / 1e3, rel=1e-9)
    efficiency = f_flops / ((PAPER_F_MS / 1e3 - f_bytes / hbm) * A100.peak_flops)
    assert calibrated.efficiency == pytest.approx(efficiency, rel=1e-9)
    assert times.w == pytest.approx(w_flops / (A100.peak_flops * efficiency), rel=1e-9)
    assert times.b == pytest.approx(b_flops / (A100.peak_flops * efficiency) + b_bytes / hbm, rel=1e-9)
    # By FLOPs alone W/F = 0.97 and B/F = 1.03; the streaming kernels move them to about 0.83 and 1.10.
    assert times.w / times.f == pytest.approx(0.829, abs=0.005)
    assert times.b / times.f == pytest.approx(1.096, abs=0.005)


def test_blocking_costs_charge_each_stage_the_link_it_sends_over(calibrated):
    costs = chunk_costs(calibrated.pass_times(MODEL, PURE_PIPELINE), MODEL, 16, False, 16)
    link = {(a, b): calibrated.p2p_between(MODEL, PURE_PIPELINE, a, b) for a in range(16) for b in range(16)}
    assert link[7, 8] > 5 * link[6, 7]  # two nodes of 8 GPUs: only the hop 7 <-> 8 crosses the network
    timed = blocking_costs("1f1b", costs, 16, lambda a, b: link[a, b])
    stage_f, stage_b = 2 * costs.f, 2 * costs.b  # a 1F1B stage is two V chunks' worth of layer slots
    assert timed.stages[7].f == pytest.approx(1 + link[7, 8] / stage_f)
    assert timed.stages[8].b == pytest.approx(1 + link[8, 7] / stage_b)
    assert timed.stages[15].f == 1.0 and timed.stages[0].b == 1.0  # the ends send nothing that way
    assert timed.comm == 0.0  # the transfer is inside the sender's pass


def test_megatron_1f1b_waits_for_its_messages_and_v_schedules_do_not(calibrated):
    asynchronous = replace(calibrated, blocking_p2p=False)
    on = predict("1f1b", PURE_PIPELINE, MODEL, calibrated)
    off = predict("1f1b", PURE_PIPELINE, MODEL, asynchronous)
    waits = calibrated.p2p_between(MODEL, PURE_PIPELINE, 7, 8) + calibrated.p2p_between(MODEL, PURE_PIPELINE, 6, 7)
    # In steady state device 7 (or 8) waits for one slow and one fast message per microbatch, and
    # that device paces the pipeline. Asynchronous, each microbatch's round trip between two
    # neighbours already costs two (mean) message latencies.
    round_trip = 2 * on.pass_times.p2p
    assert on.iteration_time - off.iteration_time == pytest.approx(256 * (waits - round_trip), rel=0.1)
    assert on.bubble_rate > off.bubble_rate + 0.015
    for name in ("v-half", "v-zb"):  # the authors' runtime: asynchronous p2p, unchanged by the flag
        assert predict(name, PURE_PIPELINE, MODEL, calibrated).mfu == predict(name, PURE_PIPELINE, MODEL,
                                                                               asynchronous).mfu


def test_bubble_is_the_idle_share_of_the_pipeline_time(calibrated):
    layout = ParallelLayout(1, 1, 16, 4, 64)
    prediction = predict("v-half", layout, MODEL, calibrated)
    costs = chunk_costs(prediction.pass_times, MODEL, 32, False, 16)
    run = run_pipeline("v-half", 16, 16, costs)
    # without exposed messages it is the simulator's bubble rate
    assert prediction.bubble_rate == pytest.approx(run.bubble_rate, rel=1e-5)  # ratios rounded to 6 digits
    assert prediction.bubble_rate == pytest.approx(1 - 16 * 2 * (costs.f + costs.b + costs.w) / run.span, rel=1e-9)


def test_search_bound_holds_with_flash_attention(calibrated):
    """The pruning bound must use the same (flash) pass times as the prediction it bounds."""
    from megatron_vshape.planner.search import _upper_bound

    model = get_model("98.5b").with_seq(3072)
    for name in ("1f1b", "v-half"):
        for tp, pp in ((4, 10), (8, 5)):
            layout = ParallelLayout(40 // (tp * pp), tp, pp, 1, 640)
            prediction = predict(name, layout, model, calibrated, flash_attention=True)
            assert _upper_bound(name, layout, model, calibrated, flash_attention=True) >= prediction.mfu - 1e-9
            # without flash attention the passes are slower: that bound would prune wrongly
            assert _upper_bound(name, layout, model, calibrated) < _upper_bound(name, layout, model, calibrated,
                                                                              flash_attention=True)
