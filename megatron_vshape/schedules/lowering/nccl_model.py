"""A model of NCCL's rules, to prove that exchange programs cannot hang on a GPU (pure Python).

No CPU test can see an NCCL hang: gloo connects when a group is created and runs every operation
on its own threads. This model runs the per-rank operation lists of the lowering chain's exchange pass
(``program.py``; the very ones ``runtime/p2p.py`` issues) under the rules that matter:

* **Lazy communicators.** The first POST on a communicator creates it, and creation blocks the
  rank's host thread until every member is creating the same communicator (megatron.training
  initialises torch.distributed without ``device_id``).
* **Queues.** Every kernel of a rank goes to one queue. With ``CUDA_DEVICE_MAX_CONNECTIONS=1``
  (``single_queue``) that is one in-order hardware queue per rank for every stream; otherwise
  compute has its own queue and each communicator its own (one NCCL stream per communicator). A
  kernel runs only at the head of its queue, once the kernels it depends on have finished: a POST
  depends on everything issued to compute before it (torch makes the NCCL stream wait for the
  current stream), and a WAIT puts a marker on the compute queue that depends on its POST.
* **Rendezvous.** A POST is one NCCL kernel for all its transfers (a batch). Its n-th send to a
  peer on a communicator pairs with that peer's n-th receive from it on the same communicator, and
  a part completes only while both kernels are running (a send completes only when the peer's
  receive runs; a receive blocks its queue until matched). A kernel finishes when all its parts
  have. Compute kernels just run.
* **Collectives.** A COLLECTIVE op (vocabulary parallelism's H: on the whole pipeline group) is one
  kernel on the queue the op names (a stream of its own; with ``single_queue`` the one hardware queue):
  it depends on everything issued to compute before it (the stream waits for an event recorded on the
  compute stream) and finishes only once the n-th collective of EVERY member of its communicator is
  running (NCCL pairs the n-th collective of each rank); the first one creates the communicator lazily,
  as a POST does. A WAIT on it puts a marker on the compute queue, as for a POST.
* **The queues' rules.** Each communicator's collectives come from one queue on every rank, and the
  n-th collective of a communicator is the same one (its label) on every member (else NCCL pairs, say,
  one rank's loss-gradient broadcast with another's reduce: :class:`NcclMismatch`). That a wait across
  queues (compute waiting for a collective, a collective waiting for compute) closes no cycle is what
  running the model shows: a cycle leaves the ranks stopped (:class:`NcclDeadlock`). A COMPUTE op that
  names a communicator (collectives inside the step, on the compute queue: the form before the
  collectives had a queue) is still understood.
* **The expert-parallel all-to-all** (MoE with expert parallelism: ``exchange.EXPERT_QUEUE``). Its group is
  one pipeline rank's replicas, so :func:`with_expert_replicas` runs ``expert_parallel`` copies of the
  pipeline's programs side by side (copy r's rank p is model rank r * d + p; each copy's p2p pairs and
  pipeline group its own) and each pipeline rank's expert group spans its copies. The rules above then
  apply to it as to any collective queue: one queue on every rank, the same n-th all-to-all on every
  member, and no cross-queue wait closing a cycle.

The host never waits for the GPU otherwise. :func:`run_nccl_model` raises :class:`NcclDeadlock`
when the ranks stop with work left, and :class:`NcclMismatch` when NCCL would pair a receive with
a different message than the receiver expects.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..core.schedule import Costs
from .exchange import EXPERT_GROUP, Communicator, Op, OpKind, Transfer, warmup_program
from .messages import CommError, DevicePlan
from .program import Program, exchange, forward_only, from_plans

COMPUTE_QUEUE = "compute"


class NcclDeadlock(CommError):
    """Under NCCL's rules the programs stop with work left."""


class NcclMismatch(CommError):
    """NCCL would deliver a message into a receive that expects another one."""


