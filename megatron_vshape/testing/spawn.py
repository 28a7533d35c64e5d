"""Run a function on N fresh processes with a process group; a failure, death or hang fails the call."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback


class SpawnError(RuntimeError):
    """A rank failed, died or timed out (the message carries its traceback)."""


def free_port() -> int:
    """A TCP port free at this moment (another process may take it before it is bound: see PORT_CLASH)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# What every rank of these harnesses imports. On gloo the ranks are forked from one fork server per
# calling process that has imported these once, so a rank costs a fork instead of about 7 s of CPU
# re-importing torch and megatron-core (most of the multi-process tests' time on a 2-core machine).
# TORCH_AND_MEGATRON is also what the tests' forked training launches preload (testing/fork_ranks.py).
TORCH_AND_MEGATRON = ("torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt",
                      "megatron.core.distributed", "megatron.core.optimizer", "megatron.core.pipeline_parallel")
PRELOAD = (*TORCH_AND_MEGATRON, "megatron_vshape.runtime.executor", "megatron_vshape.testing.tiny_gpt")
# This process's sys.path, for the fork server while it starts (testing/forkserver_path.py says why).
FORKSERVER_SYS_PATH = "VSHAPE_FORKSERVER_SYS_PATH"


def _context(backend: str):
    """gloo: the preloading fork server; nccl: fresh interpreters (CUDA must not be inherited)."""
    import multiprocessing as mp

    if backend == "nccl":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # read when the server starts (first call), ignored after; forkserver_path first: the caller's sys.path
    ctx.set_forkserver_preload(["megatron_vshape.testing.forkserver_path", *PRELOAD])
    return ctx


def _rank_entry(fn, rank, world_size, port, args, queue, backend="gloo", environ=None):
    if environ is not None:  # the fork server's environment is the one of the first call: use the caller's
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    if backend == "nccl":
        # Megatron's setting (and the one that makes NCCL p2p ordering matter); set before CUDA starts.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    try:
        import torch

        torch.set_num_threads(1)
        if backend == "nccl":
            # One GPU per rank, as torchrun + megatron.training set it; no device_id, as megatron.training
            # initialises, so NCCL creates its pair communicators lazily, as in a real run.
            torch.cuda.set_device(rank % torch.cuda.device_count())
        torch.distributed.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: B036 - report anything to the parent, then exit
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import torch

            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        except Exception:
            pass


# What a launch whose rendezvous port was taken in the meantime prints: retried on a new port. The last: a
# rank whose gloo mesh met another launch's process on a port it had just been told was free (seen once on
# a loaded machine, at process-group start, before the test ran anything); a rank that really crashed
# fails every attempt the same way.
PORT_CLASH = ("Address already in use", "EADDRINUSE", "Gloo connectFullMesh failed")


def spawn(fn, world_size: int, args: tuple = (), timeout: float = 300.0, attempts: int = 3,
          backend: str = "gloo") -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes with ``backend`` initialised
    (``nccl``: rank r on GPU r).

    Returns the per-rank results. Raises :class:`SpawnError` if any rank raises, dies, or the whole
    group exceeds ``timeout`` seconds; every spawned process is killed before returning or raising,
    so a deadlock fails instead of hanging. A rendezvous port taken by another process between
    picking and binding it (parallel test runs) is retried on a new port.
    """
    for attempt in range(attempts):
        try:
            return _spawn_once(fn, world_size, args, timeout, backend)
        except SpawnError as err:
            if attempt + 1 == attempts or not any(text in str(err) for text in PORT_CLASH):
                raise
    raise AssertionError("unreachable")


def _spawn_once(fn, world_size: int, args: tuple, timeout: float, backend: str = "gloo") -> list:
    ctx = _context(backend)
    queue = ctx.Queue()
    port = free_port()
    saved_env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "TORCHDYNAMO_DISABLE", FORKSERVER_SYS_PATH)}
    os.environ.update(OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")  # children (and the fork server) inherit
    os.environ[FORKSERVER_SYS_PATH] = json.dumps(sys.path)  # the server imports megatron from where we do
    environ = {k: v for k, v in os.environ.items() if k != FORKSERVER_SYS_PATH}  # the ranks' own environment
    procs = [ctx.Process(target=_rank_entry, args=(fn, r, world_size, port, args, queue, backend, environ),
                         daemon=True) for r in range(world_size)]
    try:
        for proc in procs:
            proc.start()
        return _collect(procs, queue, world_size, timeout)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            if proc.pid is not None:
                proc.join(timeout=10)
        queue.close()
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _collect(procs, queue, world_size: int, timeout: float) -> list:
    import queue as queue_mod

    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    while len(results) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise SpawnError(f"timed out after {timeout:.0f}s; ranks done: {sorted(results)}")
        try:
            rank, status, payload = queue.get(timeout=min(remaining, 1.0))
        except queue_mod.Empty:
            dead = [i for i, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)
                    and i not in results]
            if dead:
                raise SpawnError(f"rank(s) {dead} died (exit codes {[procs[i].exitcode for i in dead]})") from None
            continue
        if status == "error":
            raise SpawnError(f"rank {rank} failed:\n{payload}")
        results[rank] = payload
    return [results[r] for r in range(world_size)]
