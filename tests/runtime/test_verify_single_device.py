"""``vshape verify`` at PP=1 (every stage on one device) and its GPU options, on CPU with gloo.

PP=1 is what lets one GPU check the B/W split, TE and bf16; megatron-core ignores the virtual pipeline
at PP=1, so verify builds each V chunk as a one-stage model of its own layers (without that, both chunks
built all layers and v-zb's gradients were 75 % off).
"""

from __future__ import annotations

import math

import pytest

from megatron_vshape import verify
from megatron_vshape.testing import ModelSettings, RunSpec, run_check
from megatron_vshape.testing.workers import split_b_passes
from megatron_vshape.verify import verdict

SPLIT_SCHEDULES = ("v-zb", "v-half", "v-min", "zb-1p", "zb-h1", "zb-2p")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_split_schedule_at_pp1_equals_the_fused_reference():
    spec = RunSpec(schedules=SPLIT_SCHEDULES, pp=1, microbatches=4)
    results = run_check(spec, timeout=560)
    for name in SPLIT_SCHEDULES:
        r = results[name]
        assert r["max_grad_rel_err"] == 0.0 and r["max_loss_abs_err"] == 0.0, (name, r["worst_param"])
        assert r["num_losses"] == 4
        assert verdict(r, *verify.tolerances("cpu", "fp32")) == [], name
    # V schedules interleave the two chunks' passes, so some B runs before its W: those defer.
    for name in ("v-zb", "v-half", "v-min"):
        assert results[name]["split_b_passes"] > 0
        assert results[name]["wgrad_deferred"] == results[name]["wgrad_run"] > 0, name


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bf16_at_pp1_matches_a_bf16_reference_with_fp32_gradient_sums():
    model = ModelSettings(dtype="bf16")
    results = run_check(RunSpec(schedules=("v-half",), pp=1, microbatches=4, model=model), timeout=560)
    r = results["v-half"]
    grad_tol, loss_tol = verify.tolerances("cpu", "bf16")
    assert verdict(r, grad_tol, loss_tol) == [], r
    assert r["wgrad_deferred"] > 0


def test_split_b_passes_counts_the_bs_whose_w_does_not_follow():
    from megatron_vshape.schedules.generators.registry import get_schedule

    assert split_b_passes(get_schedule("zb-1p", 1, 4).programs[0]) == 0  # B W B W ...: fused by the executor
    assert split_b_passes(get_schedule("v-zb", 1, 4).programs[0]) > 0


def test_verdict_fails_a_split_that_deferred_nothing_and_nan_errors():
    ok = {"max_grad_rel_err": 0.0, "max_loss_abs_err": 0.0, "split_b_passes": 3, "wgrad_deferred": 12, "wgrad_run": 12}
    assert verdict(ok, 1e-6, 1e-6) == []
    assert "deferred no weight gradient" in verdict(dict(ok, wgrad_deferred=0, wgrad_run=0), 1e-6, 1e-6)[0]
    assert "W ran 11 of 12" in verdict(dict(ok, wgrad_run=11), 1e-6, 1e-6)[0]
    assert "gradient relative error" in verdict(dict(ok, max_grad_rel_err=math.nan), 1e-6, 1e-6)[0]
    assert verdict(dict(ok, split_b_passes=0, wgrad_deferred=0, wgrad_run=0), 1e-6, 1e-6) == []


@pytest.mark.parametrize("argv, message", [
    (["--device", "cpu", "--backend", "nccl"], "--backend nccl cannot run --device cpu"),
    (["--device", "cuda", "--backend", "gloo"], "--backend gloo cannot run --device cuda"),
    (["--spec", "te"], "--spec te needs Transformer Engine's CUDA kernels"),
    (["--dtype", "bf16", "--distributed-optimizer"], "--distributed-optimizer checks an fp32 Adam step"),
    (["--device", "cuda"], "need 1 GPUs, 0 visible"),
])
def test_bad_device_options_get_one_line(argv, message, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert verify.main(["--schedule", "v-zb", "--pp", "1", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_tolerances_per_device_and_dtype():
    assert verify.tolerances("cpu", "fp32") == (1e-6, 1e-6)
    assert verify.tolerances("cuda", "fp32")[0] > 1e-6
    assert verify.tolerances("cuda", "bf16")[0] >= 7.8e-3  # bf16's relative step: a tighter bar fails on rounding
