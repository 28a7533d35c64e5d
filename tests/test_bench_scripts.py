"""Smoke tests of scripts/bench_memory.py and scripts/bench_peers.py at tiny sizes (their JSON output)."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import bench_memory  # noqa: E402
import bench_peers  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_memory_orders_v_schedules_below_1f1b(tmp_path):
    out = tmp_path / "mem.json"
    rc = bench_memory.main(["--pp", "4", "--microbatches", "8", "--layers", "8", "--hidden", "16", "--heads", "2",
                            "--seq", "64", "--vocab", "32", "--schedules", "1f1b,v-min,v-half",
                            "--timeout", "110", "--json", str(out)])
    assert rc == 0  # gradients matched the single-process reference
    rows = {r["schedule"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"1f1b", "v-min", "v-half"}
    for row in rows.values():
        assert len(row["peak_bytes"]) == 4 and min(row["peak_bytes"]) > 0
    worst = {name: max(r["peak_bytes"]) for name, r in rows.items()}
    assert worst["v-min"] < worst["v-half"] < worst["1f1b"]
    assert rows["v-min"]["predicted_ratio"] == pytest.approx(0.5)
    assert rows["v-half"]["predicted_ratio"] == pytest.approx(0.75)
    for name in ("v-min", "v-half"):  # the measured saving follows the simulator's
        assert rows[name]["measured_ratio"] == pytest.approx(rows[name]["predicted_ratio"], abs=0.1)


def test_bench_memory_rejects_missing_baseline():
    with pytest.raises(SystemExit):
        bench_memory.main(["--schedules", "v-min,v-half"])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_peers_has_a_row_per_system(tmp_path):
    out = tmp_path / "peers.json"
    rc = bench_peers.main(["--layers", "4", "--hidden", "32", "--heads", "4", "--seq", "16", "--vocab", "64",
                           "--microbatches", "4", "--warmup", "1", "--iters", "2", "--ours", "v-zb,1f1b",
                           "--unit-costs", "--timeout", "110", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    rows = {r["system"]: r for r in report["rows"]}
    # Same layers on both sides: equal weights give equal losses and gradients.
    assert report["check"]["num_losses_compared"] == 4
    assert report["check"]["max_loss_abs_diff"] < 1e-4 and report["check"]["max_grad_rel_diff"] < 1e-4
    assert set(rows) == {"torch-zbv", "torch-dualpipev", "torch-1f1b", "vshape-v-zb", "vshape-1f1b"}
    for row in rows.values():
        assert len(row["wall_s"]) == 2 and row["median_ms"] > 0
    assert rows["torch-zbv"]["ratio_to_torch_zbv"] == pytest.approx(1.0)
    assert rows["torch-zbv"]["paired_ratio_to_torch_zbv"] == pytest.approx(1.0)
    assert rows["vshape-v-zb"]["ratio_to_torch_zbv"] == pytest.approx(
        rows["vshape-v-zb"]["median_ms"] / rows["torch-zbv"]["median_ms"])
    # The control: our 1F1B against torch's on the same stages, paired round by round.
    assert report["layers_control"] == pytest.approx(bench_peers._paired_ratio(
        rows["vshape-1f1b"]["wall_s"], rows["torch-1f1b"]["wall_s"]))
    # Where each rank's time went: both sides' passes were timed, and compute fits in the iteration.
    split = {(r["system"], r["rank"]): r for r in report["compute"]}
    assert set(split) == {(system, rank) for system in rows for rank in (0, 1)}
    for (system, _rank), record in split.items():
        assert record["forward_ms"] > 0 and record["backward_ms"] > 0
        assert record["forward_ms"] + record["backward_ms"] < 1000 * max(rows[system]["wall_s"])


def test_bench_peers_rejects_unknown_torch_schedule():
    with pytest.raises(SystemExit):
        bench_peers.main(["--torch", "torch-gpipe"])
