"""A queue of collectives beside the compute: posted in one order on every rank, waited where needed.

The executor's passes run on the compute stream (the host thread on CPU). Collectives that a pass posts
but whose result a later pass needs (vocabulary parallelism's H: the hidden gradient's reduce, the loss
gradient's broadcast) go on a :class:`CommQueue` instead, so the ranks that do not need the result do not
stop for it. A queue is the same concept for any family of collectives (the vocabulary's today; an
expert-parallel all-to-all could have its own): each is one in-order queue on every rank, and
``schedules/lowering/nccl_model.py`` checks the programs under exactly these rules (every queue holds
its collectives in one order on every rank; a wait across queues must not close a cycle).

* **CPU (gloo).** A post issues the collective with ``async_op=True`` and returns its work handle; the
  pass that needs the result calls :meth:`Pending.wait` (the host blocks there, and only there).
* **GPU (NCCL).** The queue has its own CUDA stream. A post records an event on the current stream and
  makes the queue's stream wait for it (the collective reads what the compute wrote before it), issues
  the collective from the queue's stream and records a completion event; :meth:`Pending.wait` makes the
  *current stream* wait for that event, never the host. The tensors a collective reads or writes are
  marked as used on the queue's stream (``record_stream``), so the caching allocator does not hand their
  memory out while the collective may still run. This path has not run on a GPU here (no GPU on the
  development machine); the CPU path is the tested one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class Pending:
    """One posted collective: :meth:`wait` before reading what it writes (or reusing what it reads)."""

    __slots__ = ("_work", "_event", "_tensors", "waited")

    def __init__(self, work, event, tensors: Sequence[torch.Tensor]):
        self._work, self._event, self._tensors = work, event, tuple(tensors)
        self.waited = False

    def wait(self) -> None:
        if self.waited:
            return
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)  # the stream waits; the host goes on
        elif self._work is not None:
            self._work.wait()
        self.waited = True
        self._tensors = ()  # the collective is done with them (on GPU: ordered before later work)


class CommQueue:
    """An in-order queue of collectives on one rank (see the module docstring); ``name`` is for messages."""

    def __init__(self, name: str, device: torch.device):
        self.name = name
        self.device = device
        self._stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.posted = 0  # collectives posted so far (a count the tests and the bench read)

    def post(self, issue: Callable[[], object], tensors: Sequence[torch.Tensor] = ()) -> Pending:
        """Issue ``issue()`` (a collective called with ``async_op=True``; returns its work handle or None)
        behind everything already on this queue; ``tensors``: what it reads or writes, kept alive until
        :meth:`Pending.wait`."""
        self.posted += 1
        if self._stream is None:
            return Pending(issue(), None, tensors)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            work = issue()
            if work is not None:
                work.wait()  # on NCCL: the queue's stream waits for the collective's own stream
            done = torch.cuda.Event()
            done.record(self._stream)
        for tensor in tensors:
            tensor.record_stream(self._stream)
        return Pending(None, done, tensors)
