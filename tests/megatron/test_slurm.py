"""The Slurm scripts are up to date, their --dry-run prints torchrun lines, and Megatron's parser accepts every one."""

import json
import shlex
import subprocess
import sys

import pytest
from glue_support import ROOT, cpu_env

SLURM = ROOT / "scripts" / "slurm"
SCRIPTS = sorted(SLURM.glob("*.sbatch"))


def dry_run(script, **env):
    return subprocess.run(["bash", str(script), "--dry-run"], capture_output=True, text=True, timeout=30,
                          env=cpu_env(**env))


def command_lines(script):
    result = dry_run(script)
    assert result.returncode == 0, result.stderr
    return [shlex.split(line) for line in result.stdout.splitlines() if line.startswith(("env ", "torchrun "))]


def split_env(argv):
    """``env A=1 B=2 torchrun ...`` -> ({"A": "1", "B": "2"}, [torchrun, ...])."""
    env = {}
    if argv[0] == "env":
        argv = argv[1:]
        while "=" in argv[0]:
            key, value = argv.pop(0).split("=", 1)
            env[key] = value
    return env, argv


def test_generated_scripts_match_generator():
    result = subprocess.run([sys.executable, str(SLURM / "generate.py"), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_paper_run_family_has_a_script_per_schedule():
    names = {p.name for p in SCRIPTS}
    for family in ("pp_9.6b", "pp_21b", "pp_38.5b", "pp_98.5b", "hybrid_98.5b_seq1024", "hybrid_98.5b_seq3072",
                   "hybrid_98.5b_seq16384"):
        for schedule in ("1f1b", "1f1b-r", "v-min", "v-half", "v-zb"):
            assert f"{family}_{schedule}.sbatch" in names


def test_node_count_and_gpus_are_variables_and_checked():
    env, argv = split_env(command_lines(SLURM / "pp_9.6b_v-half.sbatch")[0])
    assert argv[0] == "torchrun" and env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert argv[argv.index("--nnodes") + 1] == "2"
    alt = dry_run(SLURM / "pp_9.6b_v-half.sbatch", NODES="4", GPUS_PER_NODE="4")
    assert "--nnodes 4 --nproc-per-node 4" in alt.stdout
    bad = dry_run(SLURM / "pp_9.6b_v-half.sbatch", NODES="3")
    assert bad.returncode == 2 and "needs 16 GPUs" in bad.stderr


def test_data_path_switches_from_mock_data():
    result = dry_run(SLURM / "pp_21b_1f1b.sbatch", DATA_PATH="/data/x_text_document", VOCAB_FILE="v.json",
                     MERGE_FILE="m.txt")
    assert "--data-path /data/x_text_document" in result.stdout and "--mock-data" not in result.stdout


@pytest.mark.timeout(300)
def test_every_command_line_parses_with_megatron_and_our_flags(mc19_python):
    items, where = [], []
    for script in SCRIPTS:
        lines = command_lines(script)
        assert lines, f"{script.name} printed no torchrun line"
        for line in lines:
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
    assert len(errors) == len(items) > 500
