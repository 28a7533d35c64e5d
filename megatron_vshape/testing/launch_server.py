"""Serve many training launches from one interpreter that has imported torch and Megatron once.

    python -m megatron_vshape.testing.launch_server -- ENTRY   (started by :class:`LaunchServers`)

:mod:`megatron_vshape.testing.fork_ranks` forks the ranks of one launch from an interpreter that imported
torch, megatron-core and megatron.training first: about 8 s of CPU, paid again by every launch, while the
ranks of a tiny run need little more. A test process launches dozens of runs of the same script in the
same environment. This server pays the imports once per (interpreter, script directory, working
directory, environment) and then, for each launch, forks a leader that does exactly what
``fork_ranks`` does after its preload: fork the ranks, wait, report their exit codes.

The server itself never initialises anything (no process group, no threads of its own, no CUDA): between
launches it only blocks on its stdin, so every leader starts from what the preload left, as a fresh
``fork_ranks`` would. One launch at a time: a request is a JSON line on stdin; the server answers
``{"leader": pid}`` at once and ``{"done": exit code}`` when the leader has ended. The leader is a session
leader, so the client can kill the launch, ranks included, on a timeout. End of stdin stops the server
(its client closed it, or died).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from .fork_ranks import entry_script, launch, preload

CHECKOUT = Path(__file__).resolve().parents[2]  # the checkout this package runs from
RESULT = "launch.json"  # in the launch's log directory: the ranks' exit codes, as fork_ranks prints them
LEADER_LOG = "leader.log"  # the leader's own output (a launcher error would show here)


def cpu_env(**extra: str) -> dict[str, str]:
    """The environment of a CPU training launch: this process's, one thread per rank, no compilation, no
    GPU, unbuffered output, this checkout first on ``PYTHONPATH``; ``extra`` last (``PYTHONPATH`` included)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", PYTHONUNBUFFERED="1",
               CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CHECKOUT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def lead(request: dict, answers: int) -> None:
    """In the forked leader: run one launch as ``fork_ranks`` would after its preload; never returns."""
    code = 1
    try:
        os.setsid()  # the launch's own process group, ranks included: the client's kill reaches them all
        os.close(answers)  # the server's answer channel: only the server writes there
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        log = os.open(os.path.join(request["logs"], LEADER_LOG), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        codes = launch(request["nproc"], request["port"], request["logs"], request["stop_on_failure"],
                       request["entry"], preload_first=False)
        with open(os.path.join(request["logs"], RESULT), "w") as out:
            json.dump({"codes": codes}, out)
        code = 0
    except BaseException:  # noqa: B036 - the leader must always exit, and say why on its log
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(entry: list[str]) -> int:
    preload(entry)
    answers = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # nothing else (an import's print) may write into the answer channel

    def answer(message: dict) -> None:
        os.write(answers, (json.dumps(message) + "\n").encode())

    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            lead(request, answers)
        answer({"leader": pid})
        _, status = os.waitpid(pid, 0)
        answer({"done": os.waitstatus_to_exitcode(status)})
    return 0


class LaunchTimeout(Exception):
    """The launch ran past its timeout; it has been killed (ranks included)."""


@dataclass
class _Server:
    process: subprocess.Popen  # binary, unbuffered pipes: select() must see every byte not yet read
    errors: Path  # the server's stderr (an import error would show here)
    pending: bytes = b""

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        """Stop the server (if it still runs) and remove its stderr file."""
        if self.alive():
            self.process.stdin.close()  # the server ends at the end of its stdin
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.errors.unlink(missing_ok=True)

    def _answer(self, timeout: float | None) -> dict | None:
        """The server's next answer; None if none came within ``timeout`` seconds (None: no limit)."""
        fd = self.process.stdout.fileno()
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the launch server stopped:\n{self.errors.read_text(errors='replace')[-4000:]}")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, request: dict, timeout: float) -> list[int | None]:
        self.process.stdin.write((json.dumps(request) + "\n").encode())
        self.process.stdin.flush()
        leader = self._answer(None)["leader"]
        done = None
        try:
            done = self._answer(timeout)
            if done is None:
                raise LaunchTimeout(f"timed out after {timeout}s")
        finally:
            if done is None:  # timed out, or the test was interrupted: kill the launch and take its answer
                try:
                    os.killpg(leader, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self._answer(None)
        result = Path(request["logs"]) / RESULT
        if done["done"] != 0 or not result.exists():
            leader_log = (Path(request["logs"]) / LEADER_LOG).read_text(errors="replace")
            raise RuntimeError(f"the launch leader failed (exit {done['done']}):\n{leader_log[-4000:]}")
        return json.loads(result.read_text())["codes"]


class LaunchServers:
    """The launch servers of this process, one per (interpreter, script directory, working directory,
    environment), started on first use; at most ``keep`` stay alive (each holds torch and Megatron, about
    400 MB; the tests alternate between a few scripts: Megatron-LM's two, ours, a checkout of main)."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self._servers: OrderedDict[tuple, _Server] = OrderedDict()
        atexit.register(self.close)

    def launch(self, python: str, nproc: int, port: int, logs: str, stop_on_failure: bool, entry: list[str],
               cwd: Path, env: dict[str, str], timeout: float) -> list[int | None]:
        """Every rank's exit code (None: killed after another failed), as ``fork_ranks`` reports them;
        raises :class:`LaunchTimeout` after ``timeout`` seconds, the launch killed."""
        server = self._server(python, entry, cwd, env)
        request = dict(nproc=nproc, port=port, logs=logs, stop_on_failure=stop_on_failure, entry=entry,
                       cwd=str(cwd), env=env)
        return server.run(request, timeout)

    def _server(self, python: str, entry: list[str], cwd: Path, env: dict[str, str]) -> _Server:
        script = entry_script(entry)
        key = (python, os.path.dirname(os.path.realpath(script)) if script else None, str(cwd),
               tuple(sorted(env.items())))
        server = self._servers.get(key)
        if server is not None and server.alive():
            self._servers.move_to_end(key)
            return server
        if server is not None:  # it stopped (its error was reported): replaced below
            self._servers.pop(key).close()
        while len(self._servers) >= self.keep:
            self._servers.popitem(last=False)[1].close()
        errors = Path(tempfile.mkstemp(prefix="vshape-launch-server-", suffix=".log")[1])
        with open(errors, "w") as err:
            process = subprocess.Popen([python, "-m", "megatron_vshape.testing.launch_server", "--", *entry],
                                       cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                       bufsize=0)
        self._servers[key] = server = _Server(process, errors)
        return server

    def close(self) -> None:
        while self._servers:
            self._servers.popitem()[1].close()


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "--" or len(argv) < 2:
        print("usage: python -m megatron_vshape.testing.launch_server -- ENTRY [ARGS ...]", file=sys.stderr)
        return 2
    return serve(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
