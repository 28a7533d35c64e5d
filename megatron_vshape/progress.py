"""Progress lines on stderr for work that can take minutes (large schedules, big plan searches).

A user who asked for 512 devices x 4096 microbatches should see at once that the tool is working
and roughly how big the job is, then a line every ``heartbeat`` seconds, then how long it took.
Small jobs print nothing, so output stays clean for scripts. Pure Python (a daemon thread).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

HEARTBEAT_S = 30.0


@contextlib.contextmanager
def phase(label: str, enabled: bool, *, prefix: str = "vshape", stream: TextIO | None = None,
          heartbeat: float = HEARTBEAT_S) -> Iterator[None]:
    """Print ``prefix: label ...`` now, ``still ...`` every ``heartbeat`` s, and the elapsed time at the end.

    Does nothing when ``enabled`` is false. ``stream`` defaults to ``sys.stderr`` at call time.
    """
    if not enabled:
        yield
        return
    out = stream if stream is not None else sys.stderr
    start = time.monotonic()
    _say(out, f"{prefix}: {label} ...")
    done = threading.Event()

    def beat() -> None:
        while not done.wait(heartbeat):
            _say(out, f"{prefix}: still {label} ({time.monotonic() - start:.0f} s)")

    thread = threading.Thread(target=beat, name="vshape-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
    _say(out, f"{prefix}: {label}: done in {time.monotonic() - start:.1f} s")


def _say(out: TextIO, line: str) -> None:
    try:
        print(line, file=out, flush=True)
    except (OSError, ValueError):  # a closed or broken stderr must not end the real work
        pass
