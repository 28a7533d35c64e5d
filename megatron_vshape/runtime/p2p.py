"""Point-to-point exchange: runs the exchange program of ``schedules/lowering/exchange.py`` on real ranks.

The program (one per rank, computed from the lowered plans of every rank) says which batch of
sends and receives to post before which pass; its docstring has the policy and the proof that it
cannot hang under NCCL's rules, and ``schedules/lowering/nccl_model.py`` checks every schedule against
those rules. This module only executes it:

* :class:`PairGroups` makes one two-rank process group per pair of pipeline ranks that may talk
  (collectively, in one order on every rank) and warms each one up with a token exchange, in the
  order of :func:`~megatron_vshape.schedules.lowering.exchange.warmup_program`. NCCL creates communicators
  lazily and each creation blocks until the peer creates the same one; after the warm-up no
  creation is left for the iterations.
* :class:`PlanExchange` issues the program's operations from the calling (compute) thread, in
  program order: a POST is one ``batch_isend_irecv`` on the pair's group, a WAIT calls
  ``Work.wait()`` on its works (on NCCL that makes the current stream wait; on gloo it blocks the
  CPU). The program waits for a receive right before the pass that needs it and for a send 2d
  passes later, so several posted operations may be outstanding; they were posted in the one global order
  that makes that safe (see ``schedules/lowering/exchange.py``), and no thread waits on NCCL work.
  Untagged NCCL pairs the n-th send with the n-th receive of a channel; both sides post in the
  program's order, so each tensor lands in the buffer meant for it (megatron's batched p2p, which
  swapped an activation and a gradient, is not used).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_vshape.schedules.lowering.exchange import Op, OpKind, pipeline_pairs, warmup_program
from megatron_vshape.schedules.lowering.messages import Message, Payload

from .timeline import Category, Timeline


@dataclass(frozen=True)
class PairGroups:
    """One process group per pair of pipeline ranks (``(lo, hi)``, pipeline ranks), warmed up."""

    ranks: tuple[int, ...]  # pipeline rank -> global rank
    rank: int  # this process's pipeline rank
    groups: dict[tuple[int, int], object]

    @classmethod
    def create(cls, pp_group) -> PairGroups:
        """Collective over all ranks: every rank creates every pipeline group's pair groups, in one order."""
        mine = tuple(dist.get_process_group_ranks(pp_group))
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        groups: dict[tuple[int, int], object] = {}
        for ranks in sorted(set(map(tuple, everyone))):
            for lo, hi in pipeline_pairs(len(ranks)):
                group = dist.new_group([ranks[lo], ranks[hi]])
                if ranks == mine:
                    groups[(lo, hi)] = group
        made = cls(mine, mine.index(dist.get_rank()), groups)
        made._warm_up()
        return made

    def group(self, lo: int, hi: int):
        return self.groups[(lo, hi)]

    def _warm_up(self) -> None:
        device = local_device()
        program = warmup_program(self.rank, len(self.ranks))
        runner = PlanExchange(program, self, lambda transfer: torch.zeros(1, device=device))
        runner.finish()


