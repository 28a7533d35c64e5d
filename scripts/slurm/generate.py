#!/usr/bin/env python
"""Generate the Slurm batch scripts for the paper's runs (one file per run family and schedule).

    python scripts/slurm/generate.py            # (re)write scripts/slurm/*.sbatch
    python scripts/slurm/generate.py --check    # exit 1 if a committed script differs from the generator

Families (model shapes from the paper, A100 80 GB nodes with 8 GPUs by default):
  pure-pipeline: 9.6B/16 GPUs, 21B/24, 38.5B/32, 98.5B/40 with PP = #GPUs, microbatch counts d, 4d, 16d;
  hybrid:        98.5B on 40 GPUs, every DP x TP x PP grid point and microbatch size, at sequence
                 lengths 1024, 3072 and 16384.
Every script takes ``--dry-run`` (print the exact torchrun command lines, run nothing) and reads
NODES, GPUS_PER_NODE, MASTER_PORT, TRAIN_ITERS, DATA_PATH, VOCAB_FILE, MERGE_FILE, PRETRAIN, SRUN_ARGS,
EXTRA_ARGS from the environment; the partition is sbatch's (``sbatch -p NAME`` or SBATCH_PARTITION).
The embedding and the loss each count as one layer in the pipeline split
(``--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split``): that is how the
paper's layer counts (30, 46, 62, 78) fill 2 x #GPUs V stages evenly.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    heads: int
    hidden: int
    gpus: int  # the paper's GPU count for the pure pipeline runs
    micro_batch: int


MODELS = (
    Model("9.6b", 30, 40, 5120, 16, 4),
    Model("21b", 46, 48, 6144, 24, 2),
    Model("38.5b", 62, 64, 7168, 32, 1),
    Model("98.5b", 78, 80, 10240, 40, 1),
)
HYBRID_MODEL = MODELS[-1]
# Hybrid runs: global batch per sequence length, as in the paper's results table.
HYBRID_BATCH = {1024: 160, 3072: 640, 16384: 160}


@dataclass(frozen=True)
class Variant:
    """A schedule as run on the cluster: our flag plus any extra Megatron flags (e.g. recompute)."""

    name: str
    schedule: str
    extra: tuple[str, ...] = ()

    @property
    def is_v(self) -> bool:
        return self.schedule.startswith("v-")


VARIANTS = (
    Variant("1f1b", "1f1b"),
    Variant("1f1b-r", "1f1b", ("--recompute-granularity", "full", "--recompute-method", "uniform",
                               "--recompute-num-layers", "1")),
    Variant("interleaved-1f1b", "interleaved-1f1b", ("--num-virtual-stages-per-pipeline-rank", "2")),
    Variant("zb-h1", "zb-h1"),
    Variant("zb-1p", "zb-1p"),
    Variant("v-min", "v-min"),
    Variant("v-half", "v-half"),
    Variant("v-zb", "v-zb"),
)


@dataclass(frozen=True)
class Run:
    """One torchrun launch: the parallel layout and batch shape on top of a model and a variant."""

    model: Model
    variant: Variant
    seq: int
    tp: int
    pp: int
    micro_batch: int
    global_batch: int

    def args(self) -> list[str]:
        m = self.model
        out = [
            "--pipeline-schedule", self.variant.schedule,
            "--num-layers", str(m.layers), "--hidden-size", str(m.hidden), "--num-attention-heads", str(m.heads),
            "--seq-length", str(self.seq), "--max-position-embeddings", str(self.seq),
            "--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp),
            "--micro-batch-size", str(self.micro_batch), "--global-batch-size", str(self.global_batch),
            "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
            "--bf16", "--transformer-impl", "local", "--use-distributed-optimizer",
            "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style", "cosine", "--weight-decay", "0.1",
            "--clip-grad", "1.0", "--init-method-std", "0.006",
            "--log-interval", "1", "--eval-interval", "1000000", "--eval-iters", "0", "--log-throughput",
        ]
        if self.tp > 1:
            out.append("--sequence-parallel")
        return out + list(self.variant.extra)

    def fits(self) -> bool:
        """The layout divides the layers and the batch the way Megatron (and the schedule) require."""
        dp = self.model.gpus // (self.tp * self.pp)
        if self.global_batch % (self.micro_batch * dp):
            return False
        m = self.global_batch // (self.micro_batch * dp)
        stages = self.pp * (2 if self.variant.is_v or self.variant.name == "interleaved-1f1b" else 1)
        if (self.model.layers + 2) % stages:
            return False
        return self.variant.name != "interleaved-1f1b" or (m >= self.pp and m % self.pp == 0)


def pure_pipeline_runs(model: Model, variant: Variant) -> list[Run]:
    d = model.gpus
    return [Run(model, variant, 1024, 1, d, model.micro_batch, model.micro_batch * m) for m in (d, 4 * d, 16 * d)]


def hybrid_runs(seq: int, variant: Variant) -> list[Run]:
    model, gbs = HYBRID_MODEL, HYBRID_BATCH[seq]
    runs = []
    for tp in (1, 2, 4, 8):  # TP stays inside one 8-GPU node
        for pp in (4, 5, 8, 10, 20, 40):  # PP < 4 cannot hold 98.5B on 80 GB
            if model.gpus % (tp * pp):
                continue
            for mbs in (1, 2, 4):
                run = Run(model, variant, seq, tp, pp, mbs, gbs)
                if run.fits():
                    runs.append(run)
    return runs


@dataclass(frozen=True)
class Script:
    filename: str
    job_name: str
    description: str
    gpus: int
    runs: tuple[Run, ...]


def all_scripts() -> list[Script]:
    scripts = []
    for model in MODELS:
        for variant in VARIANTS:
            runs = tuple(pure_pipeline_runs(model, variant))
            scripts.append(Script(
                f"pp_{model.name}_{variant.name}.sbatch", f"vshape-{model.name}-{variant.name}",
                f"{model.name} GPT, pure pipeline over {model.gpus} GPUs, {variant.name}, "
                f"microbatch size {model.micro_batch}, {', '.join(str(r.global_batch // r.micro_batch) for r in runs)} "
                "microbatches", model.gpus, runs))
    for seq in HYBRID_BATCH:
        for variant in VARIANTS:
            runs = tuple(hybrid_runs(seq, variant))
            scripts.append(Script(
                f"hybrid_98.5b_seq{seq}_{variant.name}.sbatch", f"vshape-hybrid-{seq}-{variant.name}",
                f"98.5B GPT on 40 GPUs, DP x TP x PP grid search, sequence {seq}, global batch "
                f"{HYBRID_BATCH[seq]}, {variant.name}", HYBRID_MODEL.gpus, runs))
    return scripts


TEMPLATE = """#!/bin/bash
# {description}.
# Generated by scripts/slurm/generate.py: edit the generator, not this file.
#
# Usage (from the repository root, or set VSHAPE_ROOT):
#   sbatch -p PARTITION {path}            # NODES defaults to {nodes} nodes x 8 GPUs
#   bash {path} --dry-run                 # print the torchrun command lines, run nothing
# Environment: NODES, GPUS_PER_NODE (NODES x GPUS_PER_NODE must be {gpus}), MASTER_PORT, TRAIN_ITERS,
#   DATA_PATH (+ VOCAB_FILE, MERGE_FILE; default: --mock-data), PRETRAIN (entry script; default
#   scripts/pretrain_gpt.py), SRUN_ARGS (e.g. pyxis --container-image=...), EXTRA_ARGS, RUN_INDEX.
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

