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

This file holds the run grid, the flags of each run and the command; the memory verdicts are in
``slurm_memory.py``, the sbatch text in ``sbatch_template.py``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from megatron_vshape.megatron import checks

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # sibling modules: slurm_memory, sbatch_template
from sbatch_template import EMPTY, TEMPLATE  # noqa: E402
from slurm_memory import GPU, MemoryCache, MemoryFit  # noqa: E402
from slurm_memory import RESERVED_BYTES as RESERVED_BYTES  # noqa: E402 (re-exported: the tests use it)
from slurm_memory import memory_fit as memory_fit  # noqa: E402 (re-exported: the tests use it)

GPUS_PER_NODE = 8
CPUS_PER_GPU = 8  # dataloader workers + the rank's own threads; DGX A100 nodes have 128 cores
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


MEMORY_CACHE = MemoryCache(HERE / "memory_fit.json")


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
    """Every family x variant: each model's pure pipeline, then the hybrid grid at each sequence length."""
    return ([pure_pipeline_script(model, variant) for model in MODELS for variant in VARIANTS]
            + [hybrid_script(seq, variant) for seq in HYBRID_BATCH for variant in VARIANTS])


def pure_pipeline_script(model: Model, variant: Variant) -> Script:
    runs = tuple(pure_pipeline_runs(model, variant))
    counts = ", ".join(str(r.global_batch // r.micro_batch) for r in runs)
    return Script(f"pp_{model.name}", variant, f"vshape-{model.name}-{variant.name}",
                  f"{model.name} GPT, pure pipeline over {model.gpus} GPUs, {variant.name}, "
                  f"microbatch size {model.micro_batch}, {counts} microbatches", model.gpus, runs)


def hybrid_script(seq: int, variant: Variant) -> Script:
    return Script(f"hybrid_98.5b_seq{seq}", variant, f"vshape-hybrid-{seq}-{variant.name}",
                  f"98.5B GPT on 40 GPUs, DP x TP x PP grid search, sequence {seq}, global batch "
                  f"{HYBRID_BATCH[seq]}, {variant.name}", HYBRID_MODEL.gpus, tuple(hybrid_runs(seq, variant)))


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
