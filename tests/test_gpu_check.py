"""scripts/gpu_check.sh without a GPU: its --dry-run, its argument handling, and a full run with a stand-in
interpreter whose steps pass, fail, hang and print numbers, so every row, timeout and table is exercised."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402

from megatron_vshape.schedules.generators.registry import SCHEDULES  # noqa: E402


def run(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, PYTHON=sys.executable, **(env or {}))
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=full_env)


def dry_run_commands(gpus: int) -> list[list[str]]:
    result = run("--dry-run", "--gpus", str(gpus))
    assert result.returncode == 0, result.stderr
    return [shlex.split(line) for line in result.stdout.splitlines() if not line.startswith("#")]


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def verify_lines(commands):
    return [c for c in commands if "megatron_vshape.verify" in c]


@pytest.mark.slow
def test_dry_run_one_gpu_lists_the_single_gpu_checks():
    commands = dry_run_commands(1)
    verify = verify_lines(commands)
    assert {(value(c, "--schedule"), value(c, "--spec")) for c in verify} == {
        (s, spec) for s in ("v-zb", "v-half", "zb-1p") for spec in ("local", "te")}
    for c in verify:
        assert value(c, "--pp") == "1" and value(c, "--device") == "cuda" and value(c, "--dtype") == "bf16"
    bench = [c for c in commands if any(a.endswith("bench_wgrad.py") for a in c)]
    assert len(bench) == 1 and value(bench[0], "--hidden") == "4096" and value(bench[0], "--dtype") == "bf16"
    pretrain = [c for c in commands if any(a.endswith("pretrain_gpt.py") for a in c)]
    assert len(pretrain) == 1
    assert value(pretrain[0], "--train-iters") == "20" and value(pretrain[0], "--nproc-per-node") == "1"
    assert "--pipeline-model-parallel-size" not in pretrain[0] and "--log-throughput" in pretrain[0]
    hybrid = [c for c in commands if "megatron_vshape.testing.tiny_hybrid" in c]  # a Mamba pattern on a V
    assert len(hybrid) == 1 and "M" in value(hybrid[0], "--pattern") and value(hybrid[0], "--device") == "cuda"
    assert len(commands) == 9


@pytest.mark.slow
@pytest.mark.parametrize("gpus, sizes", [(2, {"2"}), (3, {"2"}), (4, {"2", "4"})])
def test_dry_run_with_more_gpus_adds_every_schedule_over_nccl(gpus, sizes):
    multi = [c for c in verify_lines(dry_run_commands(gpus)) if value(c, "--pp") != "1"]
    assert {value(c, "--pp") for c in multi} == sizes
    for pp in sizes:
        assert sorted(value(c, "--schedule") for c in multi if value(c, "--pp") == pp) == sorted(SCHEDULES)
    for c in multi:
        assert c[:2] == ["env", "CUDA_DEVICE_MAX_CONNECTIONS=1"] and value(c, "--device") == "cuda"


@pytest.mark.slow
def test_every_step_has_a_timeout():
    result = run("--dry-run", "--gpus", "4", "--verify-timeout", "33")
    names = [line for line in result.stdout.splitlines() if line.startswith("# ") and "timeout" in line]
    single = [line for line in run("--dry-run", "--gpus", "1").stdout.splitlines() if line.startswith("# ") and "timeout" in line]
    # 4 GPUs: every TE loss run, and the MoE overlap check's losses and trace (scripts/gpu_check_overlap.py)
    assert len(names) == len(single) + 2 * len(SCHEDULES) + len(gpu_check.TE_LOSS_RUNS) + 2
    assert all("(timeout " in line for line in names)
    assert sum("(timeout 33 s" in line for line in names) == 6 + 1 + 2 * len(SCHEDULES)  # + the hybrid Mamba step


@pytest.mark.slow
@pytest.mark.parametrize("args, flag", [
    (["--gpus", "0"], "--gpus"),
    (["--budget", "0"], "--budget"),
    (["--verify-timeout", "-5"], "--verify-timeout"),
    (["--dry-run", "--only", "no-such-step"], "--only"),
])
def test_bad_arguments_get_one_line_naming_the_flag(args, flag):
    result = run(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], result.stderr


@pytest.mark.slow
def test_unknown_flag_is_a_usage_error():
    result = run("--gpu", "2")
    assert result.returncode == 2 and "unrecognized arguments" in result.stderr


@pytest.mark.slow
def test_without_a_gpu_it_refuses_unless_dry_run(tmp_path):
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}  # no nvidia-smi here
    result = run(env=env)
    assert result.returncode == 2 and "no GPU visible" in result.stderr and "--dry-run" in result.stderr
    assert run("--dry-run", env=env).returncode == 0


STUB = r'''#!{python}
"""Stands in for the interpreter: each step's behaviour comes from its arguments."""
import json, os, sys, time
args = sys.argv[1:]
def opt(name):
    return args[args.index(name) + 1] if name in args else None
