#!/usr/bin/env python
"""The GPU checks, as one table: what a freshly lent GPU (or node) must show before a long run.

    scripts/gpu_check.sh [--dry-run] [--gpus N] [--budget S] [--only TEXT] [--json PATH] [--log-dir DIR]

One GPU (about 5 minutes; ``--budget``, default 480 s, caps the whole single-GPU part):
  * ``vshape verify`` of v-zb, v-half and zb-1p at PP=1 (both V chunks on the GPU), bf16, with the local
    spec and with the GPU spec (``--spec te``: the split layer spec), against the fused one-process
    reference: gradients, losses, and that B really deferred weight gradients to W;
  * ``scripts/bench_wgrad.py --hidden 4096 --dtype bf16``: (B + W) / fused backward of a GPT layer;
  * 20 iterations of ``scripts/pretrain_gpt.py`` at PP=1 (a 1.3B GPT, TE spec, bf16), with MFU.
Two or more GPUs add ``vshape verify`` of every schedule at PP=2 (and PP=4 with 4+ GPUs) over NCCL with
``CUDA_DEVICE_MAX_CONNECTIONS=1`` (``--multi-budget``, default 1200 s).
Transformer Engine runs (each compares its losses with Megatron's 1F1B on the same flags, iteration by
iteration: ``gpu_check.py --compare-losses``; ``--loss-timeout``, default 420 s each, on the multi budget):
  * 2+ GPUs: TE + FP8 (``--fp8-format hybrid``, the TE split spec: TE's deferred W) under V-Half and V-ZB, PP=2;
  * 4+ GPUs: context parallelism 2 under V-Half (PP=2 x CP=2), and ``--tp-comm-overlap`` under V-ZB
    (PP=2 x TP=2, sequence parallel).
4+ GPUs also run issue 43's overlap check (scripts/gpu_check_overlap.py; ``--overlap-timeout``, default 600 s
each): V-ZB with ``--overlap-moe-expert-parallel-comm`` gives the losses of Megatron's combined interleaved 1F1B
on the CPU reference recipe, and a profiler trace shows its expert all-to-all under compute.

Every step runs in its own process group with a timeout and gets a row (PASS / FAIL / TIMEOUT /
SKIP) even when it fails; its output goes to ``--log-dir``. Exit 0 when every row passed, 1 otherwise,
2 on bad arguments. ``--dry-run`` prints the commands and runs nothing (no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import gpu_check_overlap  # scripts/ is this script's own directory

ROOT = Path(__file__).resolve().parent.parent
SINGLE_GPU_SCHEDULES = ("v-zb", "v-half", "zb-1p")
SPECS = ("local", "te")
MIN_STEP_SECONDS = 5.0  # a step is skipped when less than this (or its own timeout) is left of its budget
# Dense bf16 peak TFLOP/s per GPU (for MFU from Megatron's TFLOP/s line when no [vshape] MFU is printed).
PEAK_TFLOPS = {"A100": 312.0, "A800": 312.0, "H100": 989.0, "H800": 989.0, "H200": 989.0, "B200": 2250.0}
# A 1.3B GPT (24 x 2048, seq 2048): big enough for a meaningful MFU, 20 iterations in about a minute.
PRETRAIN_MODEL = (
    "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 "
    "--micro-batch-size 4 --global-batch-size 32 --lr 1e-4 --bf16 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 50257 --log-interval 1 --log-throughput --eval-interval 1000000 --eval-iters 0"
)


# The TE runs: a 12-layer GPT small enough for 2 GPUs, 10 iterations (losses compared iteration by iteration).
LOSS_MODEL = (
    "--num-layers 12 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 "
    "--micro-batch-size 1 --global-batch-size 16 --lr 1e-4 --bf16 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 50257 --log-interval 1 --eval-interval 1000000 --eval-iters 0 --train-iters 10 "
    "--pipeline-model-parallel-size 2 --hidden-dropout 0.0 --attention-dropout 0.0"
)
FP8 = "--fp8-format hybrid --fp8-amax-history-len 16 --fp8-amax-compute-algo max"
# (name, min GPUs, extra flags, schedule, relative loss tolerance vs 1F1B). FP8's delayed scaling updates its
# amax history in the schedule's order, so FP8 runs agree to a looser tolerance than bf16 ones.
TE_LOSS_RUNS = (
    ("te fp8 v-half vs 1f1b pp2", 2, FP8, "v-half", 2e-2),
    ("te fp8 v-zb vs 1f1b pp2", 2, FP8, "v-zb", 2e-2),
    ("cp2 v-half vs 1f1b pp2", 4, "--context-parallel-size 2", "v-half", 2e-3),
    ("tp-comm-overlap v-zb vs 1f1b pp2 tp2", 4,
     "--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap", "v-zb", 2e-3),
    # The flag on the compared run only: Megatron's 1F1B without it is the reference (NCCL collectives of
    # the vocabulary passes on one in-order queue, bf16).
    ("vocab-parallel v-half vs 1f1b pp2", 2, "", "v-half", 2e-3, "--pipeline-vocab-parallel"),
)
LOSS_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.Ee+-]+)")


class UsageError(Exception):
    """Bad command line: one line naming the flag and the fix."""


@dataclass
class Step:
    name: str
    kind: str  # verify | bench | pretrain | losses | overlap
    argv: list[str]
    timeout: float
    env: dict[str, str] = field(default_factory=dict)
    group: str = "single"  # single | multi: which budget it draws on
    json_path: Path | None = None  # where the step writes its JSON (bench)

    def command_line(self) -> str:
        prefix = [f"{k}={v}" for k, v in sorted(self.env.items())]
        return " ".join(shlex.quote(a) for a in (["env", *prefix] if prefix else []) + self.argv)


@dataclass
class Row:
    name: str
    status: str  # PASS | FAIL | TIMEOUT | SKIP
    seconds: float
    detail: str


# --- arguments ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--gpus", type=int, default=None,
                        help="GPUs to use (default: all that nvidia-smi lists; 1 under --dry-run)")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for the single-GPU steps (default 480)")
    parser.add_argument("--multi-budget", type=float, default=1200.0,
                        help="seconds for the multi-GPU steps (default 1200)")
    parser.add_argument("--verify-timeout", type=float, default=90.0, help="seconds per verify step (default 90)")
    parser.add_argument("--bench-timeout", type=float, default=120.0, help="seconds for bench_wgrad (default 120)")
    parser.add_argument("--pretrain-timeout", type=float, default=240.0,
                        help="seconds for the pretraining step (default 240)")
    parser.add_argument("--loss-timeout", type=float, default=420.0,
                        help="seconds for each TE loss comparison (two training runs; default 420)")
    parser.add_argument("--overlap-timeout", type=float, default=600.0,
                        help="seconds for each MoE overlap step (two training runs; default 600)")
    parser.add_argument("--only", default=None, help="run only the steps whose name contains TEXT")
    parser.add_argument("--python", default=sys.executable, help="interpreter for every step (default: this one)")
    parser.add_argument("--log-dir", type=Path, default=Path("gpu_check_logs"), help="per-step output (default gpu_check_logs)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse already printed its one-line error
        raise UsageError("") from exit_
    _check(args)
    return args


def _check(args: argparse.Namespace) -> None:
    if args.gpus is not None and args.gpus < 1:
        raise UsageError(f"--gpus {args.gpus}: must be >= 1 (it counts GPUs to use); drop it to use all visible")
    for flag in ("budget", "multi_budget", "verify_timeout", "bench_timeout", "pretrain_timeout", "loss_timeout",
                 "overlap_timeout"):
        if not getattr(args, flag) > 0:
            raise UsageError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be a positive number of seconds")


def visible_gpus() -> int:
    """GPUs nvidia-smi lists (restricted by CUDA_VISIBLE_DEVICES when set); 0 without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    count = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([d for d in visible.split(",") if d.strip()]))
    return count


