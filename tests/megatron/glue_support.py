"""Helpers for the Megatron glue tests (imported by name: keep this module name unique in tests/)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sysconfig
import tempfile
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_vshape.testing.launch_server import LaunchServers, LaunchTimeout, cpu_env
from megatron_vshape.testing.spawn import PORT_CLASH, free_port

ROOT = Path(__file__).resolve().parents[2]


def _has_megatron_training() -> bool:
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ModuleNotFoundError:
        return False


def run_group(cmd: list[str], timeout: float, env: dict[str, str] | None = None, cwd: Path = ROOT,
              output_on_timeout: Callable[[], str] | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; on timeout kill the whole group (torchrun and its ranks) and
    fail the test with the end of its output (``output_on_timeout()`` when the output lives elsewhere)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env or cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        shown = output_on_timeout() if output_on_timeout is not None else out
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n{shown[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def torchrun(python: str, nproc: int, entry: list[str], args: list[str], timeout: float, cwd: Path = ROOT,
             attempts: int = 3) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run`` on a free port; a new port when another process took it first.

    The port is free when picked and bound by torchrun's store a moment later: on a shared machine
    another test can take it in between, which fails the launch with EADDRINUSE (not the test's fault).
    """
    def launch(port: int) -> subprocess.CompletedProcess:
        cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port),
               *entry, *args]
        return run_group(cmd, timeout=timeout, env=cpu_env(), cwd=cwd)

    return _on_free_ports(launch, attempts)


def launch_ranks(python: str, nproc: int, entry: list[str], args: list[str], timeout: float, cwd: Path = ROOT,
                 attempts: int = 3, preload: bool = True, env: dict[str, str] | None = None
                 ) -> subprocess.CompletedProcess:
    """The ranks ``torchrun`` would start, forked from one interpreter that imported torch and Megatron
    (:func:`_run_ranks`): same environment, and like torchrun, the first rank that fails stops the
    others. Returns every rank's output, rank 0 first.

    torchrun's own process (an elastic agent that imports torch) costs about 3 s of CPU per launch, and
    each fresh rank about 8 s of imports: most of a tiny training run on 2 cores. The tests that launch
    many runs use this; the commands the README and the patch README give keep ``torchrun`` (:func:`torchrun`).
    ``env``: the launch's environment (default :func:`cpu_env`).
    """
    def launch(port: int) -> subprocess.CompletedProcess:
        ranks = _run_ranks(python, nproc, [*entry, *args], port, timeout, cwd, stop_on_failure=True, preload=preload,
                           env=env)
        return subprocess.CompletedProcess([python, *entry, *args], ranks.returncode, ranks.stdout, "")

    return _on_free_ports(launch, attempts)


def run_ranks_by_hand(python: str, args: list[str], world: int, timeout: float,
                      attempts: int = 3, preload: bool = True) -> list[tuple[int, str]]:
    """Start ``world`` ranks of ``python args...`` and let each run to its end (torchrun would kill the
    slower ranks as soon as one fails); return each rank's (exit code, output)."""
    def launch(port: int) -> Ranks:
        return _run_ranks(python, world, args, port, timeout, ROOT, stop_on_failure=False, preload=preload)

    ranks = _on_free_ports(launch, attempts)
    return list(zip(ranks.codes, ranks.outputs))


def _on_free_ports(launch, attempts: int):
    """``launch(port)`` on a free port; again on a new one when another process took it first (the
    result has ``returncode`` and ``stdout``)."""
    for attempt in range(attempts):
        result = launch(free_port())
        clash = result.returncode != 0 and any(text in result.stdout for text in PORT_CLASH)
        if not clash or attempt + 1 == attempts:
            return result
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Ranks:
    """The ranks of one launch: exit codes (None: stopped after another rank failed) and outputs, in rank order."""

    codes: tuple[int | None, ...]
    outputs: tuple[str, ...]

    @property
    def returncode(self) -> int:
        return next((code for code in self.codes if code), 0)  # the failure, as torchrun reports it

    @property
    def stdout(self) -> str:
        return "".join(self.outputs)


# The launch servers of this test process (one per interpreter, script directory and environment).
LAUNCH_SERVERS = LaunchServers()