class PlanExchange:
    """Executes one rank's exchange program for one iteration, step by step."""

    def __init__(self, program: Sequence[Op], groups: PairGroups, make_buffer: Callable[[object], torch.Tensor]):
        self._program = program
        self._next = 0
        self._groups = groups
        self._make_buffer = make_buffer
        self._outbox: dict[Message, torch.Tensor] = {}
        self._received: dict[Message, torch.Tensor] = {}
        # program position -> (works, [(message, receive buffer)], sent tensors)
        self._posted: dict[int, tuple[list, list, list]] = {}
        # (program position, works) waited for but maybe not done: on NCCL a wait only makes the
        # stream wait. Kept (completed ones dropped) so the watchdog can name a stuck operation.
        self._waited: list[tuple[int, list]] = []
        self.timeline: Timeline | None = None  # set by the executor to split waits from bookkeeping
        self._blocked: tuple[int, list] | None = None  # (position, works) the host is waiting on now
        self._collectives: set[int] = set()  # positions of COLLECTIVE ops not waited for yet

    def advance(self, step: int) -> None:
        """Issue every operation that comes before plan step ``step``."""
        while self._next < len(self._program):
            op = self._program[self._next]
            if op.kind is OpKind.COMPUTE:
                if op.index != step:
                    raise RuntimeError(f"exchange program expects plan step {op.index}, the executor runs {step}")
                self._next += 1
                return
            self._issue(op)
        raise RuntimeError(f"exchange program has no plan step {step}")

    def recv(self, msg: Message) -> torch.Tensor:
        """The tensor of ``msg`` (received by an earlier :meth:`advance`)."""
        try:
            return self._received.pop(msg)
        except KeyError:
            raise RuntimeError(f"p2p: {msg} is needed before the exchange program received it") from None

    def send(self, msg: Message, tensor: torch.Tensor) -> None:
        """Hand over ``msg``; the program posts it at its slot."""
        # A detached handle keeps the storage alive until the send is posted and waited for, even
        # if the caller pseudo-frees the tensor's .data right after (deallocate_pipeline_outputs).
        self._outbox[msg] = tensor.detach().contiguous()

    def finish(self) -> None:
        """Issue the operations after the last step; fail if a message was not used."""
        while self._next < len(self._program):
            op = self._program[self._next]
            if op.kind is OpKind.COMPUTE:
                raise RuntimeError(f"p2p: the executor stopped before plan step {op.index}")
            self._issue(op)
        left = [f"unsent {m}" for m in self._outbox] + [f"unused {m}" for m in self._received]
        if left:
            raise RuntimeError(f"p2p plan finished with messages left: {', '.join(left)}")

    def _issue(self, op: Op) -> None:
        position, self._next = self._next, self._next + 1
        # A collective and its waits are the program's record of what the pass issues on its own queue
        # (runtime/vocab_h.py, in this order): the NCCL model reads them; nothing to do here.
        if op.kind is OpKind.COLLECTIVE:
            self._collectives.add(position)
            return
        if op.kind is OpKind.WAIT and op.index in self._collectives:
            self._collectives.discard(op.index)
            return
        if op.kind is OpKind.WAIT:
            works, buffers, _sent = self._posted.pop(op.index)  # the sent tensors may go now
            self._waited = [(pos, ws) for pos, ws in self._waited if not _all_completed(ws)]
            self._waited.append((op.index, works))
            if self.timeline is not None:
                self.timeline.mark(Category.BOOKKEEPING)
            self._blocked = (op.index, works)
            for work in works:
                work.wait()
            self._blocked = None
            if self.timeline is not None:
                self.timeline.mark(Category.WAIT_RECV if buffers else Category.WAIT_SEND, str(self._program[op.index]))
            for msg, buffer in buffers:
                if msg is not None:
                    self._received[msg] = buffer
            return
        me, ranks = self._groups.rank, self._groups.ranks
        group = self._groups.group(op.communicator.lo, op.communicator.hi)
        ops, buffers, sent = [], [], []
        for transfer in op.transfers:
            if transfer.src == me:
                tensor = self._outbox.pop(transfer.message) if transfer.message is not None else self._make_buffer(None)
                ops.append(dist.P2POp(dist.isend, tensor, ranks[transfer.dst], group))
                sent.append(tensor)
            else:
                buffer = self._make_buffer(transfer.message)
                ops.append(dist.P2POp(dist.irecv, buffer, ranks[transfer.src], group))
                buffers.append((transfer.message, buffer))
        self._posted[position] = (list(dist.batch_isend_irecv(ops)), buffers, sent)


    def pending(self) -> str | None:
        """In words (for the watchdog's thread): the operation the host is waiting on, else the oldest
        posted one that has not completed (several may be outstanding: sends are waited for late)."""
        try:
            blocked = self._blocked
            candidates = sorted([*self._waited, *((pos, entry[0]) for pos, entry in list(self._posted.items()))],
                                key=lambda item: item[0])
            if blocked is not None:
                candidates.insert(0, blocked)
            for position, works in candidates:
                if not _all_completed(works):
                    return _describe(self._program[position], self._groups.rank)
        except RuntimeError:  # the compute thread changed the bookkeeping meanwhile: say so, not crash
            return "(p2p state changing, not read)"
        return None


def _all_completed(works) -> bool:
    return all(work.is_completed() for work in works)


def _describe(op: Op, me: int) -> str:
    parts = []
    for transfer in op.transfers:
        msg = transfer.message
        what = "warm-up token" if msg is None else (
            f"{'activation' if msg.payload is Payload.ACTIVATION else 'gradient'} of microbatch "
            f"{msg.microbatch} (stage {msg.src_stage}->{msg.dst_stage})")
        if transfer.src == me:
            parts.append(f"send of {what} to pipeline rank {transfer.dst}")
        else:
            parts.append(f"receive of {what} from pipeline rank {transfer.src}")
    return " + ".join(parts)


def local_device() -> torch.device:
    """This rank's current GPU, or the CPU (where tensors, buffers and messages live)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
