"""Balanced layer layouts: per-stage work from FLOPs and the simulator-scored layout choice (pure Python)."""

import pytest

from megatron_vshape.planner.balance import (
    MIN_STAGE_WORK,
    StageExtras,
    choose_layout,
    default_costs,
    device_work,
    paper_layout,
    placement_for,
    proportional_layout,
    reference_layout,
    stage_work,
)
from megatron_vshape.planner.model import GPTModel
from megatron_vshape.schedules.core.schedule import Costs, ScheduleError, StageWork
from megatron_vshape.schedules.core.simulator import simulate
from megatron_vshape.schedules.generators.registry import get_schedule

# Head = 2hV = 262k FLOPs per token against a layer's 24h^2 + 4sh = 106k: about 2.5 layers.
HEAD_HEAVY = GPTModel("head-heavy", 16, 64, 4, 32, 2048)
NO_HEAD = GPTModel("tiny-vocab", 16, 512, 8, 32, 1)  # the head is 1/6144 of a layer


def test_stage_work_sums_to_the_model_flops_and_memory():
    model = HEAD_HEAVY
    layers = (1, 3, 2, 2, 2, 2, 3, 1)
    works = stage_work(model, layers)
    unit = model.layers / len(layers)  # layers in one uniform stage
    layer_f, layer_b, layer_w = model.layer_flops(1)
    head = model.head_flops(1)
    assert sum(w.f for w in works) * unit * layer_f == pytest.approx(model.layers * layer_f + head)
    assert sum(w.b for w in works) * unit * layer_b == pytest.approx(model.layers * layer_b + head)
    assert sum(w.w for w in works) * unit * layer_w == pytest.approx(model.layers * layer_w + head)
    act = model.activation_bytes(1, 1, False)
    assert sum(w.memory for w in works) * unit * act == pytest.approx(model.layers * act + model.logits_bytes(1, 1))


def test_uniform_stages_without_head_are_today_costs():
    works = stage_work(NO_HEAD, (2,) * 8)
    assert all(w.f == w.b == w.w == w.memory == 1.0 for w in works[:-1])
    assert works[-1].f == pytest.approx(1.0, abs=1e-3)


def test_head_sits_on_the_last_stage_and_an_empty_first_stage_is_tiny_but_positive():
    works = stage_work(HEAD_HEAVY, (0, 4, 4, 4, 4, 0))
    assert works[0].f == works[0].memory == MIN_STAGE_WORK
    unit = HEAD_HEAVY.layers / 6  # layers in a uniform stage
    assert works[-1].f == pytest.approx(HEAD_HEAVY.head_flops(1) / (unit * HEAD_HEAVY.layer_flops(1)[0]))
    assert works[-1].memory > 0.5  # the fp32 logits


def test_reference_layouts():
    assert reference_layout(32, 8) == ("uniform", (4,) * 8)
    assert paper_layout(78, 40) == (1,) + (2,) * 38 + (1,)
    assert reference_layout(78, 40)[0] == "paper"
    name, counts = reference_layout(7, 4)
    assert name == "even" and sum(counts) == 7 and counts[0] <= counts[1]


@pytest.mark.parametrize("schedule", ["1f1b", "v-half"])
def test_proportional_start_sums_and_keeps_middle_stages(schedule):
    placement = placement_for(schedule, 4)
    counts = proportional_layout(HEAD_HEAVY, placement, default_costs(HEAD_HEAVY))
    assert sum(counts) == HEAD_HEAVY.layers and len(counts) == placement.num_stages
    assert all(c >= 1 for c in counts[1:-1])


def _device_layers(schedule, counts, d):
    return [sum(counts[s] for s in stages) for stages in placement_for(schedule, d).stages_per_device]


@pytest.mark.parametrize("schedule, d", [("v-half", 2), ("v-half", 4), ("v-min", 4), ("v-zb", 4), ("1f1b", 4)])
def test_balanced_is_never_slower_and_relieves_the_head_device(schedule, d):
    costs = Costs(1.0, 1.2, 0.8, 0.05)
    choice = choose_layout(HEAD_HEAVY, schedule, d, 4 * d, costs)
    assert choice.iteration_time <= choice.reference_time
    head_device = 0 if schedule.startswith("v-") else d - 1  # the device holding the LM head
    balanced = _device_layers(schedule, choice.layers_per_stage, d)
    uniform = _device_layers(schedule, choice.reference_layers, d)
    assert balanced[head_device] < uniform[head_device]
    assert choice.speedup > 1.05  # 2.5 layers of head on 16 layers: a visible gain


