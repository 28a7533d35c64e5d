"""The Slurm scripts are up to date, their --dry-run prints torchrun lines, Megatron's parser accepts every
one, none uses unfused attention at long sequences, and every run fits the planner's memory model."""

import importlib.util
import json
import re
import shlex
import subprocess
import sys

import pytest
from glue_support import ROOT, cpu_env

SLURM = ROOT / "scripts" / "slurm"
SCRIPTS = sorted(SLURM.glob("*.sbatch"))
NO_FIT_EXIT = 3  # a script none of whose grid points fits exits with this code


def _generator():
    spec = importlib.util.spec_from_file_location("slurm_generate", SLURM / "generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


GEN = _generator()


def dry_run(script, **env):
    return subprocess.run(["bash", str(script), "--dry-run"], capture_output=True, text=True, timeout=30,
                          env=cpu_env(**env))


def command_lines(script):
    """The torchrun lines of ``script`` ([] for a script whose every grid point is out of memory)."""
    result = dry_run(script)
    if result.returncode == NO_FIT_EXIT:
        assert "no grid point of this script fits" in result.stderr
        assert re.search(r"\): 0 of \d+ grid points fit", script.read_text()), script.name
        return []
    assert result.returncode == 0, result.stderr
    return [shlex.split(line) for line in result.stdout.splitlines() if line.startswith(("env ", "torchrun "))]


def flag(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


def all_command_lines():
    return [(script, line) for script in SCRIPTS for line in command_lines(script)]


def split_env(argv):
    """``env A=1 B=2 torchrun ...`` -> ({"A": "1", "B": "2"}, [torchrun, ...])."""
    env = {}
    if argv[0] == "env":
        argv = argv[1:]
        while "=" in argv[0]:
            key, value = argv.pop(0).split("=", 1)
            env[key] = value
    return env, argv


@pytest.mark.slow
def test_generated_scripts_match_generator():
    result = subprocess.run([sys.executable, str(SLURM / "generate.py"), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_paper_run_family_has_a_script_per_schedule():
    names = {p.name for p in SCRIPTS}
    for family in ("pp_9.6b", "pp_21b", "pp_38.5b", "pp_98.5b", "hybrid_98.5b_seq1024", "hybrid_98.5b_seq3072",
                   "hybrid_98.5b_seq16384"):
        for schedule in ("1f1b", "1f1b-r", "v-min", "v-half", "v-zb"):
            assert f"{family}_{schedule}.sbatch" in names


@pytest.mark.slow
def test_node_count_and_gpus_are_variables_and_checked():
    env, argv = split_env(command_lines(SLURM / "pp_9.6b_v-half.sbatch")[0])
    assert argv[0] == "torchrun" and env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert argv[argv.index("--nnodes") + 1] == "2"
    alt = dry_run(SLURM / "pp_9.6b_v-half.sbatch", NODES="4", GPUS_PER_NODE="4")
    assert "--nnodes 4 --nproc-per-node 4" in alt.stdout
    bad = dry_run(SLURM / "pp_9.6b_v-half.sbatch", NODES="3")
    assert bad.returncode == 2 and "needs 16 GPUs" in bad.stderr


@pytest.mark.slow
def test_data_path_switches_from_mock_data():
    result = dry_run(SLURM / "pp_21b_1f1b.sbatch", DATA_PATH="/data/x_text_document", VOCAB_FILE="v.json",
                     MERGE_FILE="m.txt")
    assert "--data-path /data/x_text_document" in result.stdout and "--mock-data" not in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_command_line_parses_with_megatron_and_our_flags(mc19_python):
    items, where = [], []
    for script in SCRIPTS:
        for line in command_lines(script):
            env, argv = split_env(line)
            entry = next(i for i, a in enumerate(argv) if a.endswith(".py"))
            world = int(argv[argv.index("--nnodes") + 1]) * int(argv[argv.index("--nproc-per-node") + 1])
            items.append({"argv": argv[entry + 1:], "world_size": world, "env": env})
            where.append(script.name)
    result = subprocess.run([mc19_python, str(ROOT / "tests" / "megatron" / "parse_command_lines.py")],
                            input=json.dumps(items), capture_output=True, text=True, timeout=280, env=cpu_env())
    assert result.returncode == 0, result.stderr[-3000:]
    errors = json.loads(result.stdout.splitlines()[-1])
    failed = [f"{name}: {err}" for name, err in zip(where, errors) if err]
    assert not failed, "\n".join(failed[:20])
    assert len(errors) == len(items) > 200


@pytest.mark.slow
def test_no_unfused_attention_at_long_sequences():
    """The local spec's attention is unfused (s x s scores per layer): never for sequence >= 3072."""
    lines = all_command_lines()
    long = [(script, argv) for script, argv in lines if int(flag(argv, "--seq-length")) >= 3072]
    assert len(long) > 20
    for script, argv in lines:
        if int(flag(argv, "--seq-length")) < 3072:
            continue
        impl = flag(argv, "--transformer-impl")
        assert impl == "transformer_engine", f"{script.name}: --transformer-impl {impl}"
        assert flag(argv, "--attention-backend") in ("flash", "fused"), f"{script.name}: {flag(argv, '--attention-backend')}"


@pytest.mark.slow
def test_every_run_fits_the_planner_memory_model():
    """Each printed run is a grid point the planner says fits; every other grid point is listed as dropped."""
    by_name = {s.filename: s for s in GEN.all_scripts()}
    capacity = GEN.GPU.memory_bytes - GEN.RESERVED_BYTES
    for script in SCRIPTS:
        generated = by_name[script.name]
        lines = command_lines(script)
        assert len(lines) == len(generated.kept)
        for argv, run in zip(lines, generated.kept):
            assert run.memory.peak <= capacity, f"{script.name} {run.layout_text}"
            assert (int(flag(argv, "--tensor-model-parallel-size")), int(flag(argv, "--pipeline-model-parallel-size")),
                    int(flag(argv, "--micro-batch-size"))) == (run.tp, run.pp, run.micro_batch)
        text = script.read_text()
        for run in generated.dropped:
            assert run.memory.peak > capacity
            assert f"#   dropped {run.layout_text}: " in text
    # The long-sequence grid really lost points: 98.5B at TP 1 cannot hold weights + optimizer state.
    assert not any(run.tp == 1 and run.pp <= 8 for s in by_name.values() if "hybrid" in s.filename for run in s.kept)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_memory_cache_matches_the_live_planner_near_the_limit():
    """memory_fit.json (read by --check) agrees with the planner where a verdict could flip: the kept runs
    with the least headroom and the dropped runs with the least excess (cheapest of each first)."""
    capacity = GEN.GPU.memory_bytes - GEN.RESERVED_BYTES
    runs = [run for script in GEN.all_scripts() for run in script.runs if run.pp <= 10]
    kept = sorted((r for r in runs if r.memory.fits), key=lambda r: capacity - r.memory.peak)[:2]
    dropped = sorted((r for r in runs if not r.memory.fits), key=lambda r: r.memory.peak - capacity)[:2]
    for run in kept + dropped:
        live = GEN.memory_fit(run)
        assert live.fits == run.memory.fits, run.key
        assert live.peak == pytest.approx(run.memory.peak, rel=1e-9), run.key


def test_every_step_gets_cpus():
    """Without --cpus-per-task a node's 8 ranks and their data loaders can share one core."""
    for script in SCRIPTS:
        text = script.read_text()
        assert re.search(r"^#SBATCH --cpus-per-task=\d+$", text, re.M), script.name
        assert 'srun --nodes "$NODES" --ntasks-per-node 1 --cpus-per-task "$CPUS_PER_TASK"' in text, script.name
