"""scripts/gpu_check_overlap.py (issue 43's GPU check) without a GPU: the trace analysis on synthetic Chrome traces
(which share of the expert all-to-all's kernel time runs under compute), the trace step end to end with stand-in
runs that leave such traces, its one-line usage errors, and its two steps in gpu_check.sh's dry run."""

from __future__ import annotations

import gzip
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check_overlap as overlap  # noqa: E402


def kernel(name: str, stream: int, start: float, end: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": end - start, "tid": stream,
            "args": {"stream": stream}}


def trace(hidden: bool) -> dict:
    """Compute on stream 7 over [0, 100] and [150, 250]; the expert all-to-all on stream 20 (2 kernels, 90 us, 50 of
    them under compute when ``hidden``, none otherwise); one pipeline message on stream 30; a CPU op, ignored."""
    a2a = [(50, 120), (260, 280)] if hidden else [(100, 150), (260, 300)]
    return {"traceEvents": [
        kernel("ampere_bf16_gemm", 7, 0, 100), kernel("elementwise_kernel", 7, 150, 250),
        *(kernel("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 20, a, b) for a, b in a2a),
        kernel("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 30, 90, 95),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000, "tid": 1},
    ]}


def test_share_of_the_all_to_all_under_compute():
    got = overlap.a2a_overlap(trace(hidden=True))
    assert (got.stream, got.kernels, got.a2a_us, got.hidden_us) == (20, 2, 90.0, 50.0)
    assert got.share == pytest.approx(50 / 90)
    exposed = overlap.a2a_overlap(trace(hidden=False))
    assert (exposed.a2a_us, exposed.hidden_us, exposed.share) == (90.0, 0.0, 0.0)
    assert overlap.a2a_overlap({"traceEvents": []}).share == 0.0  # no NCCL kernel: nothing hidden


def test_overlapping_compute_kernels_count_once():
    events = trace(hidden=True)
    events["traceEvents"].append(kernel("gemm_on_another_stream", 9, 60, 110))  # over [0, 100] and beyond it
    # [50, 120] meets the compute's union [0, 110] over 60 us (not 50 + 50 for the two kernels); [260, 280] none
    assert overlap.a2a_overlap(events).hidden_us == 60.0


def _writer(root: Path, hidden: bool) -> list[str]:
    """A stand-in training run: writes one rank's trace where Megatron's handler would, given --tensorboard-dir."""
    code = ("import gzip, json, sys, pathlib; d = pathlib.Path(sys.argv[sys.argv.index('--tensorboard-dir') + 1]);"
            "p = d.parent / 'torch_profile'; p.mkdir(parents=True, exist_ok=True);"
            f"gzip.open(p / 'rank-0.json.gz', 'wt').write({json.dumps(json.dumps(trace(hidden)))})")
    return [sys.executable, "-c", code, "--tensorboard-dir", str(root / "tb")]


@pytest.mark.parametrize("flag_hidden, base_hidden, code", [(True, False, 0), (False, False, 1), (True, True, 1)])
def test_trace_step_passes_when_the_flag_hides_the_all_to_all(tmp_path, capsys, flag_hidden, base_hidden, code):
    argv = ["trace", "--min-share", "0.2", "--", *_writer(tmp_path / "flag", flag_hidden), "--baseline",
            *_writer(tmp_path / "base", base_hidden)]
    assert overlap.main(argv) == code
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["flag_share_min"] == pytest.approx(50 / 90 if flag_hidden else 0.0)
    assert result["baseline_share_max"] == pytest.approx(50 / 90 if base_hidden else 0.0)
    assert result["ranks"]["flag"][0]["kernels"] == 2


def test_analyse_reads_gzipped_traces(tmp_path, capsys):
    path = tmp_path / "rank-0.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump(trace(hidden=True), handle)
    assert overlap.main(["analyse", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["share"] == pytest.approx(50 / 90)


@pytest.mark.parametrize("argv, words", [
    (["trace", "--min-share", "1.5", "--", "a", "--tensorboard-dir", "x", "--baseline", "b", "--tensorboard-dir", "y"],
     "--min-share 1.5"),
    (["trace", "--", "a", "--tensorboard-dir", "x"], "--baseline"),
    (["trace", "--", "a", "--baseline", "b", "--tensorboard-dir", "y"], "--tensorboard-dir"),
])
def test_bad_use_is_one_line_naming_the_flag(argv, words):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check_overlap.py"), *argv],
                            capture_output=True, text=True, timeout=60)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and words in lines[0], result.stderr


def _dry_run(gpus: int) -> dict[str, list[str]]:
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--gpus", str(gpus)],
                            capture_output=True, text=True, timeout=120, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    return {c[2:].split("  (")[0]: shlex.split(line) for c, line in zip(lines, lines[1:]) if c.startswith("# moe-overlap")}


def test_gpu_check_runs_the_overlap_steps_with_four_gpus():
    assert _dry_run(2) == {}
    steps = _dry_run(4)
    losses = steps["moe-overlap losses v-zb vs combined interleaved-1f1b pp2 ep2"]
    both = losses[losses.index("--") + 1:]
    reference, run = both[:both.index("--versus")], both[both.index("--versus") + 1:]
    for argv in (reference, run):  # the CPU reference recipe's split, with the flag, on 4 GPUs
        assert "--overlap-moe-expert-parallel-comm" in argv and argv[argv.index("--nproc-per-node") + 1] == "4"
        assert argv[argv.index("--expert-model-parallel-size") + 1] == "2"
    assert reference[reference.index("--pipeline-schedule") + 1] == "interleaved-1f1b"
    assert reference[reference.index("--num-virtual-stages-per-pipeline-rank") + 1] == "2"
    assert run[run.index("--pipeline-schedule") + 1] == "v-zb"
    trace = steps["moe-overlap trace v-zb pp2 ep2 all-to-all under compute"]
    assert trace[:2] == ["env", "CUDA_DEVICE_MAX_CONNECTIONS=32"]
    args = overlap.parse(trace[trace.index("trace"):])
    assert "--overlap-moe-expert-parallel-comm" in args.flag_run
    assert "--overlap-moe-expert-parallel-comm" not in args.baseline and "--use-pytorch-profiler" in args.baseline