def test_balanced_equals_uniform_when_there_is_nothing_to_balance():
    choice = choose_layout(NO_HEAD, "v-half", 2, 8)
    assert choice.layers_per_stage == choice.reference_layers == (4, 4, 4, 4)


def test_choice_is_what_the_simulator_says_and_deterministic():
    first = choose_layout(HEAD_HEAVY, "v-half", 4, 16)
    second = choose_layout(HEAD_HEAVY, "v-half", 4, 16)
    assert first == second
    costs = default_costs(HEAD_HEAVY).with_stages(stage_work(HEAD_HEAVY, first.layers_per_stage))
    result = simulate(get_schedule("v-half", 4, 16, costs), costs)
    assert result.makespan_total == pytest.approx(first.iteration_time)


def test_per_device_work_of_the_chosen_layout_is_more_even():
    choice = choose_layout(HEAD_HEAVY, "v-half", 4, 16)
    placement = placement_for("v-half", 4)
    costs = default_costs(HEAD_HEAVY)
    before = device_work(stage_work(HEAD_HEAVY, choice.reference_layers), placement, costs)
    after = device_work(stage_work(HEAD_HEAVY, choice.layers_per_stage), placement, costs)
    assert max(after) < max(before)
    assert sum(after) == pytest.approx(sum(before))


def test_errors_are_one_line():
    with pytest.raises(ScheduleError, match="unknown schedule"):
        choose_layout(HEAD_HEAVY, "nope", 4, 16)
    with pytest.raises(ValueError, match="--pipeline-layout: 4 layers cannot fill the 6 middle stages"):
        choose_layout(GPTModel("small", 4, 64, 4, 32, 2048), "v-half", 4, 16)


def test_vshape_plan_prints_reference_and_balanced_layouts(capsys):
    from megatron_vshape.planner.cli import main as plan_main

    argv = ["--model", "9.6b", "--gpus", "8", "--global-batch", "16", "--tp", "1", "--pp", "8",
            "--micro-batch", "1", "--schedules", "1f1b,1f1b-r,v-half"]
    assert plan_main(argv) == 0
    out = capsys.readouterr().out
    assert "Layer layout of each best configuration" in out
    v_half = next(line for line in out.splitlines() if line.startswith("v-half") and "balanced" in line)
    assert "paper 1,2,2,2,2,2,2,2,2,2,2,2,2,2,2,1: iter" in v_half and "MFU" in v_half
    assert "1f1b-r           not compared: 1f1b-r: layer balancing does not model recomputation" in out
    assert plan_main([*argv, "--no-layouts"]) == 0
    assert "Layer layout" not in capsys.readouterr().out


def test_uniform_reference_is_timed_on_the_order_training_builds():
    """Training builds a uniform layout's schedule from the base costs (no per-stage work)."""
    choice = choose_layout(HEAD_HEAVY, "v-zb", 4, 16)
    costs = default_costs(HEAD_HEAVY)
    staged = costs.with_stages(stage_work(HEAD_HEAVY, choice.reference_layers))
    result = simulate(get_schedule("v-zb", 4, 16, costs), staged)
    assert choice.reference_name == "uniform"
    assert result.makespan_total == pytest.approx(choice.reference_time)


def test_measured_extras_replace_the_flops_model():
    """A measurement that finds the head cheap keeps the uniform split; a heavy embedding moves
    layers off the first stage instead of the last."""
    cheap_head = StageExtras(head=(0.0, 0.0, 0.0))
    assert choose_layout(HEAD_HEAVY, "1f1b", 4, 16, extras=cheap_head).layers_per_stage == (4, 4, 4, 4)
    heavy_embedding = StageExtras(embedding=(3.0, 3.0, 3.0))
    counts = choose_layout(HEAD_HEAVY, "1f1b", 4, 16, extras=heavy_embedding).layers_per_stage
    assert counts[0] < 4 and counts[-1] >= 4, counts
    with pytest.raises(ValueError, match="stage extras must be three numbers >= 0"):
        StageExtras(head=(1.0, -1.0, 0.0))


def _script(name):
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    return importlib.import_module(name)


