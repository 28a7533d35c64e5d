"""Helpers for the Megatron glue tests (imported by name: keep this module name unique in tests/)."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MC19 = Path("/opt/venv-mc19/bin/python")


def _has_megatron_training() -> bool:
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ModuleNotFoundError:
        return False


def mc19_python_or_none() -> str | None:
    """An interpreter with megatron.training (megatron-core 0.19.x): this one, $VSHAPE_MC19_PYTHON, or the venv."""
    if _has_megatron_training():
        return sys.executable
    candidate = os.environ.get("VSHAPE_MC19_PYTHON") or (str(DEFAULT_MC19) if DEFAULT_MC19.exists() else None)
    return candidate


def cpu_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", PYTHONUNBUFFERED="1",
               CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def run_group(cmd: list[str], timeout: float, env: dict[str, str] | None = None,
              cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; on timeout kill the whole group (torchrun and its ranks)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env or cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n{out[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


PORT_CLASH = ("Address already in use", "EADDRINUSE")  # as megatron_vshape.testing.spawn retries on


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
                 attempts: int = 3) -> subprocess.CompletedProcess:
    """The ranks ``torchrun`` would start, started directly: same environment, and like torchrun, the
    first rank that fails stops the others. Returns every rank's output, rank 0 first.

    torchrun's own process (an elastic agent that imports torch) costs about 3 s of CPU per launch
    here, a sixth of a tiny training run; the tests that launch many runs use this, and the
    commands the README and the patch README give keep ``torchrun`` (:func:`torchrun`).
    """
    return _on_free_ports(lambda port: _run_ranks(python, nproc, [*entry, *args], port, timeout, cwd), attempts)


def _on_free_ports(launch, attempts: int) -> subprocess.CompletedProcess:
    for attempt in range(attempts):
        result = launch(free_port())
        clash = result.returncode != 0 and any(text in result.stdout for text in PORT_CLASH)
        if not clash or attempt + 1 == attempts:
            return result
    raise AssertionError("unreachable")


def _rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    return cpu_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                   GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _run_ranks(python: str, nproc: int, argv: list[str], port: int, timeout: float,
               cwd: Path) -> subprocess.CompletedProcess:
    """One launch: wait for every rank; on the first failure or the timeout kill every rank's process group."""
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(nproc)]
    procs = [subprocess.Popen([python, *argv], cwd=cwd, env=_rank_env(rank, nproc, port), stdout=log,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for rank, log in enumerate(logs)]
    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(code is not None for code in codes) or any(codes) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    out = "".join(outputs)
    if not any(codes) and None in codes:
        pytest.fail(f"timed out after {timeout}s: {' '.join(argv)}\n{out[-4000:]}")
    returncode = next((code for code in codes if code), 0)  # the first failure, as torchrun reports it
    return subprocess.CompletedProcess([python, *argv], returncode, out, "")


# Megatron's iteration log line: "iteration 3/ 5 | ... | lm loss: 4.524867E+00 | ..."
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")

GRAD_NORM = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?grad norm: ([0-9.]+)")


def launch_each(python: str, nproc: int, launches: dict[str, tuple[list[str], list[str]]], timeout: float,
                via_torchrun: Collection[str] = ()) -> dict[str, str]:
    """Launch every ``name: (entry, args)`` in order (:func:`launch_ranks`; under ``torchrun`` the names in
    ``via_torchrun``); return each one's output (a failed launch fails the test)."""
    out = {}
    for name, (entry, args) in launches.items():
        launcher = torchrun if name in via_torchrun else launch_ranks
        result = launcher(python, nproc, entry, args, timeout=timeout)
        assert result.returncode == 0, f"{name}:\n{result.stdout[-5000:]}"
        out[name] = result.stdout
    return out


def run_ranks_by_hand(python: str, args: list[str], world: int, timeout: float) -> list[tuple[int, str]]:
    """Start ``world`` ranks of ``python args...`` without torchrun (which would kill the slower ranks
    as soon as one fails); return each rank's (exit code, output). Every process group is killed at the end."""
    port = free_port()
    procs = [subprocess.Popen([python, *args], cwd=ROOT,
                              env=_rank_env(r, world, port),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for r in range(world)]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [(p.returncode, out) for p, out in zip(procs, outputs)]
