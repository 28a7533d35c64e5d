"""The plan's independent pieces of work on several processes (``vshape plan --jobs N``).

A plan searches each row (a schedule, with or without ``+vocab`` / ``+pairs``) and then compares each row's
layer layouts. Every piece is a pure function of the plan's inputs, and the pieces share nothing but caches
of schedules built (simcache, the generators' own), which only make a second build of the same request
cheaper, never different. So they can run side by side: on a login node's cores the 1024-GPU GPT-3 plan's
search runs in about half its CPU time on two. The answers are the same, in the same order, as with one
process (``tests/test_plan_jobs.py``).

The workers are forked: they start with the parent's imported modules and caches, and each piece is handed
over by its index into a list set before the fork (closures need no pickling; only the answers travel back).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

# The pieces of the pool being run, read by the forked workers (set only around one ``run_all``).
_PIECES: Sequence[Callable[[], object]] = ()


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def run_all(pieces: Sequence[Callable[[], T]], jobs: int, weights: Sequence[float] | None = None) -> list[T]:
    """Each piece's answer, in the order of ``pieces``. With ``jobs`` > 1, on that many forked processes, the
    heaviest pieces (``weights``: a guess of each piece's time) handed out first so that the last to finish is
    a light one."""
    global _PIECES
    jobs = min(jobs, len(pieces))
    if jobs <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return [piece() for piece in pieces]
    order = sorted(range(len(pieces)), key=lambda i: -(weights[i] if weights else 0.0))
    _PIECES = pieces
    try:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            answers = pool.map(_run_piece, order, chunksize=1)
    finally:
        _PIECES = ()
    out: list = [None] * len(pieces)
    for index, answer in zip(order, answers):
        out[index] = answer
    return out


def _run_piece(index: int):
    return _PIECES[index]()