if "megatron_vshape.verify" in args or "megatron_vshape.testing.tiny_hybrid" in args:
    schedule, spec = opt("--schedule"), opt("--spec")
    if schedule == "zb-1p" and spec == "te":  # hangs: must be killed with its children
        pid = os.fork()
        if pid == 0:
            time.sleep(300)
            os._exit(0)
        with open(os.environ["STUB_PIDS"], "a") as fh:
            fh.write(f"{{os.getpid()}} {{pid}}\n")
        time.sleep(300)
    if schedule == "v-half" and spec == "te":  # dies before reporting
        print("RuntimeError: NCCL error in: ProcessGroupNCCL.cpp, unhandled cuda error", file=sys.stderr)
        sys.exit(1)
    ok = not (schedule == "v-zb" and spec == "te")
    print(json.dumps({{"max_grad_rel_err": 1e-3 if ok else 0.5, "max_loss_abs_err": 0.0, "grad_tol": 0.02,
                      "wgrad_deferred": 66, "wgrad_run": 66, "passed": ok,
                      "problems": [] if ok else ["gradient relative error 5.000e-01 > 0.02"]}}))
    sys.exit(0 if ok else 1)
if any(a.endswith("bench_wgrad.py") for a in args):
    json.dump({{"b_plus_w_over_fused": 1.031, "b_plus_w_over_fused_min": 1.02, "fused_ms": 3.1, "b_ms": 1.6,
               "w_ms": 1.6, "device": "cuda"}}, open(opt("--json"), "w"))
    sys.exit(0)
if "torch.distributed.run" in args:
    for it in range(1, 21):
        print(f" [2026-01-01] iteration {{it}}/20 | elapsed time per iteration (ms): {{900 + it}} | "
              f"throughput per GPU (TFLOP/s/GPU): {{400 + it}} |")
    sys.exit(0)