@dataclass(eq=False, slots=True)
class _Kernel:
    rank: int
    op: Op  # what the host issued (for the deadlock report)
    deps: tuple[_Kernel, ...] = ()
    parts: list[_Part] = field(default_factory=list)
    unmatched: int = 0  # parts still waiting for their peer
    running: bool = False
    done: bool = False


@dataclass(eq=False, slots=True)
class _Part:
    kernel: _Kernel
    transfer: Transfer
    channel: tuple  # (comm, src, dst)
    position: int  # n-th send (or receive) of the channel
    is_send: bool
    matched: bool = False


@dataclass
class _Rank:
    segments: Sequence[Sequence[Op]]
    segment: int = 0
    cursor: int = 0
    creating: Communicator | None = None
    posts: dict[int, _Kernel] = field(default_factory=dict)  # program position -> POST kernel (this segment)
    queues: dict[object, deque] = field(default_factory=lambda: defaultdict(deque))
    compute_tail: _Kernel | None = None

    def current(self) -> Op | None:
        while self.segment < len(self.segments):
            ops = self.segments[self.segment]
            if self.cursor < len(ops):
                return ops[self.cursor]
            self.segment, self.cursor = self.segment + 1, 0
            self.posts = {}
        return None


class _Model:
    def __init__(self, programs, single_queue: bool):
        self.ranks = [_Rank(segments) for segments in programs]
        self.single_queue = single_queue
        self.created: set[Communicator] = set()
        self.joining: dict[Communicator, set[int]] = defaultdict(set)
        self.parts: dict[tuple, dict[bool, list[_Part]]] = defaultdict(lambda: {True: [], False: []})
        self.work: deque[int] = deque(range(len(self.ranks)))
        # communicator -> rank -> its collective kernels in issue order; a kernel's index among them
        self.collectives: dict[Communicator, dict[int, list[_Kernel]]] = defaultdict(lambda: defaultdict(list))
        self.collective_position: dict[int, int] = {}
        self.queue_of: dict[tuple[int, Communicator], object] = {}  # (rank, communicator) -> the queue it uses

    # --- host -------------------------------------------------------------------------------

    def issue(self, r: int) -> bool:
        rank, progressed = self.ranks[r], False
        while (op := rank.current()) is not None:
            if op.communicator is not None and op.communicator not in self.created:
                if not self.join(r, op.communicator):
                    break
            self.issue_op(r, op)
            rank.cursor += 1
            progressed = True
        return progressed

    def join(self, r: int, comm: Communicator) -> bool:
        """Lazy creation: block until every member of ``comm`` is creating it too."""
        members = set(comm.members)
        if r not in members:
            raise CommError(f"rank {r} posts on communicator {comm} it is not a member of")
        self.ranks[r].creating = comm
        self.joining[comm].add(r)
        if self.joining[comm] != members:
            return False
        self.created.add(comm)
        for member in members:
            self.ranks[member].creating = None
            if member != r:
                self.work.append(member)
        return True

    def issue_op(self, r: int, op: Op) -> None:
        rank = self.ranks[r]
        if op.kind is OpKind.COLLECTIVE or (op.kind is OpKind.COMPUTE and op.communicator is not None):
            queue = op.queue if op.kind is OpKind.COLLECTIVE else COMPUTE_QUEUE
            if self.queue_of.setdefault((r, op.communicator), queue) != queue:
                raise CommError(f"rank {r} issues collectives on {op.communicator} from two queues "
                                f"({self.queue_of[(r, op.communicator)]} and {queue}): NCCL keeps no order between them")
            kernel = _Kernel(r, op, self.tail_deps(rank), unmatched=1)  # the rendezvous of every member
            mine = self.collectives[op.communicator][r]
            mine.append(kernel)
            self.collective_position[id(kernel)] = len(mine) - 1
            if op.kind is OpKind.COLLECTIVE:
                rank.posts[rank.cursor] = kernel
            self.enqueue(r, queue, kernel)
        elif op.kind is OpKind.COMPUTE:
            self.enqueue(r, COMPUTE_QUEUE, _Kernel(r, op, self.tail_deps(rank)))
        elif op.kind is OpKind.WAIT:
            self.enqueue(r, COMPUTE_QUEUE, _Kernel(r, op, self.tail_deps(rank) + (rank.posts.pop(op.index),)))
        else:
            kernel = _Kernel(r, op, self.tail_deps(rank))
            for transfer in op.transfers:
                if r not in (transfer.src, transfer.dst) or {transfer.src, transfer.dst} != {op.communicator.lo, op.communicator.hi}:
                    raise CommError(f"rank {r}: transfer {transfer} does not belong on {op.communicator}")
                channel = (op.communicator, transfer.src, transfer.dst)
                is_send = transfer.src == r
                mine = self.parts[channel][is_send]
                mine.append(_Part(kernel, transfer, channel, len(mine), is_send))
                kernel.parts.append(mine[-1])
            kernel.unmatched = len(kernel.parts)
            rank.posts[rank.cursor] = kernel
            self.enqueue(r, op.communicator, kernel)

    def tail_deps(self, rank: _Rank) -> tuple[_Kernel, ...]:
        return (rank.compute_tail,) if rank.compute_tail is not None else ()

    def enqueue(self, r: int, queue, kernel: _Kernel) -> None:
        rank = self.ranks[r]
        rank.queues["hw" if self.single_queue else queue].append(kernel)
        if queue == COMPUTE_QUEUE:
            rank.compute_tail = kernel

    # --- device -----------------------------------------------------------------------------

    def advance_queues(self, r: int) -> bool:
        progressed = False
        for queue in self.ranks[r].queues.values():
            while queue:
                head = queue[0]
                if not head.running:
                    if any(not dep.done for dep in head.deps):
                        break
                    head.running = True
                    self.match(head)
                if head.unmatched:
                    break
                head.done = True
                queue.popleft()
                progressed = True
        return progressed

    def match(self, kernel: _Kernel) -> None:
        if kernel.op.kind is OpKind.COLLECTIVE or (kernel.op.kind is OpKind.COMPUTE and kernel.op.communicator is not None):
            comm, n = kernel.op.communicator, self.collective_position[id(kernel)]  # every member's n-th must run
            peers = [self.collectives[comm][member] for member in sorted(comm.members)]
            for kernels in peers:
                if n < len(kernels) and kernels[n].op.label != kernel.op.label:
                    raise NcclMismatch(f"on {comm}, rank {kernel.rank}'s collective {n} is {kernel.op.label or 'unnamed'} "
                                       f"and rank {kernels[n].rank}'s is {kernels[n].op.label or 'unnamed'}")
            if all(n < len(kernels) and kernels[n].running for kernels in peers):
                for kernels in peers:
                    kernels[n].unmatched = 0
                    self.work.append(kernels[n].rank)
            return
        for part in kernel.parts:
            others = self.parts[part.channel][not part.is_send]
            if part.position >= len(others):
                continue
            other = others[part.position]
            if not other.kernel.running:
                continue
            if part.transfer.message != other.transfer.message:
                send, recv = (part, other) if part.is_send else (other, part)
                raise NcclMismatch(
                    f"on {part.channel[0]}, rank {recv.kernel.rank} expects {recv.transfer.message} "
                    f"and receives {send.transfer.message}"
                )
            part.matched = other.matched = True
            kernel.unmatched -= 1
            other.kernel.unmatched -= 1
            self.work.append(other.kernel.rank)

    def run(self) -> None:
        while self.work:
            r = self.work.popleft()
            while self.issue(r) | self.advance_queues(r):
                pass
        stuck = [self.describe(r) for r, rank in enumerate(self.ranks)
                 if rank.current() is not None or any(rank.queues.values())]
        if stuck:
            raise NcclDeadlock("NCCL deadlock: " + "; ".join(stuck))

    def describe(self, r: int) -> str:
        rank = self.ranks[r]
        op = rank.current()
        host = "host done" if op is None else (
            f"host creating {rank.creating}" if rank.creating is not None else f"host at {op}")
        heads = [str(q[0].op) for q in rank.queues.values() if q]
        return f"rank {r}: {host}, queue heads [{' | '.join(heads)}]"


