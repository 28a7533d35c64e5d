"""`vshape plan`'s cost model and search, and scripts/reproduce_paper.py (pure Python, no torch)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from megatron_vshape.planner import (
    CostModel,
    GPTModel,
    Grid,
    ParallelLayout,
    calibrate_efficiency,
    get_gpu,
    get_model,
    predict,
    search,
    stage_layers,
)
from megatron_vshape.planner.cli import PAPER_F_MS
from megatron_vshape.planner.cli import main as plan_main
from megatron_vshape.planner.search import _upper_bound, layouts
from megatron_vshape.planner.simcache import run_pipeline
from megatron_vshape.schedules.core.schedule import Costs
from megatron_vshape.schedules.core.simulator import simulate
from megatron_vshape.schedules.generators.registry import get_schedule

ROOT = Path(__file__).resolve().parent.parent
A100 = get_gpu("a100")


@pytest.fixture(scope="module")
def calibrated() -> CostModel:
    return CostModel(A100, calibrate_efficiency(A100, get_model("9.6b"), 4, PAPER_F_MS / 1e3))


def test_flops_match_a_hand_computation():
    model = get_model("9.6b")  # L=30, h=5120, a=40, s=1024, V=51200
    b, s, h = 4, 1024, 5120
    f, bwd_input, w = model.layer_flops(b)
    assert f == 24 * b * s * h * h + 4 * b * s * s * h == 2_662_879_723_520
    assert bwd_input == f + 4 * b * s * s * h and w == 24 * b * s * h * h
    # Megatron's formula: 72 B s L h^2 (1 + s/(6h) + V/(12 h L))
    batch, layers, vocab = 8, 30, 51200
    megatron = 72 * batch * s * layers * h * h * (1 + s / (6 * h) + vocab / (12 * h * layers))
    assert model.model_flops(batch) == pytest.approx(megatron, rel=1e-12)


def test_preset_parameter_counts_match_their_names():
    for key, billions in (("9.6b", 9.6), ("21b", 21), ("38.5b", 38.5), ("98.5b", 98.5)):
        assert get_model(key).total_params / 1e9 == pytest.approx(billions, rel=0.05)


def test_calibration_reproduces_the_f_pass_and_predicts_the_other_microbatch_sizes(calibrated):
    model = get_model("9.6b")
    f_ms = {mb: calibrated.pass_times(model, ParallelLayout(1, 1, 16, mb, 16 * mb)).f * 1e3 for mb in (4, 8, 12)}
    assert f_ms[4] == pytest.approx(12.96, rel=1e-6)  # the calibration point itself
    # Not calibrated: the paper's 26.30 ms and 39.45 ms at microbatch 8 and 12 (within 3 %).
    assert f_ms[8] == pytest.approx(26.30, rel=0.03)
    assert f_ms[12] == pytest.approx(39.45, rel=0.03)


def test_bad_inputs_raise_one_line_errors_naming_the_flag():
    with pytest.raises(ValueError, match="--gpu"):
        get_gpu("v100")
    with pytest.raises(ValueError, match="--calibrate-f-ms"):
        calibrate_efficiency(A100, get_model("9.6b"), 4, 1e-3)  # faster than the peak allows
    with pytest.raises(ValueError, match="--efficiency"):
        CostModel(A100, efficiency=1.5)
    # any layer count runs on an uneven layout; only too few layers for the middle stages cannot
    with pytest.raises(ValueError, match="cannot fill the 6 middle stages"):
        predict("1f1b", ParallelLayout(1, 1, 8, 1, 16), GPTModel("tiny", 4, 1024, 8, 1024), CostModel(A100))


def test_stage_layers_give_embedding_and_head_one_slot_each():
    assert stage_layers(get_model("9.6b"), 16) == [1] + [2] * 14 + [1]
    assert stage_layers(get_model("9.6b"), 32) == [0] + [1] * 30 + [0]
    assert sum(stage_layers(get_model("98.5b"), 20)) == 78


def test_activation_memory_orders_like_the_paper(calibrated):
    model = get_model("9.6b")
    layout = ParallelLayout(1, 1, 16, 4, 64)
    act = {s: predict(s, layout, model, calibrated).memory.peak_activation for s in ("1f1b", "1f1b-r", "v-min", "v-half")}
    assert act["1f1b-r"] < act["v-min"] < act["v-half"] < act["1f1b"]
    # The paper measured 46 GB for 1F1B here (paper.md's 34h + 5as per-token model).
    assert act["1f1b"] / 1e9 == pytest.approx(46, rel=0.05)


def test_peak_memory_is_saturated_once_microbatches_reach_the_device_count():
    # reproduce_paper.py simulates the 38.5B memory rows with m = d on this basis.
    for name in ("1f1b", "v-min", "v-half"):
        peaks = {simulate(get_schedule(name, 8, m)).peak_memory_max for m in (8, 12, 24)}
        assert len(peaks) == 1, name


def test_out_of_memory_is_marked(calibrated):
    model = get_model("98.5b")
    fits = predict("1f1b", ParallelLayout(1, 4, 10, 1, 160), model, calibrated, flash_attention=True)
    assert not fits.oom and fits.memory.peak < fits.capacity
    # Same split at seq 16384 without recomputation: activations alone exceed 80 GB.
    too_big = predict("1f1b", ParallelLayout(1, 4, 10, 1, 160), model.with_seq(16384), calibrated, flash_attention=True)
    assert too_big.oom and too_big.memory.peak > too_big.capacity
    [found] = search(["1f1b"], model.with_seq(16384), calibrated, 40, 160, Grid(tp=(4,), pp=(10,), micro_batch=(1,)),
                     flash_attention=True)
    assert found.best is None and "out of memory" in found.reason


def test_extrapolated_makespan_matches_an_exact_simulation():
    costs = Costs(1.0, 1.1, 0.9, 0.05)
    for name in ("1f1b", "v-half", "v-min"):
        run = run_pipeline(name, 6, 48, costs)
        exact = simulate(get_schedule(name, 6, 48, costs), costs)
        assert run.extrapolated
        assert run.makespan == pytest.approx(exact.makespan_total, rel=0.01), name


@pytest.mark.parametrize("gpus", [8, pytest.param(16, marks=pytest.mark.slow)])  # 12 and 20 layouts
def test_search_finds_the_best_of_an_exhaustive_evaluation(calibrated, gpus):
    model = get_model("9.6b")
    grid = Grid(micro_batch=(1, 4))
    schedules = ["1f1b", "1f1b-r", "v-half", "v-zb"]
    results = search(schedules, model, calibrated, gpus, 64, grid)
    assert [r.schedule for r in results] == schedules
    for found in results:
        assert found.best is not None and not found.best.oom
        exhaustive = []
        for layout in layouts(model, gpus, 64, grid, 8):
            try:
                prediction = predict(found.schedule, layout, model, calibrated)
            except ValueError:
                continue
            assert _upper_bound(found.schedule, layout, model, calibrated) >= prediction.mfu - 1e-9
            if not prediction.oom:
                exhaustive.append(prediction.mfu)
        assert found.best.mfu == pytest.approx(max(exhaustive), rel=1e-9), found.schedule
    mfu = {r.schedule: r.best.mfu for r in results}
    assert mfu["v-zb"] > mfu["1f1b"] > mfu["1f1b-r"]


def test_cli_prints_a_best_configuration_per_schedule(capsys, tmp_path):
    out = tmp_path / "plan.json"
    argv = ["--model", "9.6b", "--gpus", "16", "--global-batch", "64", "--pp", "16", "--micro-batch", "4",
            "--schedules", "1f1b,v-half", "--json", str(out), "--no-layouts"]  # layouts: tests/test_balance.py
    assert plan_main(argv) == 0
    text = capsys.readouterr().out
    assert "v-half" in text and "1f1b" in text and "MFU" in text
    records = json.loads(out.read_text())
    assert {r["schedule"] for r in records} == {"1f1b", "v-half"}
    assert all(r["best"]["pp"] == 16 for r in records)


def test_cli_rejects_bad_input_with_one_line(capsys):
    assert plan_main(["--model", "9.6b", "--gpus", "16", "--global-batch", "64", "--schedules", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--schedules" in err
    assert plan_main(["--model", "9.6b", "--layers", "4", "--gpus", "16", "--global-batch", "64"]) == 2
    assert "--model" in capsys.readouterr().err


def _load_reproduce():
    spec = importlib.util.spec_from_file_location("reproduce_paper", ROOT / "scripts" / "reproduce_paper.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["reproduce_paper"] = module
    spec.loader.exec_module(module)  # puts scripts/ on sys.path: its sibling modules import
    return module


def _paper_modules():
    """reproduce_paper's row definitions (paper_rows) and RESULTS.md writer (paper_report)."""
    _load_reproduce()
    import paper_report
    import paper_rows

    return paper_rows, paper_report


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_reproduce_paper_writes_a_record_per_seed_row(tmp_path, capsys):
    reproduce = _load_reproduce()
    out = tmp_path / "out.json"
    assert reproduce.main(["--quick", "--no-pictures", "--no-results-md", "--workers", "2", "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    keys = {"setting", "metric", "schedule_before", "schedule_after", "paper_before", "paper_after",
            "predicted_before", "predicted_after"}
    rows, _ = _paper_modules()
    assert len(records) == len(rows.ROWS)
    for record, row in zip(records, rows.ROWS):
        assert keys <= set(record)
        assert (record["setting"], record["schedule_before"], record["schedule_after"]) == (
            row.setting, row.schedule_before, row.schedule_after)
        assert record["predicted_before"] > 0 and record["predicted_after"] > 0
    # Pure-pipeline rows do not depend on --quick: their orderings must match the paper's.
    for record in records:
        if record["setting"].startswith(("9.6B", "38.5B")):
            assert (record["predicted_after"] > record["predicted_before"]) == (
                record["paper_after"] > record["paper_before"]), record


def test_gpipe_memory_grows_with_the_microbatch_count_even_when_extrapolated(calibrated):
    model = get_model("9.6b")
    small = predict("gpipe", ParallelLayout(1, 1, 4, 1, 16), model, calibrated)
    large = predict("gpipe", ParallelLayout(1, 1, 4, 1, 64), model, calibrated)
    exact_1f1b = predict("1f1b", ParallelLayout(1, 1, 4, 1, 64), model, calibrated)
    assert large.extrapolated and not small.extrapolated
    # GPipe holds every microbatch's activations: 4x the microbatches, 4x the peak.
    assert large.memory.peak_activation == pytest.approx(4 * small.memory.peak_activation, rel=0.01)
    assert large.memory.peak_activation > 10 * exact_1f1b.memory.peak_activation


def test_results_md_keeps_the_benchmark_section_and_orderings_are_pairwise(tmp_path):
    rows, report = _paper_modules()
    page = tmp_path / "RESULTS.md"
    page.write_text(f"old\n{report.PART3_BEGIN}\nmeasured: 1.23 s\n{report.PART3_END}\nold tail\n")
    assert "measured: 1.23 s" in report._part3(page)
    assert report.PART3_BEGIN in report._part3(tmp_path / "missing.md")
    recs = [{"setting": "S", "metric": "MFU %", "schedule_before": "a", "schedule_after": "b",
             "paper_before": 50, "paper_after": 60, "predicted_before": 55, "predicted_after": 54},
            {"setting": "S", "metric": "MFU %", "schedule_before": "c", "schedule_after": "b",
             "paper_before": 58, "paper_after": 60, "predicted_before": 50, "predicted_after": 54}]
    pairs = {o["pair"]: o for o in rows.setting_orderings(recs)}
    assert set(pairs) == {"a vs b", "a vs c", "b vs c"}  # the implied pair a vs c too
    assert not pairs["a vs b"]["matches"] and pairs["b vs c"]["matches"]
    assert pairs["a vs c"]["paper_higher"] == "c" and pairs["a vs c"]["predicted_higher"] == "a"


def test_a_saturated_peak_is_not_extrapolated_and_a_growing_one_is():
    """Memory goes through the size extrapolation only where the simulated peak grows between the two points
    (GPipe); 1F1B's has saturated, so a per-device difference between the points (another order at one of
    them) is not extended to the run's size."""
    from megatron_vshape.planner.simcache import run_pipeline
    from megatron_vshape.schedules.core.schedule import Costs

    costs = Costs(1.0, 1.1, 0.9, 0.05)
    growing, saturated = run_pipeline("gpipe", 4, 64, costs), run_pipeline("1f1b", 4, 64, costs)
    assert growing.extrapolated and saturated.extrapolated
    assert growing.extend(2.0, 1.0) > 2.0
    assert saturated.extend(2.0, 1.0) == 2.0