def _run_ranks(python: str, nproc: int, argv: list[str], port: int, timeout: float, cwd: Path,
               stop_on_failure: bool, preload: bool = True, env: dict[str, str] | None = None) -> Ranks:
    """One launch: every rank's (exit code, output), the ranks forked from an interpreter that imported
    torch and Megatron (:mod:`megatron_vshape.testing.fork_ranks`), kept between launches of the same
    script in the same environment (:mod:`megatron_vshape.testing.launch_server`). On the timeout the
    launch (ranks included) is killed and the test fails; with ``stop_on_failure`` the first failed rank
    stops the others. ``preload=False``: entries that import neither (the launcher's own tests), run by a
    fresh ``fork_ranks`` that imports nothing."""
    env = env or cpu_env()
    argv = loader_in_the_rank(argv)
    with tempfile.TemporaryDirectory() as logs:
        def outputs() -> tuple[str, ...]:
            return tuple(_read(Path(logs) / f"rank{rank}.log") for rank in range(nproc))

        if preload:
            try:
                codes = LAUNCH_SERVERS.launch(python, nproc, port, logs, stop_on_failure, argv, cwd, env, timeout)
            except LaunchTimeout as err:
                pytest.fail(f"{err}: {' '.join(argv)}\n{''.join(outputs())[-4000:]}")
            return Ranks(tuple(codes), outputs())
        cmd = [python, "-m", "megatron_vshape.testing.fork_ranks", "--nproc", str(nproc), "--port", str(port),
               "--logs", logs, *(["--stop-on-failure"] if stop_on_failure else []), "--no-preload", "--", *argv]
        result = run_group(cmd, timeout, env=env, cwd=cwd, output_on_timeout=lambda: "".join(outputs()))
        ranks_output = outputs()
    try:
        codes = json.loads(result.stdout.strip().splitlines()[-1])["codes"]
    except (IndexError, ValueError, KeyError):
        pytest.fail(f"the rank launcher failed (exit {result.returncode}): {' '.join(argv)}\n{result.stdout[-4000:]}")
    return Ranks(tuple(codes), ranks_output)


def loader_in_the_rank(argv: list[str]) -> list[str]:
    """A Megatron-LM training script's launch with ``--num-workers 0`` unless it names ``--num-workers``.

    Megatron's default of two DataLoader worker processes per loader forks 24 processes per 4-rank launch
    (train, validation and test loaders), about 9 % of a tiny run's CPU on these machines' two cores. The
    batches are the same in the same order either way (Megatron's samplers decide them, not the workers), so
    the losses the tests compare do not change. What a real run's workers add is tested where it matters:
    the runner's exit with live workers (tests/megatron/test_runner_cli.py), and README command 1, which CI
    runs with Megatron's default.
    """
    script = next((arg for arg in argv if arg.endswith(".py")), "")
    if not Path(script).name.startswith("pretrain_") or "--num-workers" in argv:
        return argv
    return [*argv, "--num-workers", "0"]


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


# Megatron's iteration log line: "iteration 3/ 5 | ... | lm loss: 4.524867E+00 | ..."
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")

GRAD_NORM = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?grad norm: ([0-9.]+)")


def launch_each(python: str, nproc: int, launches: dict[str, tuple[list[str], list[str]]], timeout: float,
                via_torchrun: Collection[str] = (), env: dict[str, str] | None = None) -> dict[str, str]:
    """Launch every ``name: (entry, args)`` in order (:func:`launch_ranks`, in ``env``; under ``torchrun``
    the names in ``via_torchrun``); return each one's output (a failed launch fails the test)."""
    out = {}
    for name, (entry, args) in launches.items():
        result = (torchrun(python, nproc, entry, args, timeout=timeout) if name in via_torchrun
                  else launch_ranks(python, nproc, entry, args, timeout=timeout, env=env))
        assert result.returncode == 0, f"{name}:\n{result.stdout[-5000:]}"
        out[name] = result.stdout
    return out


# --- Megatron-LM main (0.20.0 at d98e8a64) from a writable copy of its checkout (the megatron_main fixture) ---

# What a machine whose python3-config belongs to another Python says (the had a 3.12 one next to
# 3.11 ranks): Megatron's Makefile names the dataset helpers' library after it, and the ranks cannot import it.
WRONG_PYTHON_CONFIG = """#!/bin/sh
case "$1" in --extension-suffix) echo .cpython-312-x86_64-linux-gnu.so;; *) exit 1;; esac
"""


def env_with_another_pythons_config(bin_dir: Path) -> dict[str, str]:
    """:func:`cpu_env` with a python3-config of another Python first on PATH (written into ``bin_dir``): the
    dataset helpers must be built for the running interpreter all the same."""
    (bin_dir / "python3-config").write_text(WRONG_PYTHON_CONFIG)
    (bin_dir / "python3-config").chmod(0o755)
    return cpu_env(PATH=os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")]))


def assert_runs_the_checkouts_megatron(output: str, checkout: Path, version: str = "0.20.0") -> None:
    """Rank 0's start-up line names main's megatron from ``checkout`` and the unused installed 0.19.2, the
    tested commit is recognised (no warning), and the dataset helpers were built for this interpreter."""
    lines = [line for line in output.splitlines() if line.startswith(" [vshape] megatron ")]
    expected = f" [vshape] megatron {version} from {checkout.resolve()}/megatron; the installed megatron-core 0.19.2 at "
    assert len(lines) == 1 and lines[0].startswith(expected) and lines[0].endswith(" is not used"), lines
    assert "megatron-vshape warning" not in output, output[-3000:]
    helpers = checkout / "megatron" / "core" / "datasets" / f"helpers_cpp{sysconfig.get_config_var('EXT_SUFFIX')}"
    assert helpers.is_file() and not list(helpers.parent.glob("helpers_cpp.cpython-312*")), sorted(helpers.parent.iterdir())
