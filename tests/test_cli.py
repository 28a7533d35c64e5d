"""The ``vshape`` command line: list, simulate, plot, export, import, and its error handling."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_vshape import cli
from megatron_vshape.schedules.core.simulator import simulate
from megatron_vshape.schedules.generators.registry import SCHEDULES, get_schedule


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def simulate_json(capsys, *argv: str) -> dict:
    code, out, err = run(capsys, "simulate", *argv, "--json")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1  # exactly one JSON object
    return json.loads(lines[0])


def test_list(capsys):
    code, out, _ = run(capsys, "list")
    assert code == 0
    lines = out.strip().splitlines()
    assert [line.split()[0] for line in lines] == list(SCHEDULES)
    for line, spec in zip(lines, SCHEDULES.values()):
        assert spec.description in line and spec.microbatch_rule in line
    assert "multiple of d" in next(line for line in lines if line.startswith("interleaved-1f1b"))


def test_simulate_summary(capsys):
    code, out, err = run(capsys, "simulate", "--schedule", "v-half", "--stages", "4", "--microbatches", "8")
    assert code == 0 and err == ""
    expected = simulate(get_schedule("v-half", 4, 8))
    assert "validated:    ok" in out and f"makespan      {expected.makespan:g}" in out
    assert f"bubble rate   {expected.bubble_rate:.4f}" in out
    assert f"peak memory   max {expected.peak_memory_max:g}" in out


def test_simulate_grid(capsys):
    code, out, _ = run(capsys, "simulate", "-s", "v-min", "-d", "2", "-m", "2", "--grid")
    assert code == 0
    grid = [line for line in out.splitlines() if line.startswith("d")]
    assert len(grid) == 2 and grid[0].startswith("d0  F0.0")


def test_simulate_json_matches_library(capsys):
    data = simulate_json(capsys, "--schedule", "v-zb", "--stages", "4", "--microbatches", "8",
                         "--costs", "f=1,b=1.1,w=0.9,comm=0.05")
    expected = simulate(get_schedule("v-zb", 4, 8, cli.Costs.parse("f=1,b=1.1,w=0.9,comm=0.05")),
                        cli.Costs.parse("f=1,b=1.1,w=0.9,comm=0.05"))
    for key in ("schedule", "stages", "microbatches", "makespan", "bubble_rate", "work_per_device",
                "peak_memory", "peak_memory_max"):
        assert key in data
    assert data["schedule"] == "v-zb" and data["stages"] == 4 and data["microbatches"] == 8
    assert data["makespan"] == pytest.approx(expected.makespan)
    assert data["bubble_rate"] == pytest.approx(expected.bubble_rate)
    assert data["peak_memory"] == pytest.approx(list(expected.peak_memory))
    assert len(data["peak_memory"]) == 4 and data["peak_memory_max"] == max(data["peak_memory"])
    assert data["costs"] == {"f": 1.0, "b": 1.1, "w": 0.9, "comm": 0.05}
    assert data["validated"] is True


@pytest.mark.parametrize("d, m", [(2, 4), (4, 8), (8, 16), (4, 1)])
@pytest.mark.parametrize("costs", ["f=1,b=1,w=1", "f=1,b=1.5,w=0.5"])
def test_1f1b_bubble_via_cli(capsys, d, m, costs):
    # 1F1B runs B+W as one backward: its bubble is the textbook (d-1)/(m+d-1) for any costs.
    data = simulate_json(capsys, "-s", "1f1b", "-d", str(d), "-m", str(m), "--costs", costs)
    assert data["bubble_rate"] == pytest.approx((d - 1) / (m + d - 1))


def test_gpt_memory_model(capsys):
    simple = simulate_json(capsys, "-s", "1f1b", "-d", "4", "-m", "8")
    gpt = simulate_json(capsys, "-s", "1f1b", "-d", "4", "-m", "8", "--memory-model", "gpt",
                        "--hidden", "1024", "--heads", "16", "--seq", "2048")
    assert gpt["peak_memory_max"] <= simple["peak_memory_max"]
    assert gpt["makespan"] == simple["makespan"]


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["simulate", "-s", "nope", "-d", "4", "-m", "8"], "--schedule"),
        (["simulate", "-s", "v-half", "-d", "4", "-m", "8", "--costs", "f=x"], "--costs"),
        (["simulate", "-s", "v-half", "-d", "4", "-m", "8", "--costs", "q=1"], "--costs"),
        (["simulate", "-s", "v-half", "-d", "4", "-m", "8", "--costs", "f=0"], "--costs"),
        (["simulate", "-s", "v-half", "-d", "4"], "--microbatches"),
        (["simulate", "-s", "v-half", "-d", "x", "-m", "8"], "--stages"),
        (["simulate", "-s", "v-half", "-d", "1", "-m", "8"], "--stages"),
        (["simulate", "-s", "v-half", "-d", "4", "-m", "0"], "--microbatches"),
        (["simulate", "-s", "interleaved-1f1b", "-d", "4", "-m", "2"], "--microbatches"),
        (["simulate", "-s", "interleaved-1f1b", "-d", "4", "-m", "8", "--chunks", "1"], "--chunks"),
        (["simulate", "-s", "v-half", "-d", "4", "-m", "8", "--memory-model", "gpt"], "--hidden"),
        (["simulate", "-s", "v-half", "-d", "4", "-m", "8", "--hidden", "8"], "--memory-model"),
        (["simulate", "-s", "v-half", "-d", "4", "-m", "8", "--memory-limit", "-1"], "--memory-limit"),
        (["export", "-s", "v-half", "-d", "4", "-m", "8", "--format", "xml"], "--format"),
        (["plot", "-s", "v-half", "-d", "2", "-m", "2", "-o", "x.jpg"], "-o"),
        (["bogus"], "COMMAND"),
        ([], "COMMAND"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, argv, flag):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("vshape: error:") and flag in lines[0]
    assert "Traceback" not in err


def test_memory_limit_passed_through_only_when_given(capsys, monkeypatch):
    calls = []

    def fake_get_schedule(name, num_devices, num_microbatches, costs=None, chunks=2, memory_limit=None):
        calls.append(memory_limit)
        return get_schedule(name, num_devices, num_microbatches)

    monkeypatch.setattr(cli, "get_schedule", fake_get_schedule)
    assert run(capsys, "simulate", "-s", "v-half", "-d", "2", "-m", "2")[0] == 0
    assert run(capsys, "simulate", "-s", "v-half", "-d", "2", "-m", "2", "--memory-limit", "0.5")[0] == 0
    assert calls == [None, 0.5]


def test_memory_limit_reaches_v_auto(capsys):
    code, out, err = run(capsys, "simulate", "-s", "v-auto", "-d", "4", "-m", "8", "--memory-limit", "0.5", "--json")
    assert code == 0, err
    assert json.loads(out)["peak_memory_max"] <= 0.5 * 4
    code, _, err = run(capsys, "simulate", "-s", "v-half", "-d", "4", "-m", "8", "--memory-limit", "0.5")
    assert code == 2 and "only applies to v-auto" in err


@pytest.mark.slow  # matplotlib: seconds per picture; in the README's test command
def test_plot(tmp_path, capsys):
    png, mem = tmp_path / "v.png", tmp_path / "mem.svg"
    code, out, err = run(capsys, "plot", "-s", "v-half", "-d", "4", "-m", "8", "-o", str(png), "--memory", str(mem))
    assert code == 0, err
    assert png.stat().st_size > 20_000 and mem.read_text().lstrip().startswith("<?xml")
    only_memory = tmp_path / "only.png"
    assert run(capsys, "plot", "-s", "1f1b", "-d", "2", "-m", "3", "-o", str(only_memory), "--memory")[0] == 0
    assert only_memory.stat().st_size > 5_000


@pytest.mark.parametrize("name, placement", [("v-min", "v"), ("v-zb", "v"), ("interleaved-1f1b", "looped"),
                                             ("zb-h1", "looped")])
def test_export_import_torch_csv(tmp_path, capsys, name, placement):
    path = tmp_path / "s.csv"
    code, _, err = run(capsys, "export", "-s", name, "-d", "4", "-m", "8", "--format", "torch-csv", "-o", str(path))
    assert code == 0, err
    original = simulate_json(capsys, "-s", name, "-d", "4", "-m", "8")
    code, out, err = run(capsys, "import", "--format", "torch-csv", str(path), "--stages", "4",
                         "--placement", placement, "--json")
    assert code == 0, err
    imported = json.loads(out)
    assert imported["schedule"] == "s"
    for key in ("makespan", "bubble_rate", "peak_memory", "num_stages", "microbatches"):
        assert imported[key] == original[key]


def test_export_import_text_and_merged_csv(tmp_path, capsys):
    text, csv = tmp_path / "v.txt", tmp_path / "v.csv"
    assert run(capsys, "export", "-s", "v-half", "-d", "4", "-m", "8", "-f", "text", "-o", str(text))[0] == 0
    assert run(capsys, "export", "-s", "1f1b", "-d", "4", "-m", "8", "-f", "torch-csv", "-o", str(csv))[0] == 0
    assert "0B0" in csv.read_text() and "I" not in csv.read_text()  # 1f1b: merged by default
    code, out, _ = run(capsys, "import", "-f", "text", str(text), "--placement", "v")
    expected = simulate(get_schedule("v-half", 4, 8))
    assert code == 0 and "validated:    ok" in out and f"makespan      {expected.makespan:g}" in out
    original = simulate_json(capsys, "-s", "1f1b", "-d", "4", "-m", "8")
    code, out, _ = run(capsys, "import", "-f", "torch-csv", str(csv), "--placement", "looped", "--json")
    assert code == 0 and json.loads(out)["bubble_rate"] == original["bubble_rate"]
    # Split on export, or imported as split: W is off the critical path, so the bubble shrinks.
    assert run(capsys, "export", "-s", "1f1b", "-d", "4", "-m", "8", "-f", "torch-csv", "--no-merge-backward",
               "-o", str(csv))[0] == 0
    assert "0I0" in csv.read_text()
    code, out, _ = run(capsys, "import", "-f", "torch-csv", str(csv), "--placement", "looped", "--json")
    assert json.loads(out)["bubble_rate"] < original["bubble_rate"]
    code, out, _ = run(capsys, "import", "-f", "torch-csv", str(csv), "--placement", "looped", "--json",
                       "--fused-backward")
    assert json.loads(out)["bubble_rate"] == original["bubble_rate"]
    assert run(capsys, "export", "-s", "1f1b", "-d", "4", "-m", "8", "-f", "text", "-o", str(text))[0] == 0
    code, out, _ = run(capsys, "import", "-f", "text", str(text), "--placement", "looped", "--json",
                       "--fused-backward")
    assert json.loads(out)["bubble_rate"] == original["bubble_rate"]


def test_import_errors(tmp_path, capsys):
    path = tmp_path / "s.csv"
    run(capsys, "export", "-s", "v-half", "-d", "2", "-m", "2", "-f", "torch-csv", "-o", str(path))
    for argv, needle in [
        (["--placement", "looped"], "--placement"),
        (["--placement", "v", "--stages", "3"], "--stages"),
        (["--placement", "v", "--chunks", "3"], "--chunks"),
    ]:
        code, _, err = run(capsys, "import", "-f", "torch-csv", str(path), *argv)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1
    # A pass before its own dependency on the same device (B1.0 before F1.0) is caught by validation.
    broken = tmp_path / "broken.csv"
    broken.write_text("0F0,3F0,3I0,3W0,0F1,0I0,0W0,3F1,3I1,3W1,0I1,0W1\n1I0,1F0,2F0,2I0,1W0,1F1,2F1,2I1,1I1,1W1,2W0,2W1\n")
    code, _, err = run(capsys, "import", "-f", "torch-csv", str(broken), "--placement", "v")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "before its dependency" in err
    code, _, err = run(capsys, "import", "-f", "torch-csv", str(tmp_path / "missing.csv"), "--placement", "v")
    assert code == 2 and "missing.csv" in err


def test_import_refuses_an_order_that_deadlocks_across_devices(tmp_path, capsys):
    """Each device's own order is fine, but device 0 waits for microbatch 0's gradient, which
    device 1 computes only after microbatch 1's forward, which device 0 sends only after that wait."""
    path = tmp_path / "deadlock.csv"
    path.write_text("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n")
    code, _, err = run(capsys, "import", "-f", "torch-csv", str(path), "--placement", "looped")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "deadlocks" in err and "device 0 waits" in err and "device 1 waits" in err
    # Device 0 sending both forwards before its first backward breaks the cycle: the order runs.
    path.write_text("0F0,0F1,0B0,0B1\n1F1,1B1,1F0,1B0\n")
    code, out, err = run(capsys, "import", "-f", "torch-csv", str(path), "--placement", "looped")
    assert code == 0 and "validated:    ok" in out, err