def gpu_name() -> str:
    if shutil.which("nvidia-smi") is None:
        return ""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.splitlines()[0].strip() if out.strip() else ""


def resolve_gpus(args: argparse.Namespace) -> int:
    if args.gpus is not None:
        if not args.dry_run and args.gpus > (have := visible_gpus()) and shutil.which("nvidia-smi"):
            raise UsageError(f"--gpus {args.gpus}: only {have} GPU(s) visible; lower --gpus")
        return args.gpus
    if args.dry_run:
        return 1
    have = visible_gpus()
    if have == 0:
        raise UsageError("no GPU visible (nvidia-smi lists none); run on a GPU machine, or use --dry-run")
    return have


# --- the steps ---------------------------------------------------------------------------------


def verify_step(python: str, schedule: str, pp: int, spec: str, timeout: float, group: str) -> Step:
    argv = [python, "-m", "megatron_vshape.verify", "--schedule", schedule, "--pp", str(pp), "--device", "cuda",
            "--dtype", "bf16", "--spec", spec, "--microbatches", "8" if pp > 1 else "4", "--json",
            "--timeout", str(int(timeout))]
    # Megatron's setting on every real run (required with TP > 1): one in-order hardware queue per GPU,
    # under which a badly ordered NCCL exchange deadlocks.
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return Step(f"verify {schedule} pp{pp} {spec} bf16", "verify", argv, timeout, env, group)