def run_nccl_model(programs: Sequence[Sequence[Sequence[Op]]], single_queue: bool) -> None:
    """Run ``programs[rank]`` (a list of op lists, e.g. warm-up then iterations) under NCCL's rules.

    ``single_queue`` models ``CUDA_DEVICE_MAX_CONNECTIONS=1``. Raises :class:`NcclDeadlock` or
    :class:`NcclMismatch`; returns None when every operation of every rank completes.
    """
    _Model(programs, single_queue).run()


def check_program(train: Program, evaluate: Program, single_queue: Sequence[bool] = (True, False),
                  expert_parallel: int = 2) -> None:
    """Model what the runtime issues for one schedule's lowered programs (the warm-up, a training call,
    an evaluation call) under each ``single_queue`` setting; programs that record expert-parallel
    all-to-alls run as ``expert_parallel`` replicas (:func:`with_expert_replicas`)."""
    _check_calls(train.ranks, evaluate.ranks, single_queue, expert_parallel)


def has_expert_a2a(programs) -> bool:
    """True when a rank's program records expert-parallel all-to-alls (ops on the expert group)."""
    return any(op.communicator is not None and op.communicator.group == EXPERT_GROUP
               for segments in programs for ops in segments for op in ops)


def with_expert_replicas(programs: Sequence[Sequence[Sequence[Op]]], expert_parallel: int):
    """``expert_parallel`` copies of the pipeline's per-rank programs (lists of op lists), as the model's
    ranks: copy r's pipeline rank p is rank r * d + p. Each copy keeps its own p2p communicators and
    pipeline group; pipeline rank p's expert group becomes ranks p, d + p, ..., the replicas that hold
    the same stages (Megatron's expert group lies inside the data-parallel ranks of one pipeline stage)."""
    d = len(programs)

    def moved(comm: Communicator | None, r: int) -> Communicator | None:
        if comm is None:
            return None
        if comm.group == EXPERT_GROUP:
            return Communicator(EXPERT_GROUP, comm.lo, comm.lo + (expert_parallel - 1) * d, d)
        return comm._replace(lo=comm.lo + r * d, hi=comm.hi + r * d)

    def op_of(op: Op, r: int) -> Op:
        transfers = tuple(t._replace(src=t.src + r * d, dst=t.dst + r * d) for t in op.transfers)
        return op._replace(communicator=moved(op.communicator, r), transfers=transfers)

    return [[[op_of(op, r) for op in ops] for ops in programs[p]] for r in range(expert_parallel) for p in range(d)]


def check_exchange(plans: Sequence[DevicePlan], single_queue: Sequence[bool] = (True, False),
                   costs: Costs = Costs()) -> None:
    """:func:`check_program` from messages-level ``plans``: the chain's forward-only and exchange passes
    run on them (the exchange reads nothing that the passes in between add)."""
    ranks = from_plans(plans)
    _check_calls(exchange(ranks, costs), exchange(forward_only(ranks), costs), single_queue)


def _check_calls(train, evaluate, single_queue: Sequence[bool], expert_parallel: int = 2) -> None:
    d = len(train)
    # With vocabulary passes the embedding's collectives, the tokens' and the prologue's and epilogue's included,
    # are in the call's own program (exchange.py, _EmbeddingOps).
    programs = [(warmup_program(r, d), t.exchange, e.exchange)
                for r, (t, e) in enumerate(zip(train, evaluate))]
    if expert_parallel > 1 and has_expert_a2a(programs):
        programs = with_expert_replicas(programs, expert_parallel)
    for setting in single_queue:
        run_nccl_model(programs, setting)