@pytest.mark.parametrize("fmt", ["chrome-trace", "grid", "json", "text", "torch-csv"])
def test_export_to_stdout(capsys, fmt):
    code, out, _ = run(capsys, "export", "-s", "v-min", "-d", "2", "-m", "3", "-f", fmt)
    assert code == 0 and out.strip()
    if fmt in ("chrome-trace", "json"):
        json.loads(out)


@pytest.mark.slow
def test_console_script_module_entry():
    proc = subprocess.run([sys.executable, "-m", "megatron_vshape.cli", "simulate", "-s", "1f1b", "-d", "2",
                           "-m", "2", "--json"], capture_output=True, text=True, check=True)
    assert json.loads(proc.stdout)["schedule"] == "1f1b"
    proc = subprocess.run([sys.executable, "-m", "megatron_vshape.cli", "simulate", "-s", "??", "-d", "2",
                           "-m", "2"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- plan and verify follow the CLI's conventions (issue 12)


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vshape: error: "), err
    return lines[0]


@pytest.mark.parametrize("argv, expected", [
    (["--schedule", "v-half"], "the following arguments are required: --pp (see vshape verify --help)"),
    (["--schedule", "nope", "--pp", "2"], "--schedule: unknown 'nope'"),
    (["--schedule", "v-half", "--pp", "2", "--layers", "6"], "--layers 6 must divide into 4 stages"),
    (["--schedule", "v-auto", "--pp", "2", "--memory-limit", "nan"], "--memory-limit: must be a finite number"),
    (["--schedule", "v-half", "--pp", "2", "--timeout", "-1"], "--timeout: must be in (0, 1e+06]"),
    (["--schedule", "v-half", "--pp", "100"], "--pp: must be in [1, 64]"),
])
def test_verify_bad_arguments_exit_2_with_the_prefix(capsys, argv, expected):
    code = cli.main(["verify", *argv])  # was: SystemExit(1) with a bare message, or argparse's usage dump
    assert code == 2 and expected in one_error_line(capsys.readouterr().err)


PLAN_9_6B = ["plan", "--model", "9.6b", "--global-batch", "64"]


def test_plan_says_why_nothing_fits_for_7_gpus(capsys):
    # 30 layers on 7 (14) stages: an uneven layout runs it (issue 23: no divisibility rule hides a configuration)
    assert cli.main([*PLAN_9_6B, "--gpus", "7", "--no-layouts"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()[1:]
    plain = [line for line in lines if "+vocab" not in line]
    assert len(plain) == 5 and not any("nothing fits" in line for line in plain), lines
    # --pipeline-vocab-parallel cannot run here (51200 rows do not split over PP 7): one line says so, not five
    assert lines[5:] == [line for line in lines if "+vocab" in line] and len(lines) == 6, lines
    assert "does not split into TP 1 x PP 7 equal shards; set --make-vocab-size-divisible-by" in lines[5]
    # too few layers for the middle stages is still a reason, in one line
    assert cli.main(["plan", "--layers", "4", "--hidden", "1024", "--heads", "8", "--global-batch", "64",
                     "--gpus", "7", "--schedules", "v-half", "--no-layouts"]) == 0
    assert "nothing fits: no layout can run it: 4 layers cannot fill the 12 middle stages" in capsys.readouterr().out


@pytest.mark.parametrize("argv, expected", [
    (["--gpus", "16", "--tp", "16"], "--tp: TP must be at most the 8 GPUs of one node; got 16"),
    (["--gpus", "16", "--pp", "3"], "--gpus 16: no split into TP x PP x DP"),
    (["--gpus", "1"], "--gpus: must be in [2, 65536]; got 1"),
    (["--gpus", "16", "--efficiency", "nan"], "--efficiency: must be a finite number in (0, 1]"),
    (["--gpus", "16", "--calibrate-f-ms", "inf"], "--calibrate-f-ms: must be a finite number"),
    (["--gpus", "16", "--micro-batch", "0"], "--micro-batch: '0': give positive integers"),
])
def test_plan_bad_input_is_one_prefixed_line_with_exit_2(capsys, argv, expected):
    assert cli.main([*PLAN_9_6B, *argv]) == 2
    assert expected in one_error_line(capsys.readouterr().err)


def test_plan_reasons_memory_and_batch(capsys):
    assert cli.main(["plan", "--model", "98.5b", "--global-batch", "64", "--gpus", "8", "--schedules", "v-half"]) == 0
    assert "nothing fits: weights, gradients and optimizer state alone exceed A100 80GB's memory" in \
        capsys.readouterr().out
    assert cli.main(["plan", "--model", "9.6b", "--global-batch", "256", "--seq", "4096", "--gpus", "16",
                     "--schedules", "gpipe", "--micro-batch", "8", "--tp", "1", "--pp", "16"]) == 0
    assert "nothing fits: every layout simulated is out of memory (least: DP1 TP1 PP16 mb8 x32 needs" in \
        capsys.readouterr().out


def test_plan_progress_above_the_size_threshold(capsys, monkeypatch):
    from megatron_vshape.planner import cli as plan_cli

    monkeypatch.setattr(plan_cli, "LARGE_SEARCH", 0)
    # A small search (PP 8 only, no layer layouts): the progress lines are what is checked.
    assert cli.main([*PLAN_9_6B, "--gpus", "16", "--schedules", "1f1b,v-half", "--pp", "8", "--no-layouts"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("vshape plan: searching 2 schedules, 4 rows (up to ") and err[0].endswith(" ...")
    assert err[-1].startswith("vshape plan: searching 2 schedules, ") and "done in" in err[-1]


def test_simulate_reads_the_costs_training_writes(tmp_path, capsys):
    """--costs-from FILE takes f, b, w, comm from the JSON that --pipeline-costs-out writes."""
    import json as json_mod

    from megatron_vshape.cli import main as vshape_main

    path = tmp_path / "costs.json"
    path.write_text(json_mod.dumps({"f": 1.0, "b": 1.1, "w": 0.9, "comm": 0.05, "seconds": {}, "after_iteration": 4}))
    assert vshape_main(["simulate", "--schedule", "v-zb", "--stages", "4", "--microbatches", "8",
                        "--costs-from", str(path), "--json"]) in (0, None)
    assert json_mod.loads(capsys.readouterr().out)["costs"] == {"f": 1.0, "b": 1.1, "w": 0.9, "comm": 0.05}
    path.write_text("{}")
    code = vshape_main(["simulate", "--schedule", "v-zb", "--stages", "4", "--microbatches", "8",
                        "--costs-from", str(path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "needs the keys f, b, w and comm" in err
