#!/usr/bin/env python
"""The GPU check of issue 43's overlapped F&B pairs (``--overlap-moe-expert-parallel-comm`` under V-ZB): does the
expert all-to-all really run under compute, and does the run give its reference's losses? Part of
``scripts/gpu_check.sh`` with 4 or more GPUs (PP 2 x DP 2, EP 2 inside DP: the CPU reference recipe's split,
docs/recipes.md), two steps:

* ``moe-overlap losses``: the CPU reference recipe on the GPUs, V-ZB with the flag against Megatron's own
  combined interleaved 1F1B with the flag (``--num-virtual-stages-per-pipeline-rank 2``), the losses compared
  iteration by iteration (``gpu_check.py --compare-losses``), bf16 without dropout;
* ``moe-overlap trace``: the same split on a bigger MoE, V-ZB with the flag and without it, each with
  Megatron's PyTorch profiler over a few iterations; in each rank's Chrome trace :func:`a2a_overlap` measures
  which share of the all-to-all kernels' time runs while a compute kernel runs on another stream. The step
  passes when, with the flag, that share is at least ``--min-share`` on every rank and above the share without
  the flag (where every all-to-all is waited for).

    python scripts/gpu_check_overlap.py trace --min-share 0.2 --out DIR -- FLAG_RUN... --baseline BASE_RUN...
    python scripts/gpu_check_overlap.py analyse TRACE.json[.gz]...   # the shares of traces made elsewhere

Each run writes its traces under its ``--tensorboard-dir``'s ``../torch_profile/rank-R.json.gz`` (Megatron's
handler); the command lines carry their own. Prints one JSON line; exit 0 on pass, 1 on fail, 2 on bad use.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The CPU reference recipe's model (docs/recipes.md, issue 43), bf16, no dropout: the losses of V-ZB with the
# flag must equal Megatron's combined interleaved 1F1B's up to the order the deferred W sums its bf16 gradients.
RECIPE = (
    "--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 16 --train-iters 3 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 128 --log-interval 1 --eval-interval 100 --eval-iters 0 --pipeline-model-parallel-size 2 "
    "--expert-model-parallel-size 2 --num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall --bf16 "
    "--overlap-moe-expert-parallel-comm --hidden-dropout 0.0 --attention-dropout 0.0"
)
LOSS_RTOL = 2e-3
# The traced runs: kernels long enough to be seen under each other (hidden 1024, 8 experts top-2, seq 2048).
TRACE_MODEL = (
    "--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 "
    "--micro-batch-size 1 --global-batch-size 16 --train-iters 6 --lr 1e-4 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 32000 --log-interval 1 --eval-interval 1000000 --eval-iters 0 --pipeline-model-parallel-size 2 "
    "--expert-model-parallel-size 2 --num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall --bf16 "
    "--profile --use-pytorch-profiler --profile-step-start 3 --profile-step-end 5"
)
FLAG = "--overlap-moe-expert-parallel-comm"
MIN_SHARE = 0.2  # with the flag, at least this share of the all-to-all time under compute on every rank
NCCL_A2A = ("sendrecv", "alltoall")  # NCCL's kernel for all_to_all_single (grouped send/recv), by name
GPUS = 4


@dataclass(frozen=True)
class Overlap:
    """The all-to-all kernels of one trace: the stream they run on, their time and the part under compute."""

    stream: int | None
    kernels: int
    a2a_us: float
    hidden_us: float

    @property
    def share(self) -> float:
        return self.hidden_us / self.a2a_us if self.a2a_us > 0 else 0.0


def _kernels(trace: dict) -> list[tuple[str, int, float, float]]:
    """(name, stream, start, end) of every GPU kernel of a PyTorch profiler Chrome trace (microseconds)."""
    out = []
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X" or str(event.get("cat", "")).lower() != "kernel":
            continue
        stream = event.get("args", {}).get("stream", event.get("tid"))
        out.append((event.get("name", ""), int(stream), float(event["ts"]), float(event["ts"]) + float(event["dur"])))
    return out


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def a2a_overlap(trace: dict) -> Overlap:
    """The share of the expert all-to-all's kernel time that runs while a compute kernel runs.

    NCCL kernels are the ones named ``nccl...``; each communicator has its stream, so the expert group's
    all-to-alls (dispatch and combine, per MoE layer, per F and B) are on the NCCL stream with the most
    send/receive or all-to-all kernels (the pipeline's messages, a few per microbatch, and the data-parallel
    reductions run on others). Compute is every non-NCCL kernel, on any stream."""
    kernels = _kernels(trace)
    comm = [k for k in kernels if "nccl" in k[0].lower()]
    counts: dict[int, int] = {}
    for name, stream, _, _ in comm:
        if any(word in name.lower() for word in NCCL_A2A):
            counts[stream] = counts.get(stream, 0) + 1
    if not counts:
        return Overlap(None, 0, 0.0, 0.0)
    stream = max(counts, key=lambda s: (counts[s], -s))
    a2a = [(start, end) for name, s, start, end in comm if s == stream and any(w in name.lower() for w in NCCL_A2A)]
    compute = _union([(start, end) for name, _, start, end in kernels if "nccl" not in name.lower()])
    hidden = sum(max(0.0, min(end, b) - max(start, a)) for start, end in a2a for a, b in compute)
    return Overlap(stream, len(a2a), sum(end - start for start, end in a2a), hidden)


def read_trace(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return json.load(handle)


def traces_of(command: list[str]) -> list[Path]:
    """The traces a run with ``--tensorboard-dir DIR`` leaves (Megatron's handler: DIR/../torch_profile)."""
    board = Path(command[command.index("--tensorboard-dir") + 1])
    return sorted((board.parent / "torch_profile").glob("rank-*.json*"))


def run_step_commands(out: Path, python: str = sys.executable) -> tuple[list[str], list[str]]:
    """The ``losses`` and ``trace`` steps' command lines (argv), for gpu_check.py's table."""
    def launch(schedule: str, port: int, model: str, *more: str) -> list[str]:
        return [python, "-m", "torch.distributed.run", "--nproc-per-node", str(GPUS), "--master-port", str(port),
                str(ROOT / "scripts" / "pretrain_gpt.py"), *model.split(), "--pipeline-schedule", schedule, *more]

    reference = launch("interleaved-1f1b", 29531, RECIPE, "--num-virtual-stages-per-pipeline-rank", "2")
    losses = [python, str(ROOT / "scripts" / "gpu_check.py"), "--compare-losses", "--rtol", str(LOSS_RTOL), "--",
              *reference, "--versus", *launch("v-zb", 29533, RECIPE)]
    flag_run = launch("v-zb", 29535, TRACE_MODEL, FLAG, "--tensorboard-dir", str(out / "flag" / "tb"))
    baseline = launch("v-zb", 29537, TRACE_MODEL, "--tensorboard-dir", str(out / "baseline" / "tb"))
    trace = [python, str(Path(__file__).resolve()), "trace", "--min-share", str(MIN_SHARE), "--", *flag_run,
             "--baseline", *baseline]
    return losses, trace


def trace_check(min_share: float, flag_run: list[str], baseline: list[str]) -> int:
    """Run both commands, read each rank's trace, print one JSON line; 0 when the flag's share passes."""
    found: dict[str, list[tuple[Path, Overlap]]] = {}
    for label, command in (("flag", flag_run), ("baseline", baseline)):
        for stale in traces_of(command):  # an earlier check's traces in the same place
            stale.unlink()
        proc = subprocess.run(command, capture_output=True, text=True)
        print(proc.stdout + proc.stderr, flush=True)
        if proc.returncode != 0:
            print(f"gpu_check_overlap: error: the {label} run exited {proc.returncode}", file=sys.stderr)
            return 1
        found[label] = [(path, a2a_overlap(read_trace(path))) for path in traces_of(command)]
        if not found[label]:
            print(f"gpu_check_overlap: error: the {label} run left no trace (its --tensorboard-dir's ../torch_profile)",
                  file=sys.stderr)
            return 1
    flag = min(overlap.share for _, overlap in found["flag"])
    base = max(overlap.share for _, overlap in found["baseline"])
    ok = flag >= min_share and flag > base
    ranks = {label: [asdict(overlap) | {"share": overlap.share, "trace": str(path)} for path, overlap in runs]
             for label, runs in found.items()}
    print(json.dumps({"flag_share_min": flag, "baseline_share_max": base, "min_share": min_share, "pass": ok,
                      "ranks": ranks}), flush=True)
    return 0 if ok else 1


class _OneLineParser(argparse.ArgumentParser):
    """Bad use: one line naming the flag and the fix, exit 2 (argparse prints its usage too)."""

    def error(self, message):
        self.exit(2, f"gpu_check_overlap: error: {message}\n")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = _OneLineParser(prog="gpu_check_overlap.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)
    trace = sub.add_parser("trace", help="run FLAG_RUN and BASELINE with the profiler and compare their shares")
    trace.add_argument("--min-share", type=float, default=MIN_SHARE)
    trace.add_argument("rest", nargs=argparse.REMAINDER, help="-- FLAG_RUN... --baseline BASELINE...")
    analyse = sub.add_parser("analyse", help="the all-to-all share under compute of existing traces")
    analyse.add_argument("traces", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if args.command == "trace":
        if not 0 <= args.min_share <= 1:
            parser.error(f"--min-share {args.min_share}: must be a share in [0, 1]")
        rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
        if "--baseline" not in rest or rest.index("--baseline") == 0 or rest[-1] == "--baseline":
            parser.error("trace: give -- FLAG_RUN... --baseline BASELINE... (both command lines)")
        for part in (rest[:rest.index("--baseline")], rest[rest.index("--baseline") + 1:]):
            if "--tensorboard-dir" not in part:
                parser.error("trace: each run needs --tensorboard-dir DIR (its traces go to DIR/../torch_profile)")
        args.flag_run, args.baseline = rest[:rest.index("--baseline")], rest[rest.index("--baseline") + 1:]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.command == "analyse":
        for path in args.traces:
            overlap = a2a_overlap(read_trace(path))
            print(json.dumps(asdict(overlap) | {"share": overlap.share, "trace": str(path)}))
        return 0
    return trace_check(args.min_share, args.flag_run, args.baseline)


if __name__ == "__main__":
    sys.exit(main())