sys.exit(7)
'''


@pytest.mark.slow
def test_full_run_gives_every_step_a_row_and_kills_hung_steps(tmp_path):
    stub = tmp_path / "python"
    stub.write_text(STUB.format(python=sys.executable))
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    pids = tmp_path / "pids"
    out_json = tmp_path / "rows.json"
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--python", str(stub), "--gpus", "1",
         "--verify-timeout", "6", "--log-dir", str(tmp_path / "logs"), "--json", str(out_json)],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, STUB_PIDS=str(pids)))
    assert time.monotonic() - start < 60
    assert result.returncode == 1, result.stderr
    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert table[0] == "| step | result | seconds | detail |" and len(table) == 1 + 9
    assert rows_named(out_json, "hybrid M*M-M*M- v-zb one GPU split")["status"] == "PASS"
    rows = {r["name"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert rows["verify v-zb pp1 local bf16"]["status"] == "PASS"
    assert "W deferred/run 66/66" in rows["verify v-zb pp1 local bf16"]["detail"]
    assert rows["verify v-zb pp1 te bf16"]["status"] == "FAIL"
    assert "gradient relative error" in rows["verify v-zb pp1 te bf16"]["detail"]
    assert rows["verify v-half pp1 te bf16"]["status"] == "FAIL"
    assert "NCCL error" in rows["verify v-half pp1 te bf16"]["detail"]
    assert rows["verify zb-1p pp1 te bf16"]["status"] == "TIMEOUT"
    assert rows["bench_wgrad hidden 4096 bf16"]["status"] == "PASS"
    assert "(B+W)/fused 1.031" in rows["bench_wgrad hidden 4096 bf16"]["detail"]
    pretrain = rows["pretrain_gpt pp1 20 iterations"]
    assert pretrain["status"] == "PASS" and "416 TFLOP/s/GPU" in pretrain["detail"]  # median of iterations 11-20
    for pid in map(int, pids.read_text().split()):  # the hung step and its child are gone
        assert not running(pid)


def rows_named(out_json: Path, name: str) -> dict:
    return {r["name"]: r for r in json.loads(out_json.read_text())["rows"]}[name]


def running(pid: int, wait: float = 5.0) -> bool:
    """Whether ``pid`` still runs (a zombie waiting for its reaper has stopped running)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.1)
    return True


@pytest.mark.slow
def test_budget_skips_what_does_not_fit_but_keeps_its_row(tmp_path):
    stub = tmp_path / "python"
    stub.write_text(STUB.format(python=sys.executable))
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--python", str(stub), "--gpus", "1",
         "--only", "pp1", "--verify-timeout", "4", "--budget", "7", "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, STUB_PIDS=str(tmp_path / "pids")))
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and "pp1" in line]
    assert len(rows) == 7 and result.returncode == 1
    # The hung verify (zb-1p te) times out or finds the budget gone; either way nothing is left for the
    # pretraining step, which still gets its row.
    assert "| TIMEOUT |" in rows[5] or "| SKIP |" in rows[5]
    assert rows[6].startswith("| pretrain_gpt pp1") and "| SKIP |" in rows[6] and "budget" in rows[6]


def test_mfu_from_megatron_throughput_and_the_gpu_peak():
    text = "\n".join(f"throughput per GPU (TFLOP/s/GPU): {v} |" for v in (100, 100, 494.5, 494.5))
    detail = gpu_check._pretrain_result(None, text, name="NVIDIA H200")
    assert "MFU 50.0%" in detail and "494 TFLOP/s/GPU" in detail
    with pytest.raises(ValueError):
        gpu_check._pretrain_result(None, "no numbers here", name="NVIDIA H200")


def _loss_commands(gpus: int) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (1F1B command, schedule command) of the TE loss comparisons the dry run lists."""
    result = run("--dry-run", "--gpus", str(gpus))
    lines = result.stdout.splitlines()
    out = {}
    for comment, line in zip(lines, lines[1:]):
        if comment.startswith("# losses "):
            argv = shlex.split(line)
            both = argv[argv.index("--") + 1:]
            split = both.index("--versus")
            out[comment[len("# losses "):].split("  (")[0]] = (both[:split], both[split + 1:])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("gpus, names", [
    (1, set()),
    (2, {"te fp8 v-half vs 1f1b pp2", "te fp8 v-zb vs 1f1b pp2", "vocab-parallel v-half vs 1f1b pp2"}),
    (4, {"te fp8 v-half vs 1f1b pp2", "te fp8 v-zb vs 1f1b pp2", "cp2 v-half vs 1f1b pp2",
         "tp-comm-overlap v-zb vs 1f1b pp2 tp2", "vocab-parallel v-half vs 1f1b pp2"}),
])
def test_dry_run_lists_the_te_fp8_cp_and_tp_overlap_runs_against_1f1b(gpus, names):
    runs = _loss_commands(gpus)
    assert set(runs) == names
    for name, (reference, schedule_run) in runs.items():
        assert value(reference, "--pipeline-schedule") == "1f1b"
        assert value(schedule_run, "--pipeline-schedule") == name.split(" vs ")[0].split()[-1]
        assert "--pipeline-vocab-parallel" not in reference  # Megatron's own 1F1B is the reference
        only = ("--pipeline-vocab-parallel",) if name.startswith("vocab-parallel") else ()
        strip = [a for a in reference if a not in ("1f1b", "29521")]
        assert strip == [a for a in schedule_run if a not in (name.split(" vs ")[0].split()[-1], "29523", *only)], \
            "the two runs differ in the schedule (and port, and the vocabulary flag) only"
        assert all(flag in schedule_run for flag in only)
        assert value(reference, "--nproc-per-node") == str(gpus if "cp2" in name or "tp2" in name else 2)
    if gpus >= 4:
        assert "--fp8-format" in runs["te fp8 v-zb vs 1f1b pp2"][1]
        assert value(runs["cp2 v-half vs 1f1b pp2"][1], "--context-parallel-size") == "2"
        assert "--tp-comm-overlap" in runs["tp-comm-overlap v-zb vs 1f1b pp2 tp2"][1]


def _fake_run(losses: list[float]) -> list[str]:
    lines = [f"iteration {i + 1:8d}/{len(losses):8d} | consumed samples: {i} | lm loss: {loss:.6E} | grad norm: 1.0 |"
             for i, loss in enumerate(losses)]
    return [sys.executable, "-c", "print(" + repr("\n".join(lines)) + ")"]


@pytest.mark.parametrize("got, tol, code", [([10.0, 9.0], 1e-3, 0), ([10.0, 9.1], 1e-3, 1), ([10.0, 9.1], 2e-2, 0),
                                            ([10.0], 1.0, 1)])
def test_compare_losses_checks_every_iteration_against_1f1b(capsys, got, tol, code):
    argv = ["--compare-losses", "--rtol", str(tol), "--", *_fake_run([10.0, 9.0]), "--versus", *_fake_run(got)]
    assert gpu_check.main(argv) == code
    out = capsys.readouterr().out
    if len(got) == 2:
        result = json.loads(out.strip().splitlines()[-1])
        assert result["iterations"] == 2 and result["max_rel_diff"] == pytest.approx(abs(got[1] - 9.0) / 9.0)
