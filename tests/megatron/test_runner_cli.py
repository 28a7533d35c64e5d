"""The runner's own command line: one-line errors, exit code 2, before any training starts."""

import subprocess
import sys

import pytest
from core_versions import require_interpreter
from glue_support import ROOT, cpu_env

pytestmark = pytest.mark.slow  # launches processes: not in the fast tier (-m "not slow")


def run(*args, python: str = sys.executable):
    return subprocess.run([python, *args], capture_output=True, text=True, timeout=120, cwd=ROOT, env=cpu_env())


def test_missing_script_is_one_line_and_exit_2():
    result = run("-m", "megatron_vshape.run", "no/such/pretrain_gpt.py")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "megatron-vshape error: usage: python -m megatron_vshape.run SCRIPT.py [script and megatron-vshape flags ...]; "
        "no such script: no/such/pretrain_gpt.py"]


def test_entry_points_name_the_megatron_core_they_need():
    """Without megatron.training (megatron-core < 0.19) both entry points say so in one line. (With it the
    import gate lets them through: every launch on 0.19.2 or main, and --help below.)"""
    python = require_interpreter("0.16")
    for args in (["scripts/pretrain_gpt.py", "--cpu"], ["-m", "megatron_vshape.run", "scripts/pretrain_gpt.py"]):
        result = run(*args, python=python)
        errors = [ln for ln in result.stderr.splitlines() if ln.startswith("megatron-vshape error:")]
        assert result.returncode == 2 and len(errors) == 1 and "megatron-core >= 0.19" in errors[0]


def test_help_lists_our_flags_and_which_schedules_keep_megatrons_functions(mc19_python):
    result = subprocess.run([mc19_python, "scripts/pretrain_gpt.py", "--help"], capture_output=True, text=True,
                            timeout=120, cwd=ROOT, env=cpu_env())
    assert result.returncode == 0, result.stderr[-3000:]  # megatron 0.19.2's own --help crashes on a stray %
    text = " ".join(result.stdout.split())
    for flag in ("--pipeline-schedule NAME", "--pipeline-memory-limit FRACTION", "--cpu",
                 "--schedule-invariant-dropout", "--no-schedule-invariant-init"):
        assert flag in text
    assert "1f1b (one-forward-one-backward (Megatron's default); runs on Megatron's own function)" in text
    assert "v-half (V placement, about 1/2 of 1F1B's activation memory; runs on megatron-vshape executor)" in text



DATA_LOADER_IN_A_CYCLE = """
import sys, time
import torch.utils.data._utils as loader_utils
loader_utils.MP_STATUS_CHECK_INTERVAL = 15.0  # torch's join timeout per worker (5 s); long, so a miss cannot hide
from torch.utils.data import DataLoader
from megatron_vshape.run import shutdown_distributed

class Holder:  # Megatron's iterators sit in reference cycles like this one
    pass

def start():
    holder = Holder()
    holder.me = holder
    holder.batches = iter(DataLoader(list(range(64)), batch_size=2, num_workers=2, persistent_workers=True))
    next(holder.batches)
    return holder.batches._workers

workers = start()
began = time.monotonic()
shutdown_distributed()
print(f"{time.monotonic() - began:.2f}", [w.exitcode for w in workers])
"""


def test_the_end_of_a_run_stops_data_loader_workers_in_reference_cycles_at_once():
    """A run ends without waiting out torch's join timeout for each DataLoader worker (it waited 5 s per
    worker, 20 to 30 s per run with Megatron's three loaders: collected in a cycle, an iterator's queues
    were finalized before its stop signal went through them)."""
    result = subprocess.run([sys.executable, "-c", DATA_LOADER_IN_A_CYCLE], capture_output=True, text=True,
                            timeout=25, cwd=ROOT, env=cpu_env())
    assert result.returncode == 0, result.stderr[-3000:]
    seconds, exitcodes = result.stdout.split(" ", 1)
    assert exitcodes.strip() == "[0, 0]" and float(seconds) < 10, result.stdout
    assert "Warning" not in result.stderr, result.stderr  # the search for iterators must not touch deprecated objects