DRY_RUN=0
if [[ "${{1:-}}" == "--dry-run" ]]; then DRY_RUN=1; fi
NODES=${{NODES:-${{SLURM_JOB_NUM_NODES:-{nodes}}}}}
GPUS_PER_NODE=${{GPUS_PER_NODE:-8}}
if (( NODES * GPUS_PER_NODE != {gpus} )); then
  echo "error: NODES x GPUS_PER_NODE = $((NODES * GPUS_PER_NODE)), this run needs {gpus} GPUs; set NODES/GPUS_PER_NODE" >&2
  exit 2
fi
VSHAPE_ROOT=${{VSHAPE_ROOT:-${{SLURM_SUBMIT_DIR:-$(pwd)}}}}
PRETRAIN=${{PRETRAIN:-$VSHAPE_ROOT/scripts/pretrain_gpt.py}}
MASTER_PORT=${{MASTER_PORT:-29500}}
if [[ -n "${{SLURM_JOB_NODELIST:-}}" ]]; then
  MASTER_ADDR=${{MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}}
else
  MASTER_ADDR=${{MASTER_ADDR:-localhost}}
fi
TRAIN_ITERS=${{TRAIN_ITERS:-20}}
if [[ -n "${{DATA_PATH:-}}" ]]; then
  DATA_ARGS=(--data-path "$DATA_PATH" --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE")
else
  DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50257)
fi
read -r -a EXTRA <<< "${{EXTRA_ARGS:-}}"
read -r -a SRUN_EXTRA <<< "${{SRUN_ARGS:-}}"

RUNS=(
{runs}
)

launch() {{
  local index=$1; shift
  # One identical command per node; torchrun's c10d rendezvous assigns the node ranks.
  # CUDA_DEVICE_MAX_CONNECTIONS=1 keeps TP/SP communication ordered before compute (Megatron requires it).
  local cmd=(env CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nnodes "$NODES" --nproc-per-node "$GPUS_PER_NODE" --rdzv-backend c10d
             --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "{job_name}-$index"
             "$PRETRAIN" "$@" --train-iters "$TRAIN_ITERS" "${{DATA_ARGS[@]}}" ${{EXTRA[@]+"${{EXTRA[@]}}"}})
  if (( DRY_RUN )); then
    printf '%q ' "${{cmd[@]}}"; printf '\\n'
  else
    echo "=== run $index: ${{cmd[*]}}"
    srun --nodes "$NODES" --ntasks-per-node 1 ${{SRUN_EXTRA[@]+"${{SRUN_EXTRA[@]}}"}} "${{cmd[@]}}" || echo "=== run $index failed"
  fi
}}

for index in "${{!RUNS[@]}}"; do
  if [[ -n "${{RUN_INDEX:-}}" && "$RUN_INDEX" != "$index" ]]; then continue; fi
  read -r -a RUN_ARGS <<< "${{RUNS[$index]}}"
  launch "$index" "${{RUN_ARGS[@]}}"
done
"""


def render(script: Script) -> str:
    runs = "\n".join("  " + shlex.quote(" ".join(run.args())) for run in script.runs)
    return TEMPLATE.format(description=script.description, path=f"scripts/slurm/{script.filename}",
                           job_name=script.job_name, nodes=script.gpus // GPUS_PER_NODE, gpus=script.gpus,
                           runs=runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", type=Path, default=HERE)
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on any difference")
    opts = parser.parse_args(argv)
    stale = []
    for script in all_scripts():
        path, text = opts.out_dir / script.filename, render(script)
        if opts.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
            continue
        path.write_text(text)
        path.chmod(0o755)
    if stale:
        print(f"stale Slurm scripts (rerun scripts/slurm/generate.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
