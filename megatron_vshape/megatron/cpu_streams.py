"""CPU stand-ins for CUDA streams and events (``torch.cuda.Stream``, ``Event``, ``stream()``, ``record_stream``).

On CPU every operation runs synchronously on the calling thread: when a call returns, its result is
there. So the ordering a CUDA stream or event enforces already holds, and each stand-in keeps the API
Megatron calls while doing no waiting:

* :class:`CpuStream`: ``wait_stream``, ``wait_event`` and ``synchronize`` have nothing to wait for;
  ``record_event`` records an event on it; ``priority_range()`` answers like a GPU with two priorities.
* :func:`stream` and :func:`current_stream`: the current stream is real state, per thread as in torch, so
  code that compares streams or records on "the current stream" sees the stream it entered.
* :class:`CpuEvent`: ``record`` stamps the time (``elapsed_time`` between two timing events is the wall
  time between their records, as on a GPU where the stream is never behind); ``wait`` and ``synchronize``
  return at once, ``query`` is True.
* ``Tensor.record_stream`` on a CPU tensor: on a GPU it keeps the caching allocator from reusing the
  tensor's memory until the other stream's queued work is done. CPU memory is freed when the last
  reference goes, and no queued work can still read it, so there is nothing to record: a no-op. CUDA
  tensors keep torch's own method.

Megatron's combined 1F1B (``--overlap-moe-expert-parallel-comm``) creates a communication stream, runs
its schedule nodes under ``torch.cuda.stream(...)`` with an event per node, and calls ``record_stream``
on every node's inputs and gradients: with these it runs on gloo unchanged.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch

__all__ = ["CpuEvent", "CpuStream", "current_stream", "default_stream", "install", "set_stream", "stream"]

_CPU = torch.device("cpu")


class CpuStream:
    """``torch.cuda.Stream`` on CPU: an identity to enter, compare and record events on."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device = _CPU
        self.priority = priority

    @staticmethod
    def priority_range() -> tuple[int, int]:
        """(lowest, highest) priority, as ``torch.cuda.Stream.priority_range()`` (lower numbers run first)."""
        return 0, -1

    def wait_stream(self, other: CpuStream) -> None:
        _expect(other, CpuStream, "wait_stream")  # the work other queued is done: nothing to wait for

    def wait_event(self, event: CpuEvent) -> None:
        _expect(event, CpuEvent, "wait_event")

    def record_event(self, event: CpuEvent | None = None) -> CpuEvent:
        event = CpuEvent() if event is None else event
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True  # all work submitted to it is complete

    def __repr__(self) -> str:
        return f"<CpuStream priority={self.priority} at {id(self):#x}>"


class CpuEvent:
    """``torch.cuda.Event`` on CPU: records when it was recorded, and on which stream."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self.stream: CpuStream | None = None
        self._recorded_at: float | None = None

    def record(self, stream: CpuStream | None = None) -> None:
        self.stream = current_stream() if stream is None else _expect(stream, CpuStream, "record")
        self._recorded_at = time.perf_counter()

    def wait(self, stream: CpuStream | None = None) -> None:
        if stream is not None:
            _expect(stream, CpuStream, "wait")  # the recorded work is done: nothing to wait for

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: CpuEvent) -> float:
        """Milliseconds from this event's record to ``end_event``'s (both created with enable_timing)."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("elapsed_time: both events must be created with enable_timing=True")
        if self._recorded_at is None or end_event._recorded_at is None:
            raise RuntimeError("elapsed_time: both events must be recorded first")
        return (end_event._recorded_at - self._recorded_at) * 1000.0


def _expect(value, cls, call: str):
    # A real torch.cuda.Stream/Event here would mean CUDA objects leaked into a CPU-mode process.
    if not isinstance(value, cls):
        raise TypeError(f"CPU mode: {call}() got {type(value).__name__}, expected a {cls.__name__}")
    return value


_DEFAULT = CpuStream()
_current = threading.local()


def default_stream(device=None) -> CpuStream:
    return _DEFAULT


def current_stream(device=None) -> CpuStream:
    return getattr(_current, "stream", _DEFAULT)


def set_stream(new: CpuStream) -> None:
    _current.stream = _expect(new, CpuStream, "set_stream")


@contextlib.contextmanager
def stream(new: CpuStream | None):
    """``torch.cuda.stream(s)``: ``s`` is the current stream inside (None: no change, as torch does)."""
    if new is None:
        yield
        return
    previous = current_stream()
    set_stream(new)
    try:
        yield
    finally:
        _current.stream = previous


_TORCH_RECORD_STREAM = torch.Tensor.record_stream


def record_stream(tensor: torch.Tensor, stream_: CpuStream) -> None:
    """``Tensor.record_stream``: a no-op for CPU tensors (see the module's text), torch's own otherwise."""
    if tensor.device.type == "cpu":
        _expect(stream_, CpuStream, "record_stream")
        return
    _TORCH_RECORD_STREAM(tensor, stream_)


def install() -> None:
    """Put the stand-ins in place of torch's CUDA stream API (idempotent; CPU-mode processes only)."""
    cuda = torch.cuda
    cuda.Stream = CpuStream
    cuda.Event = CpuEvent
    cuda.stream = stream
    cuda.default_stream = default_stream
    cuda.current_stream = current_stream
    cuda.set_stream = set_stream
    torch.Tensor.record_stream = record_stream
