"""A schedule watchdog: when a pipeline stops moving, say where, on every rank, and end the job.

A stuck pipeline (a schedule bug, a peer that died without closing its sockets, a NCCL hang) shows
nothing until NCCL's own watchdog fires minutes later, and that says nothing about the schedule.
The executor keeps a :class:`Progress` record up to date (cheap: a few attribute writes per pass);
while an executor call runs, one daemon thread looks at it every second (the thread starts with the call
and is joined when it returns, so none is left running when the interpreter exits: a daemon thread
inside a C++ store call at interpreter shutdown aborts the process, "terminate called without an active
exception"). When the record has not moved for
``timeout`` seconds it prints one line: the schedule, the step index and action it is stuck at, what
it waits for (the oldest posted p2p operation that has not completed: peer, direction, message) and
the last action it finished. It also raises a flag in the job's rendezvous store: every other rank's
watchdog sees it within a second and reports where *it* is, whether or not it is the one stuck (the
rank that sleeps in a pass and the ranks waiting for it all say so). Each then waits ``grace``
seconds, so the lines get out before torchrun tears the job down, and ends its process with exit code
:data:`EXIT_CODE`.

The thread never waits on communication work: it only reads the record and asks posted works
``is_completed()``, which is a query, on NCCL as on gloo.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

EXIT_CODE = 3
STORE_KEY = "vshape_watchdog_fired"


@dataclass
class Progress:
    """Where one executor call is (written by the executor's thread, read by the watchdog's)."""

    schedule: str
    rank: int  # global rank
    pp_rank: int
    phase: str = "start of the iteration"
    step: int | None = None
    action: str | None = None
    last_done: str | None = None
    since: float = field(default_factory=time.monotonic)
    pending: Callable[[], str | None] = lambda: None  # the oldest incomplete p2p operation, described

    def at(self, phase: str, step: int | None = None, action: str | None = None) -> None:
        self.phase, self.step, self.action = phase, step, action
        self.since = time.monotonic()

    def finished(self, action: str) -> None:
        self.last_done = action
        self.since = time.monotonic()

    def report(self, what: str) -> str:
        where = f"step {self.step} ({self.action})" if self.step is not None else "no step"
        waiting = self.pending() or "no p2p operation pending"
        return (f"[vshape watchdog] rank {self.rank} (pipeline rank {self.pp_rank}): schedule {self.schedule} "
                f"{what}, in {self.phase} at {where}; waiting for: {waiting}; "
                f"last finished: {self.last_done or 'nothing yet'}")


class ScheduleWatchdog:
    """One per executor; ``watch(progress)`` arms it for the duration of one call."""

    def __init__(self, timeout: float, grace: float = 3.0, abort: Callable[[int], None] = os._exit,
                 poll: float | None = None, out=None, store=None):
        if not timeout > 0:
            raise ValueError(f"--pipeline-watchdog must be > 0 seconds (0 turns it off); got {timeout}")
        self.timeout, self.grace, self._abort = timeout, grace, abort
        self._poll = poll if poll is not None else min(1.0, timeout / 10)
        self._out = out
        self._store = store  # None: the default process group's store, when there is one
        self._progress: Progress | None = None
        self._lock = threading.Lock()
        self.fired: str | None = None

    @contextmanager
    def watch(self, progress: Progress):
        """Watch ``progress`` while the block runs; the watching thread lives exactly as long."""
        stop = threading.Event()
        with self._lock:
            self._progress = progress
        thread = threading.Thread(target=self._loop, args=(stop,), name="vshape-watchdog", daemon=True)
        thread.start()
        try:
            yield progress
        finally:
            stop.set()
            with self._lock:
                self._progress = None
            if self.fired is None:  # a fired watchdog is ending the process; do not wait for its grace
                thread.join()

    def _loop(self, stop: threading.Event) -> None:
        while self.fired is None and not stop.wait(self._poll):
            with self._lock:
                progress = self._progress
                stalled = progress is not None and time.monotonic() - progress.since > self.timeout
                peer_fired = progress is not None and not stalled and self._peer_fired()
                if stalled or peer_fired:
                    self.fired = progress.report(
                        f"made no progress for {self.timeout:g}s" if stalled
                        else "stopped: another rank's watchdog fired")
            if self.fired is not None:
                if stalled:
                    self._raise_flag()
                print(self.fired, file=self._out or sys.stderr, flush=True)
                time.sleep(self.grace)
                self._abort(EXIT_CODE)

    def _job_store(self):
        if self._store is None:
            try:
                import torch.distributed as dist

                if dist.is_available() and dist.is_initialized():
                    self._store = dist.distributed_c10d._get_default_store()
            except Exception:  # no store: this rank still reports, the others rely on their own clock
                return None
        return self._store

    def _raise_flag(self) -> None:
        store = self._job_store()
        if store is not None:
            try:
                store.set(STORE_KEY, "1")
            except Exception:  # the store may be gone with the job; reporting matters more
                pass

    def _peer_fired(self) -> bool:
        store = self._job_store()
        try:
            return store is not None and store.check([STORE_KEY])
        except Exception:
            return False
