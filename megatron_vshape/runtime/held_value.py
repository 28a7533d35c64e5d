"""One value per process, visible from every thread, held by one block at a time.

What a backward needs to know (which B/W capture is in force, which stage is running) must be seen
from autograd's CUDA worker thread, which sees no ContextVar or thread-local of the thread that
called ``backward()``. So such state lives in an explicit process-wide slot; holding it while it is
held raises, so two executors (or a pass inside a pass) cannot silently answer for each other.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")


class HeldValue(Generic[T]):
    """``hold(value)`` for the duration of a block; ``get()`` from any thread (None when free)."""

    def __init__(self, conflict: Callable[[T, T], Exception]):
        self._conflict = conflict  # (new value, held value) -> the error to raise
        self._lock = threading.Lock()
        self._value: T | None = None

    @contextmanager
    def hold(self, value: T) -> Iterator[T]:
        with self._lock:
            if self._value is not None:
                raise self._conflict(value, self._value)
            self._value = value
        try:
            yield value
        finally:
            with self._lock:
                self._value = None

    def get(self) -> T | None:
        return self._value
