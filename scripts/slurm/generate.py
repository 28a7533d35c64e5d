#!/usr/bin/env python
"""Generate a Slurm batch script for one of the paper's runs (a run family and a schedule), on demand.

    python scripts/slurm/generate.py --list                          # families and schedules
    python scripts/slurm/generate.py pp_9.6b v-half                  # print the script
    python scripts/slurm/generate.py pp_9.6b v-half -o run.sbatch    # write it (executable)
    python scripts/slurm/generate.py --all --out-dir DIR             # every family x schedule into DIR
    python scripts/slurm/generate.py --update                        # rewrite the committed examples
    python scripts/slurm/generate.py --check                         # exit 1 if an example is stale

Only the examples (``EXAMPLES``) are committed; every other script is generated when needed.

Families (model shapes from the paper, A100 80 GB nodes with 8 GPUs by default):
  pure-pipeline: 9.6B/16 GPUs, 21B/24, 38.5B/32, 98.5B/40 with PP = #GPUs, microbatch counts d, 4d, 16d;
  hybrid:        98.5B on 40 GPUs, every DP x TP x PP grid point and microbatch size, at sequence
                 lengths 1024, 3072 and 16384.
Every script takes ``--dry-run`` (print the exact torchrun command lines, run nothing) and reads
NODES, GPUS_PER_NODE, CPUS_PER_TASK, MASTER_PORT, TRAIN_ITERS, DATA_PATH, VOCAB_FILE, MERGE_FILE, PRETRAIN,
SRUN_ARGS, EXTRA_ARGS from the environment; the partition is sbatch's (``sbatch -p NAME`` or SBATCH_PARTITION).

Layer spec: Megatron's GPU spec, ``--transformer-impl transformer_engine`` with TE's fused (cuDNN) attention
(``--attention-backend fused``; ``--attention-backend flash`` needs the flash-attn package). The local spec's
attention is unfused: at sequence 16384 its s x s scores alone take tens of GB per layer and microbatch.
Split schedules get the split layer spec from the glue (megatron_vshape.megatron), not from these flags.

Memory: every grid point goes through the planner's memory model (megatron_vshape.planner: weights,
gradients and sharded optimizer state, plus the simulated activation peak of the schedule with flash
attention's activation sizes) for an A100 80 GB; a point whose predicted peak exceeds the usable memory
is dropped, and the script's header lists it with its predicted peak. A script none of whose points fit
keeps its name, lists them all and exits with an error.
The embedding and the loss each count as one layer in the pipeline split
(``--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split``): that is how the
paper's layer counts (30, 46, 62, 78) fill 2 x #GPUs V stages evenly.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from megatron_vshape.megatron import checks
from megatron_vshape.planner import CostModel, GPTModel, Layout, get_gpu, predict
from megatron_vshape.planner.memory import (
    RESERVED_BYTES,
    MemoryEstimate,
    activation_model,
    activation_peaks,
    static_bytes,
)
from megatron_vshape.planner.predict import chunk_costs, num_stages, split_name
from megatron_vshape.schedules import ScheduleError, get_schedule, simulate

HERE = Path(__file__).resolve().parent
GPUS_PER_NODE = 8
CPUS_PER_GPU = 8  # dataloader workers + the rank's own threads; DGX A100 nodes have 128 cores
GPU = get_gpu("a100")  # the paper's cluster: A100 SXM 80 GB
GIB = 1024**3
VOCAB = 50257  # GPT-2's, as the NullTokenizer mock data and the GPT2BPETokenizer data both use
# Megatron's GPU layer spec: TE layers with TE's fused (cuDNN) attention, which stores no s x s scores.
ATTENTION_BACKEND = "fused"
GPU_SPEC = ("--transformer-impl", "transformer_engine", "--attention-backend", ATTENTION_BACKEND)


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


# The argument module's checks that decide whether a grid point is a valid launch at all.
LAYOUT_CHECKS = (checks.check_world_size, checks.check_v_layers, checks.check_microbatches)


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
            "--bf16", *GPU_SPEC, "--use-distributed-optimizer",
            "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style", "cosine", "--weight-decay", "0.1",
            "--clip-grad", "1.0", "--init-method-std", "0.006",
            "--log-interval", "1", "--eval-interval", "1000000", "--eval-iters", "0", "--log-throughput",
        ]
        if self.tp > 1:
            out.append("--sequence-parallel")
        return out + list(self.variant.extra)

    @property
    def dp(self) -> int:
        return self.model.gpus // (self.tp * self.pp)

    @property
    def layout_text(self) -> str:
        return f"TP{self.tp} PP{self.pp} DP{self.dp} mbs{self.micro_batch} x{self.global_batch // (self.micro_batch * self.dp)}"

    @property
    def key(self) -> str:
        """Identity of the run for the memory cache."""
        return (f"{self.model.name} seq{self.seq} {self.variant.name} TP{self.tp} PP{self.pp} mbs{self.micro_batch} "
                f"gbs{self.global_batch}")

    @cached_property
    def memory(self) -> MemoryFit:
        return MEMORY_CACHE.get(self)

    def fits(self) -> bool:
        """The layout passes the training-flag checks every rank runs at start-up (world size, V layer
        split, the batch and the schedule's own microbatch rule from the registry). Megatron's own
        rules (e.g. layers per virtual stage) are checked by CI, which parses every line with its parser."""
        return not self.problems()

    def problems(self) -> list[str]:
        m = self.model
        args = argparse.Namespace(
            pipeline_schedule=self.variant.schedule, num_layers=m.layers, world_size=m.gpus,
            account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True,
            tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
            micro_batch_size=self.micro_batch, global_batch_size=self.global_batch)
        return checks.problems(args, LAYOUT_CHECKS)


@dataclass(frozen=True)
class MemoryFit:
    """The planner's per-GPU memory prediction for one run (worst GPU)."""

    peak: float  # bytes: static + activations on the worst GPU
    static: float  # weights, gradients, optimizer state on that GPU
    activation: float
    capacity: float  # usable bytes (HBM minus the planner's reserve)

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity

    def describe(self) -> str:
        return (f"predicted peak {self.peak / GIB:.1f} GiB (static {self.static / GIB:.1f} + activations "
                f"{self.activation / GIB:.1f}) of {self.capacity / GIB:.0f} GiB usable")


class MemoryCache:
    """Planner verdicts by run, kept in ``memory_fit.json`` next to the scripts.

    The planner simulates every schedule at up to 40 devices and 640 microbatches: all grid points
    take tens of minutes, so ``--check`` and the tests read the verdicts from this file, and the
    tests recompute the points nearest the memory limit with the live planner (a planner change that
    would flip a verdict fails them). Runs missing from the file are computed on the spot;
    ``--refresh-memory`` recomputes all.
    """

    def __init__(self, path: Path):
        self.path = path
        self.entries: dict[str, dict] = json.loads(path.read_text()) if path.exists() else {}
        self.refresh = False
        self.dirty = False

    def get(self, run: Run) -> MemoryFit:
        entry = None if self.refresh else self.entries.get(run.key)
        if entry is None:
            fit = memory_fit(run)
            self.entries[run.key] = {"peak": fit.peak, "static": fit.static, "activation": fit.activation}
            self.dirty = True
            return fit
        return MemoryFit(entry["peak"], entry["static"], entry["activation"], GPU.memory_bytes - RESERVED_BYTES)

    def save(self, keys: set[str]) -> None:
        """Write the entries of ``keys`` (runs that no longer exist are dropped from the file)."""
        kept = {key: self.entries[key] for key in sorted(keys)}
        self.path.write_text(json.dumps(kept, indent=1) + "\n")


MEMORY_CACHE = MemoryCache(HERE / "memory_fit.json")


def padded_vocab(tp: int) -> int:
    """Megatron pads the vocabulary to a multiple of 128 x TP (--make-vocab-size-divisible-by 128)."""
    multiple = 128 * tp
    return -(-VOCAB // multiple) * multiple


def planner_model(run: Run) -> GPTModel:
    m = run.model
    return GPTModel(m.name, m.layers, m.hidden, m.heads, run.seq, padded_vocab(run.tp))


def memory_fit(run: Run) -> MemoryFit:
    """Static + simulated activation peak of the worst GPU, from the planner (TE fused attention = flash sizes)."""
    model, layout = planner_model(run), Layout(run.dp, run.tp, run.pp, run.micro_batch, run.global_batch)
    cost_model = CostModel(GPU)  # distributed optimizer, as the scripts run
    try:
        estimate = predict(run.variant.name, layout, model, cost_model, flash_attention=True).memory
    except ScheduleError:
        # The planner extrapolates large microbatch counts from two smaller ones, which
        # interleaved-1f1b refuses unless they are multiples of PP: simulate the real size instead.
        estimate = _exact_memory(run.variant.name, layout, model, cost_model)
    worst = max(range(len(estimate.per_device)), key=lambda i: estimate.per_device[i])
    return MemoryFit(estimate.per_device[worst], estimate.static[worst], estimate.activation[worst],
                     GPU.memory_bytes - RESERVED_BYTES)


def _exact_memory(name: str, layout: Layout, model: GPTModel, cost_model: CostModel) -> MemoryEstimate:
    base, recompute = split_name(name)
    stages = num_stages(name, layout.pp)
    costs = chunk_costs(cost_model.pass_times(model, layout), model, stages, recompute, layout.pp)
    result = simulate(get_schedule(base, layout.pp, layout.num_microbatches, costs), costs)
    static = static_bytes(model, layout, result.schedule.placement.stages_per_device, stages,
                          cost_model.distributed_optimizer)
    acts = activation_model(model, layout, stages, flash_attention=True, recompute=recompute)
    return MemoryEstimate(static, activation_peaks(result, acts))


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
    family: str  # e.g. pp_9.6b, hybrid_98.5b_seq3072
    variant: Variant
    job_name: str
    description: str
    gpus: int
    runs: tuple[Run, ...]  # every grid point the layout rules allow, fitting or not

    @property
    def filename(self) -> str:
        return f"{self.family}_{self.variant.name}.sbatch"

    @property
    def kept(self) -> tuple[Run, ...]:
        return tuple(run for run in self.runs if run.memory.fits)

    @property
    def dropped(self) -> tuple[Run, ...]:
        return tuple(run for run in self.runs if not run.memory.fits)


def all_scripts() -> list[Script]:
    scripts = []
    for model in MODELS:
        for variant in VARIANTS:
            runs = tuple(pure_pipeline_runs(model, variant))
            scripts.append(Script(
                f"pp_{model.name}", variant, f"vshape-{model.name}-{variant.name}",
                f"{model.name} GPT, pure pipeline over {model.gpus} GPUs, {variant.name}, "
                f"microbatch size {model.micro_batch}, {', '.join(str(r.global_batch // r.micro_batch) for r in runs)} "
                "microbatches", model.gpus, runs))
    for seq in HYBRID_BATCH:
        for variant in VARIANTS:
            runs = tuple(hybrid_runs(seq, variant))
            scripts.append(Script(
                f"hybrid_98.5b_seq{seq}", variant, f"vshape-hybrid-{seq}-{variant.name}",
                f"98.5B GPT on 40 GPUs, DP x TP x PP grid search, sequence {seq}, global batch "
                f"{HYBRID_BATCH[seq]}, {variant.name}", HYBRID_MODEL.gpus, runs))
    return scripts


FAMILIES = tuple(dict.fromkeys(script.family for script in all_scripts()))
# The committed examples (docker/README.md uses the first); generate any other script on demand.
EXAMPLES = (("pp_9.6b", "v-half"), ("hybrid_98.5b_seq16384", "v-min"))


def find_script(family: str, schedule: str) -> Script:
    """The script of ``family`` and ``schedule``; ValueError naming the choices otherwise."""
    if family not in FAMILIES:
        raise ValueError(f"unknown run family {family!r}; choose one of: {', '.join(FAMILIES)}")
    names = [variant.name for variant in VARIANTS]
    if schedule not in names:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of: {', '.join(names)}")
    return next(s for s in all_scripts() if (s.family, s.variant.name) == (family, schedule))


TEMPLATE = """#!/bin/bash
# {description}.
# Generated by `python scripts/slurm/generate.py {family} {schedule}`: edit the generator, not this file.
#
# Usage (from the repository root, or set VSHAPE_ROOT):
#   sbatch -p PARTITION {path}            # NODES defaults to {nodes} nodes x 8 GPUs
#   bash {path} --dry-run                 # print the torchrun command lines, run nothing
# Environment: NODES, GPUS_PER_NODE (NODES x GPUS_PER_NODE must be {gpus}), MASTER_PORT, TRAIN_ITERS,
#   DATA_PATH (+ VOCAB_FILE, MERGE_FILE; default: --mock-data), PRETRAIN (entry script; default
#   scripts/pretrain_gpt.py), SRUN_ARGS (e.g. pyxis --container-image=...), EXTRA_ARGS, RUN_INDEX,
#   CPUS_PER_TASK (CPU cores for each node's torchrun and its 8 ranks; default {cpus}, as requested below).
# Layer spec: --transformer-impl transformer_engine --attention-backend {attention} (TE's fused attention;
#   the local spec's unfused attention stores s x s scores per layer and does not fit at long sequences).
#
# Memory ({gpu}, the planner's model in megatron_vshape/planner: weights, gradients and sharded optimizer
# state plus the schedule's simulated activation peak): {kept} of {total} grid points fit and are below.
{dropped}#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task={cpus}
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

DRY_RUN=0
if [[ "${{1:-}}" == "--dry-run" ]]; then DRY_RUN=1; fi
NODES=${{NODES:-${{SLURM_JOB_NUM_NODES:-{nodes}}}}}
GPUS_PER_NODE=${{GPUS_PER_NODE:-8}}
# srun does not inherit sbatch's --cpus-per-task on every Slurm version: pass it to the step explicitly,
# or each node's 8 ranks would share one core.
CPUS_PER_TASK=${{CPUS_PER_TASK:-${{SLURM_CPUS_PER_TASK:-{cpus}}}}}
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
{empty}
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
    srun --nodes "$NODES" --ntasks-per-node 1 --cpus-per-task "$CPUS_PER_TASK" ${{SRUN_EXTRA[@]+"${{SRUN_EXTRA[@]}}"}} "${{cmd[@]}}" || echo "=== run $index failed"
  fi
}}

for index in "${{!RUNS[@]}}"; do
  if [[ -n "${{RUN_INDEX:-}}" && "$RUN_INDEX" != "$index" ]]; then continue; fi
  read -r -a RUN_ARGS <<< "${{RUNS[$index]}}"
  launch "$index" "${{RUN_ARGS[@]}}"
done
"""


EMPTY = """if (( ${{#RUNS[@]}} == 0 )); then
  echo "error: no grid point of this script fits in {gpu} memory (planner's model; see the header)" >&2
  exit 3
fi
"""


def render(script: Script, path: str | None = None) -> str:
    """The sbatch text of ``script``; ``path`` is where its usage lines say it lies (default: its file name)."""
    runs = "\n".join(f"  # {run.layout_text}: {run.memory.describe()}\n  " + shlex.quote(" ".join(run.args()))
                      for run in script.kept)
    dropped = "".join(f"#   dropped {run.layout_text}: {run.memory.describe()}\n" for run in script.dropped)
    empty = "" if script.kept else EMPTY.format(gpu=GPU.name)
    return TEMPLATE.format(description=script.description, path=path or script.filename, family=script.family,
                           schedule=script.variant.name, job_name=script.job_name, nodes=script.gpus // GPUS_PER_NODE,
                           gpus=script.gpus, runs=runs, cpus=CPUS_PER_GPU * GPUS_PER_NODE, attention=ATTENTION_BACKEND,
                           gpu=GPU.name, kept=len(script.kept), total=len(script.runs), dropped=dropped,
                           empty=empty)


def write(script: Script, path: Path, shown_as: str | None = None) -> None:
    path.write_text(render(script, shown_as or str(path)))
    path.chmod(0o755)


def examples() -> list[tuple[Script, Path]]:
    return [(script, HERE / script.filename) for script in (find_script(*example) for example in EXAMPLES)]


def example_path(path: Path) -> str:
    return str(path.relative_to(HERE.parent.parent))


def check() -> list[str]:
    """Committed files that differ from what the generator makes now (examples, memory_fit.json)."""
    stale = [path.name for script, path in examples()
             if not path.exists() or path.read_text() != render(script, example_path(path))]
    keys = {run.key for script in all_scripts() for run in script.runs}
    if MEMORY_CACHE.dirty or set(MEMORY_CACHE.entries) != keys:
        stale.append(MEMORY_CACHE.path.name)
    return stale


def update() -> None:
    """Rewrite the committed examples and memory_fit.json (grid points missing from it are computed)."""
    scripts = all_scripts()
    for script, path in examples():
        write(script, path, example_path(path))
    for script in scripts:
        for run in script.runs:
            run.memory  # noqa: B018 -- fills the cache
    MEMORY_CACHE.save({run.key for script in scripts for run in script.runs})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.split("\n")[2:9]))
    parser.add_argument("family", nargs="?", help="run family, e.g. pp_9.6b or hybrid_98.5b_seq3072 (see --list)")
    parser.add_argument("schedule", nargs="?", help="schedule as run on the cluster, e.g. v-half or 1f1b-r")
    parser.add_argument("-o", "--output", type=Path, help="write the script here (executable) instead of printing it")
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--list", action="store_true", help="print the run families and schedules")
    modes.add_argument("--all", action="store_true", help="write every family x schedule into --out-dir")
    modes.add_argument("--update", action="store_true", help="rewrite the committed examples and memory_fit.json")
    modes.add_argument("--check", action="store_true", help="exit 1 if a committed example or memory_fit.json is stale")
    parser.add_argument("--out-dir", type=Path, help="with --all: the directory to write into")
    parser.add_argument("--refresh-memory", action="store_true",
                        help="recompute every grid point's memory with the planner (tens of minutes) instead of "
                             "reading memory_fit.json; with --update, saved there")
    opts = parser.parse_args(argv)
    one = opts.family is not None
    if one != (opts.schedule is not None) or one == (opts.list or opts.all or opts.update or opts.check):
        parser.error("give FAMILY SCHEDULE (e.g. pp_9.6b v-half), or one of --list, --all, --update, --check")
    if opts.output and not one:
        parser.error("-o/--output writes one script: give FAMILY SCHEDULE (or use --all --out-dir DIR)")
    if opts.all != (opts.out_dir is not None):
        parser.error("--all writes into --out-dir DIR; give both or neither")
    if opts.check and opts.refresh_memory:
        parser.error("--check compares with the committed memory_fit.json; drop --refresh-memory")
    MEMORY_CACHE.refresh = opts.refresh_memory
    if opts.list:
        print("families: " + " ".join(FAMILIES))
        print("schedules: " + " ".join(variant.name for variant in VARIANTS))
        return 0
    if opts.check:
        stale = check()
        if stale:
            print(f"stale (rerun python scripts/slurm/generate.py --update): {', '.join(stale)}", file=sys.stderr)
        return 1 if stale else 0
    if opts.update:
        update()
        return 0
    if opts.all:
        opts.out_dir.mkdir(parents=True, exist_ok=True)
        for script in all_scripts():
            write(script, opts.out_dir / script.filename)
        return 0
    try:
        script = find_script(opts.family, opts.schedule)
    except ValueError as err:
        parser.error(str(err))
    if opts.output:
        write(script, opts.output)
    else:
        sys.stdout.write(render(script))
    return 0


if __name__ == "__main__":
    sys.exit(main())