def test_bench_layout_reads_the_head_cost_off_a_uniform_run():
    """Per-stage pass times of a uniform layout (2 layers a stage): the middle stages give a layer's
    F/B/W, the first and last stages' surplus the embedding's and the head's, in layers' worth."""
    bench = _script("bench_layout")
    layer = (1.0, 2.0, 0.5)  # seconds of one layer's F, B, W
    times = [[2 * t for t in layer] for _ in range(4)]
    times[0] = [2 * layer[0] + 0.5, 2 * layer[1], 2 * layer[2] + 1.0]  # embedding: 0.5 F, 2 W
    times[3] = [2 * layer[0] + 3.0, 2 * layer[1] + 2.0, 2 * layer[2] + 1.5]  # head: 3 F, 1 B, 3 W
    by_kind = [[times[s][k] for s in range(4)] for k in range(3)]
    costs, extras = bench.measured_costs(by_kind, (2, 2, 2, 2), num_layers=8, pp=2)
    assert (costs.f, costs.b, costs.w) == pytest.approx((2.0, 4.0, 1.0))  # one V chunk = 2 layers
    assert extras.embedding == pytest.approx((0.5, 0.0, 2.0))
    assert extras.head == pytest.approx((3.0, 1.0, 3.0))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_layout_runs_three_layouts_and_vocabulary_parallelism_side_by_side(tmp_path):
    import json

    out = tmp_path / "bench.json"
    bench = _script("bench_layout")
    assert bench.main(["--pp", "2", "--layers", "4", "--hidden", "32", "--heads", "4", "--vocab", "2048",
                       "--seq", "16", "--microbatches", "4", "--iters", "2", "--warmup", "0", "--calibration", "1",
                       "--timeout", "280", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["times_s"]) == {"uniform", "balanced", "balanced-measured", "vocab-parallel"}
    assert all(len(t) == 2 for t in report["times_s"].values())
    assert report["layouts"]["uniform"] == [1, 1, 1, 1] and sum(report["layouts"]["balanced"]) == 4
    assert report["predicted_ratio"]["balanced"] < 1.0  # the head is 5 layers' worth by FLOPs
    assert report["layouts"]["vocab-parallel"] == [1, 1, 1, 1]
    assert set(report["vocab_pass_s"]) == {"F", "B", "W", "H", "G"}  # the vocabulary passes ran
    # The prediction simulates the schedules that ran with the costs measured in the same iterations.
    in_run = report["in_run"]
    # (H per rank: the last stage's rank's own, H_holder, is longer: the loss function, the reduce's wait)
    assert set(in_run["uniform"]["costs"]) == {"F", "B", "W"}
    assert set(in_run["vocab-parallel"]["costs"]) == {*"FBWHG", "H_holder"}
    assert all(row["makespan"] > 0.0 and row["outside"] >= 0.0 for row in in_run.values())
    assert report["predicted_ratio"]["vocab-parallel"] == pytest.approx(
        (in_run["vocab-parallel"]["makespan"] + in_run["vocab-parallel"]["outside"])
        / (in_run["uniform"]["makespan"] + in_run["uniform"]["outside"]))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_balanced_layouts_script_quick(tmp_path):
    import json

    out = tmp_path / "rows.json"
    assert _script("balanced_layouts").main(["--quick", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["schedule"] for r in rows] == ["1f1b", "v-half", "v-zb"]
    for row in rows:
        assert row["balanced_mfu"] > row["reference_mfu"] * 1.1  # the 128k-vocabulary head is ~2 layers


def test_bench_layout_predicts_a_row_from_the_passes_as_they_ran():
    """The vocabulary row's prediction: the simulator on the schedule that ran, with the costs read off the
    recorded passes. Fed the simulator's own run (each rank's H recorded from its arrival, as the executor
    records it: the early rank's H holds its wait), it gives back that run's makespan: H's cost is read from
    the last rank to arrive, not the mean over ranks (which counts the waits as work)."""
    from megatron_vshape.schedules.core.actions import VocabKind
    from megatron_vshape.schedules.core.schedule import VocabWork

    bench = _script("bench_layout")
    costs = Costs(1.0, 1.3, 0.8, stages=(StageWork(), StageWork(1.2, 1.1, 1.0), StageWork(), StageWork(0.9, 1.0, 1.3)),
                  vocab=VocabWork(f=1.5, b=1.5, w=1.0))
    schedule = get_schedule("v-zb", 2, 6, costs)
    result = simulate(schedule, costs)
    by_rank = []
    for program in schedule.programs:
        passes, free = [], 0.0
        for action in program:
            span = result.timeline[action]
            start = free if action.kind is VocabKind.H else span.start  # H recorded from the rank's arrival
            passes.append((action, start, span.end))
            free = span.end
        by_rank.append([passes])
    waits = sum(end - start for passes in by_rank for action, start, end in passes[0] if action.kind is VocabKind.H) \
        - 2 * 6 * costs.vocab.shard_times(costs, 2)[0]
    assert waits > 0.1  # some rank did arrive early
    row = bench._simulate_as_ran(schedule, by_rank, [result.makespan_total + 0.5])
    assert row.makespan == pytest.approx(result.makespan_total, rel=1e-9)
    assert row.outside == pytest.approx(0.5)
    assert row.costs["H"] == pytest.approx(costs.vocab.shard_times(costs, 2)[0])