def loss_step(python: str, run: tuple, timeout: float) -> Step:
    """One TE run (``run`` from TE_LOSS_RUNS) against Megatron's 1F1B on the same flags and GPUs (a sixth
    field: flags of the compared run only)."""
    name, gpus, extra, schedule, rtol, *compared_only = run
    def launch(sched: str, port: int, *more: str) -> list[str]:
        return [python, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus), "--master-port", str(port),
                str(ROOT / "scripts" / "pretrain_gpt.py"), *LOSS_MODEL.split(), *extra.split(), "--pipeline-schedule", sched,
                *more]

    argv = [python, str(ROOT / "scripts" / "gpu_check.py"), "--compare-losses", "--rtol", str(rtol), "--",
            *launch("1f1b", 29521), "--versus", *launch(schedule, 29523, *" ".join(compared_only).split())]
    return Step(f"losses {name}", "losses", argv, timeout, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, "multi")


# HybridModel with Mamba-2 layers: in the split spec Mamba's in/out projections are megatron linears, so B
# defers their weight gradients to W; V-ZB at PP=1 against one process (megatron_vshape.testing.tiny_hybrid).
MAMBA_PATTERN = "M*M-M*M-"


def hybrid_step(python: str, timeout: float) -> Step:
    argv = [python, "-m", "megatron_vshape.testing.tiny_hybrid", "--pattern", MAMBA_PATTERN, "--schedule", "v-zb",
            "--pp", "1", "--device", "cuda", "--spec", "split", "--hidden-size", "128", "--grad-tol", "1e-4",
            "--timeout", str(int(timeout))]
    return Step(f"hybrid {MAMBA_PATTERN} v-zb one GPU split", "verify", argv, timeout,
                {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, "single")


def build_steps(args: argparse.Namespace, gpus: int) -> list[Step]:
    py = args.python
    steps = [verify_step(py, s, 1, spec, args.verify_timeout, "single")
             for spec in SPECS for s in SINGLE_GPU_SCHEDULES]
    steps.append(hybrid_step(py, args.verify_timeout))
    bench_json = args.log_dir / "bench_wgrad.json"
    steps.append(Step("bench_wgrad hidden 4096 bf16", "bench",
                      [py, str(ROOT / "scripts" / "bench_wgrad.py"), "--hidden", "4096", "--dtype", "bf16",
                       "--json", str(bench_json)], args.bench_timeout, json_path=bench_json))
    steps.append(Step("pretrain_gpt pp1 20 iterations", "pretrain",
                      [py, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", "29517",
                       str(ROOT / "scripts" / "pretrain_gpt.py"), *PRETRAIN_MODEL.split(), "--train-iters", "20"],
                      args.pretrain_timeout, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}))
    if gpus >= 2:
        sys.path.insert(0, str(ROOT))  # the schedule names (pure Python), also from a plain checkout
        from megatron_vshape.schedules.generators.registry import SCHEDULES

        for pp in (p for p in (2, 4) if p <= gpus):
            steps += [verify_step(py, name, pp, "te", args.verify_timeout, "multi") for name in SCHEDULES]
        steps += [loss_step(py, run, args.loss_timeout) for run in TE_LOSS_RUNS if run[1] <= gpus]
    if gpus >= gpu_check_overlap.GPUS:
        losses, trace = gpu_check_overlap.run_step_commands(args.log_dir.resolve() / "moe_overlap", py)
        # the losses with one hardware queue (a badly ordered exchange deadlocks there); the traces with Megatron's
        # advice for the flag (more queues, so the communication stream's kernels can run beside the compute's)
        steps += [Step("moe-overlap losses v-zb vs combined interleaved-1f1b pp2 ep2", "losses", losses,
                       args.overlap_timeout, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, "multi"),
                  Step("moe-overlap trace v-zb pp2 ep2 all-to-all under compute", "overlap", trace,
                       args.overlap_timeout, {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}, "multi")]
    if args.only is not None:
        steps = [s for s in steps if args.only in s.name]
        if not steps:
            raise UsageError(f"--only {args.only!r} matches no step; see the names under --dry-run")
    return steps


