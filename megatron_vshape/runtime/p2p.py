"""Point-to-point exchange for one device's lowered plan (``schedules.lower``).

Receives from each peer are posted strictly in ``plan.recv_order[peer]`` order, which is the order
that peer sends them. Point-to-point without tags (NCCL) pairs the n-th receive with the n-th send
of the same peer, so this order is what keeps an activation from ever landing in a gradient's
buffer; it holds on gloo as well because every message here uses the same tag. We deliberately do
not use megatron's batched p2p (measured to swap an activation with a gradient between one pair).

Each direction of the pipeline (towards higher ranks, towards lower ranks) has its own process group
(:class:`DirectionalGroups`). On NCCL the point-to-point operations between one pair of ranks run
on one stream per process group, in posting order; a receive posted ahead would otherwise hold up a
later send to the same peer on that stream (the send waits behind the receive, the peer waits for
the send: deadlock). With one group per direction, a pair's stream carries only one side's sends
and the other side's receives, both in the one agreed order.

Receives are posted a small window ahead per peer and waited on just before the pass that needs
them; sends go out right after the producing pass. A helper thread waits on the sends in the order
they were posted and drops each payload as soon as it is delivered: gloo reports a send complete
only through ``wait()``, and waiting on the compute thread could block it behind a receive the
peer has not posted yet.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_vshape.schedules import DevicePlan, Message


@dataclass
class _PeerInbox:
    order: tuple[Message, ...]
    posted: int = 0  # receives posted so far (a prefix of ``order``)
    pending: dict[Message, tuple[torch.Tensor, object]] = field(default_factory=dict)


@dataclass(frozen=True)
class DirectionalGroups:
    """The pipeline group twice: ``up`` carries messages to higher pipeline ranks, ``down`` to lower."""

    ranks: tuple[int, ...]  # pipeline rank -> global rank
    up: object
    down: object

    @classmethod
    def create(cls, pp_group) -> DirectionalGroups:
        """Collective over all ranks (every rank creates every pipeline group's pair, in one order)."""
        mine = tuple(dist.get_process_group_ranks(pp_group))
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        up = down = None
        for ranks in sorted(set(map(tuple, everyone))):
            pair = (dist.new_group(list(ranks)), dist.new_group(list(ranks)))
            if ranks == mine:
                up, down = pair
        return cls(mine, up, down)

    def group(self, src: int, dst: int):
        return self.up if dst > src else self.down


class PlanExchange:
    """Sends and receives of one iteration of one device's plan."""

    def __init__(
        self,
        plan: DevicePlan,
        groups: DirectionalGroups,
        make_buffer: Callable[[Message], torch.Tensor],
        window: int = 2,
    ):
        self._groups = groups
        self._ranks = groups.ranks
        self._make_buffer = make_buffer
        self._window = max(1, window)
        self._inboxes = {peer: _PeerInbox(order) for peer, order in plan.recv_order.items()}
        self._position = {msg: i for inbox in self._inboxes.values() for i, msg in enumerate(inbox.order)}
        self._sends = _SendReaper()
        for peer in self._inboxes:
            self._post_upto(peer, self._window)

    def _post_upto(self, peer: int, count: int) -> None:
        inbox = self._inboxes[peer]
        while inbox.posted < min(count, len(inbox.order)):
            msg = inbox.order[inbox.posted]
            buffer = self._make_buffer(msg)
            work = dist.irecv(buffer, src=self._ranks[peer], group=self._groups.group(msg.src, msg.dst))
            inbox.pending[msg] = (buffer, work)
            inbox.posted += 1

    def recv(self, msg: Message) -> torch.Tensor:
        """Wait for ``msg`` (posting every earlier receive from its sender first) and return it."""
        inbox = self._inboxes[msg.src]
        position = self._position[msg]
        self._post_upto(msg.src, position + 1)
        buffer, work = inbox.pending.pop(msg)
        work.wait()
        self._post_upto(msg.src, position + 1 + self._window)
        return buffer

    def send(self, msg: Message, tensor: torch.Tensor) -> None:
        # A detached handle keeps the storage alive until the send completes, even if the caller
        # pseudo-frees the tensor's .data right after (megatron's deallocate_pipeline_outputs).
        payload = tensor.detach().contiguous()
        work = dist.isend(payload, dst=self._ranks[msg.dst], group=self._groups.group(msg.src, msg.dst))
        self._sends.put(work, payload)

    def finish(self) -> None:
        """Wait for every send; fail if a receive of the plan was never consumed."""
        self._sends.close()
        left = [str(m) for inbox in self._inboxes.values() for m in inbox.order[inbox.posted:]]
        left += [str(m) for inbox in self._inboxes.values() for m in inbox.pending]
        if left:
            raise RuntimeError(f"p2p plan finished with unconsumed receives: {', '.join(left)}")


class _SendReaper:
    """Waits on posted sends off the compute thread and frees each payload once delivered."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="vshape-send-reaper", daemon=True)
        self._thread.start()

    def put(self, work, payload: torch.Tensor) -> None:
        self._queue.put((work, payload))

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                item[0].wait()
            except BaseException as err:  # noqa: B036 - handed to the compute thread in close()
                self._error = self._error or err
            del item  # the last reference to the payload: its memory goes now

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"a pipeline send failed: {self._error}") from self._error