# --- running one step --------------------------------------------------------------------------


def run_step(step: Step, log_dir: Path, time_left: float) -> tuple[Row, str]:
    """Run ``step`` in its own process group for at most min(its timeout, time_left) seconds."""
    if time_left < min(step.timeout, MIN_STEP_SECONDS):
        return Row(step.name, "SKIP", 0.0, "time budget used up (raise --budget/--multi-budget)"), ""
    timeout = min(step.timeout, time_left)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / (re.sub(r"[^A-Za-z0-9]+", "_", step.name).strip("_") + ".log")
    env = dict(os.environ, **step.env, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    start = time.monotonic()
    with open(log, "w") as out:
        out.write(f"$ {step.command_line()}\n")
        out.flush()
        try:
            proc = subprocess.Popen(step.argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                    start_new_session=True)
        except OSError as err:
            return Row(step.name, "FAIL", 0.0, f"could not start: {err}"), ""
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return Row(step.name, "TIMEOUT", time.monotonic() - start, f"killed after {timeout:.0f} s; log {log}"), ""
    seconds = time.monotonic() - start
    text = log.read_text(errors="replace")
    status, detail = interpret(step, code, text)
    return Row(step.name, status, seconds, detail if status == "PASS" else f"{detail}; log {log}"), text


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the step's whole process group (torchrun and spawned ranks), SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# --- reading results ---------------------------------------------------------------------------


def interpret(step: Step, code: int, text: str) -> tuple[str, str]:
    reader = {"verify": _verify_result, "bench": _bench_result, "pretrain": _pretrain_result,
              "losses": _losses_result, "overlap": _overlap_result}[step.kind]
    try:
        detail = reader(step, text)
    except (ValueError, KeyError, OSError) as err:
        return "FAIL", f"exit {code}: {last_error_line(text) or err}"
    if code != 0:
        return "FAIL", f"exit {code}: {detail or last_error_line(text)}"
    return "PASS", detail


def last_error_line(text: str) -> str:
    """The most telling line of a failed step's output: its last error or exception line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.search(r"(Error|error:|Exception|FAIL|Timeout|timed out)", line) and not line.startswith("$ "):
            return line[:200]
    return lines[-1][:200] if lines else "no output"


def _last_json(text: str) -> dict:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON result line")


def _verify_result(step: Step, text: str) -> str:
    r = _last_json(text)
    detail = (f"grad rel err {r['max_grad_rel_err']:.2e} (<= {r['grad_tol']:g}), loss err {r['max_loss_abs_err']:.2e}, "
              f"W deferred/run {r.get('wgrad_deferred', 0)}/{r.get('wgrad_run', 0)}")
    problems = r.get("problems") or []
    return detail + ("" if not problems else " -- " + "; ".join(problems))


def _losses_result(step: Step, text: str) -> str:
    r = _last_json(text)
    return (f"{r['iterations']} iterations, max |loss - 1F1B's| / 1F1B's {r['max_rel_diff']:.2e} (<= {r['rtol']:g}); "
            f"last loss {r['last_loss']:.4f} vs {r['last_reference_loss']:.4f}")


def _overlap_result(step: Step, text: str) -> str:
    r = _last_json(text)
    return (f"all-to-all under compute: {r['flag_share_min']:.0%} of its time with the flag (least rank; >= "
            f"{r['min_share']:.0%}), {r['baseline_share_max']:.0%} without (most)")


def _bench_result(step: Step, text: str) -> str:
    r = json.loads(Path(step.json_path).read_text())
    return (f"(B+W)/fused {r['b_plus_w_over_fused']:.3f} (min {r['b_plus_w_over_fused_min']:.3f}); fused "
            f"{r['fused_ms']:.2f} ms, B {r['b_ms']:.2f}, W {r['w_ms']:.2f} on {r['device']}")


def _pretrain_result(step: Step, text: str, name: str | None = None) -> str:
    """MFU over the second half of the iterations (the first ones include warm-up)."""
    mfu = [float(m) for m in re.findall(r"MFU ([0-9.]+)%", text)]
    tflops = [float(m) for m in re.findall(r"throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+)", text)]
    if not mfu and not tflops:
        raise ValueError("no throughput line (Megatron's 'throughput per GPU' or [vshape] MFU)")
    times = [float(m) for m in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", text)]
    def steady(values: list[float]) -> list[float]:
        return values[len(values) // 2:]

    parts = []
    if mfu:
        parts.append(f"MFU {median(steady(mfu)):.1f}%")
    if tflops:
        t = median(steady(tflops))
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in (name if name is not None else gpu_name())), None)
        if not mfu and peak:
            parts.append(f"MFU {100 * t / peak:.1f}%")
        parts.append(f"{t:.0f} TFLOP/s/GPU")
    if times:
        parts.append(f"{median(steady(times)):.0f} ms/iteration")
    return ", ".join(parts) + f" (median of the last {len(steady(tflops or mfu))} iterations)"


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


# --- the table ---------------------------------------------------------------------------------


def table(rows: list[Row]) -> str:
    lines = ["| step | result | seconds | detail |", "|---|---|---|---|"]
    lines += [f"| {r.name} | {r.status} | {r.seconds:.0f} | {r.detail.replace('|', '/')} |" for r in rows]
    return "\n".join(lines)


def losses_of(text: str) -> dict[int, float]:
    """Megatron's ``lm loss`` per iteration from its log lines."""
    return {int(it): float(loss) for it, loss in LOSS_LINE.findall(text)}


def compare_losses(argv: list[str]) -> int:
    """``--compare-losses --rtol R -- REFERENCE... --versus RUN...``: run both, compare losses per iteration.

    Prints both runs' output, then one JSON line; exit 0 when every iteration of RUN is within R of the
    reference's loss (and both logged the same iterations), 1 otherwise.
    """
    if "--" not in argv or "--versus" not in argv or argv[:1] != ["--rtol"]:
        print("gpu_check: error: --compare-losses --rtol R -- REFERENCE... --versus RUN...", file=sys.stderr)
        return 2
    rtol = float(argv[1])
    commands = argv[argv.index("--") + 1:]
    split = commands.index("--versus")
    runs = []
    for command in (commands[:split], commands[split + 1:]):
        proc = subprocess.run(command, capture_output=True, text=True)
        print(proc.stdout + proc.stderr, flush=True)
        if proc.returncode != 0:
            print(f"gpu_check: error: exit {proc.returncode}: {shlex.join(command)}", file=sys.stderr)
            return 1
        runs.append(losses_of(proc.stdout + proc.stderr))
    reference, got = runs
    if not reference or sorted(reference) != sorted(got):
        print(f"gpu_check: error: iterations differ: 1F1B logged {sorted(reference)}, the run {sorted(got)}",
              file=sys.stderr)
        return 1
    diffs = {it: abs(got[it] - reference[it]) / max(abs(reference[it]), 1e-12) for it in reference}
    last = max(reference)
    result = {"iterations": len(reference), "max_rel_diff": max(diffs.values()), "rtol": rtol,
              "last_loss": got[last], "last_reference_loss": reference[last]}
    print(json.dumps(result), flush=True)
    return 0 if result["max_rel_diff"] <= rtol else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--compare-losses"]:
        return compare_losses(argv[1:])
    try:
        args = parse_args(argv)
        gpus = resolve_gpus(args)
        steps = build_steps(args, gpus)
    except UsageError as err:
        if str(err):
            print(f"gpu_check: error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(f"# gpu_check --dry-run: {len(steps)} steps for {gpus} GPU(s); nothing runs")
        for step in steps:
            print(f"# {step.name}  (timeout {step.timeout:.0f} s, {step.group}-GPU budget)")
            print(step.command_line())
        return 0
    budgets = {"single": args.budget, "multi": args.multi_budget}
    rows = []
    for step in steps:
        row, _ = run_step(step, args.log_dir, budgets[step.group])
        budgets[step.group] -= row.seconds
        rows.append(row)
        print(f"[gpu_check] {row.status:<7} {row.name} ({row.seconds:.0f} s)", file=sys.stderr, flush=True)
    header = f"GPU check on {gpus} x {gpu_name() or 'GPU'} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})"
    print(header)
    print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps({"header": header, "rows": [r.__dict__ for r in rows]}, indent=1) + "\n")
    return 0 if all(r.status == "PASS" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
