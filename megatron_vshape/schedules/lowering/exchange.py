"""The exchange program: every point-to-point operation a pipeline rank issues, in issue order.

Pure Python. The last pass of the lowering chain (``program.exchange``): ``runtime/p2p.py`` executes
these programs and ``nccl_model.py`` checks them against NCCL's rules, so the model checks exactly the
operations the runtime issues.

Policy: **one global order of pairwise rendezvous.**

* Every pair of pipeline ranks that exchanges messages has its own communicator (a two-rank
  process group). Warm-up: right after the groups exist, each rank exchanges one token with each
  of its partners, walking the pairs in one sorted order shared by every rank
  (:func:`warmup_program`). NCCL creates a communicator lazily at its first operation and blocks
  until the peer does the same; in that one order, creation can never wait in a cycle.
* Per iteration (:func:`exchange_programs`): the lowered plans of *all* ranks are run through a
  timed as-soon-as-possible simulation. Every message of a channel (sender, receiver) becomes a
  *slot*, exchanged in the channel's send order at the moment its sender has produced it. Sorting
  every pass and every slot by simulated time gives one global order G; each rank's program is its
  own subsequence of G. A slot is posted as one batch on the pair's communicator (its send on one
  side, its receive on the other); slots that are adjacent in *both* partners' subsequences are
  fused into one batch (a send and a receive posted together, as Megatron's
  ``send_forward_recv_backward``), which is the same as moving them next to each other in G.
* Waits are as late as allowed (:func:`_emit`): a receiving batch right before the first pass that
  consumes it, a send-only batch 2d passes later (or at the end). Posting stays in G
  order; only the waits move. On gloo a wait blocks the host, so a sender no longer stops until a
  busy receiver reaches the slot, and a receiver still runs the passes that do not need the
  message. On NCCL a wait only orders the streams.

Why it cannot deadlock, on one in-order queue per rank (``CUDA_DEVICE_MAX_CONNECTIONS=1``) or on
many: take the earliest unfinished event of G. Every earlier event is finished. Each rank issues
its events in G order, so every queue holds them in G order and the event is at the head of every
queue it is in; its stream dependencies (a POST on the compute issued before it, a pass on the
compute and wait markers before it, a wait marker on an earlier POST) all point to earlier events,
finished. A pass then runs; a batch then runs on both of its ranks at once, and NCCL pairs the n-th
send with the n-th receive of each channel, which both sides posted in the same G order: the
receive gets the message it expects, by construction. By induction every event finishes. A
receive is posted no earlier than its place in G, so on one queue it never sits in front of
compute its peer needs first (posting the next step's receives early, the old receive window, does
exactly that, and the NCCL model shows it hanging).

The receiving side labels its n-th receive of a channel with ``plan.recv_order[peer][n]`` (the
lowering's contract), the sending side with its n-th send; they agree on every correct plan, and
the NCCL model reports any slot where they do not (a swapped activation and gradient).

**Collective passes** (vocabulary parallelism's H): their collectives run on the whole pipeline group's
communicator (``Communicator(PIPELINE_GROUP, 0, d - 1)``) and on a queue of their own
(``VOCAB_QUEUE``: a CUDA stream beside the compute, runtime/comm_queue.py): each is a COLLECTIVE op,
posted at once and waited (a WAIT) only where its result is needed (:func:`_emit_h`, the list
runtime/vocab_h.py issues). In the timed run an H starts on every rank at once, when the last rank
reaches it (a rendezvous), so all ranks' H of a microbatch share one place in G; every rank issues them
in G order, which the validator has made one order on every rank. The argument above holds with the
rendezvous as one more kind of event that runs on all its ranks at once; a collective that only some
pass waits for (the loss gradient, waited in G) finishes once every rank has posted it, which each does
in its H, so no wait on it can close a cycle (the NCCL model checks it for every program).

**Overlapped F&B pairs** (``ProgramStep.overlaps_next``, Megatron's combined 1F1B step): one unit. In the
timed run the pair starts when both halves' inputs are there and both halves end together
(``Costs.pair_time``); both halves' receives are waited before the F's COMPUTE and both sends go out
after the pair, so the runtime can run the two halves as one call.

**The expert-parallel all-to-all** (``expert_layers``: MoE layers per stage). Expert parallelism runs
across the replicas of one pipeline rank (the expert group is part of the data-parallel ranks, never of
the pipeline), and every replica runs the same program. Each F and B of a stage with MoE layers records,
before its COMPUTE, the all-to-alls Megatron's schedule plan issues for it (per layer a dispatch and a
combine; in a pair in the plan's order: the B's combine, the F's dispatch, the B's dispatch, the F's
combine), as COLLECTIVE ops on the expert queue (``EXPERT_QUEUE``: the expert communicator's own NCCL
stream) over ``Communicator(EXPERT_GROUP, rank, rank)`` (this pipeline rank's expert group; the NCCL
model spreads it over the replicas, ``nccl_model.with_expert_replicas``), each waited for at once (the
compute needs it). The runtime issues nothing for them (Megatron does, inside the pass); they are the
program's record for the NCCL model, as the vocabulary H's are.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Sequence
from typing import NamedTuple

from ..core.actions import Kind, VocabKind
from ..core.schedule import Costs, vocab_pass_times
from ..core.vocab_embedding import embedding_slots, token_slots
from .drive import drive
from .loss_grads import carried_loss_grads
from .messages import CommError, DevicePlan, Message, with_arrivals

PAIR_GROUP = "pair"  # the communicator family of this policy: one two-rank group per pair
PIPELINE_GROUP = "pipeline"  # the whole pipeline group (ranks lo..hi): the vocabulary passes' collectives
# The queues a rank's work goes to besides its compute and its p2p communicators (each one in-order queue,
# a CUDA stream of its own on GPU): a family of collectives per queue. nccl_model.py knows no name here.
VOCAB_QUEUE = "vocabulary"
EXPERT_QUEUE = "expert"
EXPERT_GROUP = "expert"  # one pipeline rank's expert-parallel group (its replicas; see with_expert_replicas)
# A send-only batch is waited for this many passes per pipeline rank after it (about a pipeline's
# worth of passes: the receiver has posted by then; at most that many sent tensors stay alive).
SEND_SLACK_PER_RANK = 2


class Communicator(NamedTuple):
    """One communicator: the pair ``(lo, hi)`` of pipeline ranks in process-group family ``group``."""

    group: str
    lo: int
    hi: int
    stride: int = 1  # the expert group: its members are lo, lo + stride, ..., hi (one pipeline rank's replicas)

    def __repr__(self) -> str:  # the stride only where it is not 1 (the expert group's)
        stride = f", stride={self.stride}" if self.stride != 1 else ""
        return f"Communicator(group={self.group!r}, lo={self.lo}, hi={self.hi}{stride})"

    @classmethod
    def of(cls, group: str, a: int, b: int) -> Communicator:
        return cls(group, min(a, b), max(a, b))

    @property
    def members(self) -> frozenset[int]:
        """The ranks of this communicator: the pair, every rank lo..hi of the pipeline group, or the expert
        group's ranks lo..hi every ``stride``."""
        if self.group in (PIPELINE_GROUP, EXPERT_GROUP):
            return frozenset(range(self.lo, self.hi + 1, self.stride))
        return frozenset((self.lo, self.hi))


class Transfer(NamedTuple):
    """One tensor moved from pipeline rank ``src`` to ``dst``; ``message`` None is the warm-up token."""

    src: int
    dst: int
    message: Message | None


class OpKind(enum.Enum):
    POST = "post"  # post one batch of transfers on a communicator (returns at once)
    WAIT = "wait"  # later work waits for an earlier POST (on NCCL: the stream waits, not the CPU)
    COMPUTE = "compute"  # run plan step ``index``
    COLLECTIVE = "collective"  # post one collective on ``queue`` over ``communicator`` (returns at once)

    __hash__ = object.__hash__


class Op(NamedTuple):
    kind: OpKind
    # POST: the batch's communicator; COMPUTE: the communicator of the collectives the step runs inside
    # (a vocabulary H: the pipeline group), None for a step without collectives.
    communicator: Communicator | None = None
    transfers: tuple[Transfer, ...] = ()
    index: int = -1  # COMPUTE: the plan step; WAIT: the position of its POST or COLLECTIVE in the program
    queue: str | None = None  # COLLECTIVE: the queue it is posted on
    label: str = ""  # COLLECTIVE: what it is (the n-th of a communicator must be the same on every member)

    def __str__(self) -> str:
        if self.kind is OpKind.COLLECTIVE:
            return f"collective {self.label} on the {self.queue} queue"
        if self.kind is OpKind.COMPUTE:
            inside = f" with collectives on {self.communicator.group}" if self.communicator is not None else ""
            return f"compute step {self.index}{inside}"
        if self.kind is OpKind.WAIT:
            return f"wait op {self.index}"
        parts = ", ".join(f"{'warm-up' if t.message is None else t.message}" for t in self.transfers)
        return f"post {self.communicator.group}({self.communicator.lo},{self.communicator.hi}): {parts}"


def pipeline_pairs(num_devices: int) -> tuple[tuple[int, int], ...]:
    """Every pair of pipeline ranks a placement can connect: neighbours, and the wrap (last, first)."""
    pairs = {(i, i + 1) for i in range(num_devices - 1)}
    if num_devices > 2:
        pairs.add((0, num_devices - 1))
    return tuple(sorted(pairs))


def warmup_program(rank: int, num_devices: int) -> tuple[Op, ...]:
    """Connect every pair of ``rank`` once, in the sorted order every rank follows."""
    ops: list[Op] = []
    for lo, hi in pipeline_pairs(num_devices):
        if rank in (lo, hi):
            ops.append(Op(OpKind.POST, Communicator(PAIR_GROUP, lo, hi), (Transfer(lo, hi, None), Transfer(hi, lo, None))))
            ops.append(Op(OpKind.WAIT, index=len(ops) - 1))
    return tuple(ops)


class _Event(NamedTuple):
    """One entry of the global order G. Sorting by the fields puts a slot before a pass that starts
    at the same instant, and the slots of one channel in their order."""

    time: float
    is_pass: bool  # False: slot ``n`` of the channel a -> b; True: pass ``b`` (plan step) of device ``a``
    a: int
    b: int
    n: int = 0


def exchange_programs(plans: Sequence[DevicePlan], costs: Costs = Costs(),
                      eager_waits: bool = False, expert_layers: Sequence[int] = ()) -> tuple[tuple[Op, ...], ...]:
    """The per-iteration program of every rank (see the module docstring).

    ``plans`` are the messages level of the lowering (a ``DevicePlan``, or a ``program.RankProgram``:
    only each step's action, receives and sends and the receive order are read).

    ``eager_waits`` waits for every batch right after posting it (the policy before waits moved
    late: one operation outstanding per rank); kept to measure what the late waits buy.
    ``expert_layers``: MoE layers per stage (empty: no expert-parallel all-to-all recorded).
    """
    sends = _send_orders(plans)
    _check_channels(plans, sends)
    starts, slot_times = _timed_run(plans, sends, costs)
    events = [_Event(time, False, src, dst, n) for (src, dst, n), time in slot_times.items()]
    events += [_Event(start, True, device, index) for device, device_starts in enumerate(starts)
               for index, start in enumerate(device_starts)]
    events.sort()
    sequences: list[list[_Event]] = [[] for _ in plans]  # each rank's subsequence of G
    for event in events:
        sequences[event.a].append(event)
        if not event.is_pass:
            sequences[event.b].append(event)
    batches = _fuse(sequences)
    slack = SEND_SLACK_PER_RANK * len(plans)
    holder = _last_stage_rank(plans)
    first = _first_stage_rank(plans)
    training = any(step.action.kind is VocabKind.G for step in plans[first].steps)
    slots = embedding_slots([step.action for step in plans[first].steps], training)
    carried = carried_loss_grads([[step.action for step in plan.steps] for plan in plans], holder)
    return tuple(_emit(rank, sequences[rank], batches, plans[rank], sends, slack, eager_waits, len(plans), holder,
                       _EmbeddingOps(rank == first, slots, len(plans)), expert_layers, carried)
                 for rank in range(len(plans)))


def _first_stage_rank(plans) -> int:
    """The rank holding stage 0 (the embedding's: its lookups' destination, its gradients' root)."""
    stages = [(step.action.stage, rank) for rank, plan in enumerate(plans) for step in plan.steps
              if not isinstance(step.action.kind, VocabKind)]
    return min(stages)[1] if stages else 0


def _last_stage_rank(plans) -> int:
    """The rank holding the last stage (the root of H's broadcasts and its reduce's destination)."""
    stages = [(step.action.stage, rank) for rank, plan in enumerate(plans) for step in plan.steps
              if not isinstance(step.action.kind, VocabKind)]
    return max(stages)[1] if stages else 0


def _send_orders(plans) -> dict[tuple[int, int], list[Message]]:
    sends: dict[tuple[int, int], list[Message]] = defaultdict(list)
    for plan in plans:
        for step in plan.steps:
            for msg in step.sends:
                sends[(msg.src, msg.dst)].append(msg)
    return sends


def _check_channels(plans, sends) -> None:
    known = set(pipeline_pairs(len(plans)))
    for (src, dst), msgs in sends.items():
        if (min(src, dst), max(src, dst)) not in known:
            raise CommError(f"messages {src}->{dst} between ranks that are not pipeline neighbours")
        order = plans[dst].recv_order.get(src, ())
        if len(order) != len(msgs):
            raise CommError(f"device {dst} expects {len(order)} messages from {src}, which sends {len(msgs)}")
    for dst, plan in enumerate(plans):
        for src, order in plan.recv_order.items():
            if order and (src, dst) not in sends:
                raise CommError(f"device {dst} expects messages from {src}, which sends none")


def _timed_run(plans, sends, costs: Costs):
    """As-soon-as-possible run of the plans: each pass's start, and each slot's time.

    A pass waits for the slots that carry its receives (by the receiver's labels); slot n of a
    channel happens when its sender has produced message n and slot n-1 has happened.
    """
    send_position = {msg: n for msgs in sends.values() for n, msg in enumerate(msgs)}
    recv_position = {(src, dst, msg): n for dst, plan in enumerate(plans)
                     for src, order in plan.recv_order.items() for n, msg in enumerate(order)}
    waits_for = [[_slot_keys(device, step, recv_position) for step in plan.steps] for device, plan in enumerate(plans)]
    slot_time: dict[tuple[int, int, int], float] = {}
    starts: list[list[float]] = [[] for _ in plans]
    free = [0.0] * len(plans)

    devices = range(len(plans))
    arrival: dict[tuple[int, int], float] = {}  # (microbatch, rank) -> when the rank reached its H
    vocab, vocab_w = vocab_pass_times(costs, len(plans)) if costs.vocab is not None else (1.0, 1.0)

    pair_start = [0.0] * len(plans)  # the start of the pair whose F ran last on each device

    def needs(device, entry):
        arrive, index, step = entry
        if arrive:
            return ()
        if step.action.kind is VocabKind.H:
            return [("at", step.action.microbatch, other) for other in devices]
        if _overlaps(step):  # a pair starts when both halves' inputs are there
            return waits_for[device][index] + waits_for[device][index + 1]
        return waits_for[device][index]

    def run(device, entry):
        arrive, index, step = entry
        if arrive:
            arrival[(step.action.microbatch, device)] = free[device]
            return [("at", step.action.microbatch, device)]
        if step.action.kind is VocabKind.H:  # a rendezvous: all start when the last one arrived
            start = max(arrival[(step.action.microbatch, other)] for other in devices)
            starts[device].append(start)
            free[device] = start + vocab
            return []
        if index > 0 and _overlaps(plans[device].steps[index - 1]):  # a pair's B: with its F, ending together
            starts[device].append(pair_start[device])
        else:
            start = max([free[device]] + [slot_time[key] for key in needs(device, entry)])
            starts[device].append(start)
            if _overlaps(step):
                backward = plans[device].steps[index + 1].action
                pair_start[device] = start
                free[device] = start + costs.pair_time(costs.of(Kind.F, step.action.stage),
                                                       costs.of(Kind.B, backward.stage), 1.0,
                                                       (step.action.stage, backward.stage))
            else:
                free[device] = start + (costs.of(step.action.kind, step.action.stage)
                                        if not isinstance(step.action.kind, VocabKind) else vocab_w)
        made = []
        for msg in step.sends:
            n = send_position[msg]
            key = (msg.src, msg.dst, n)
            slot_time[key] = max(free[device], slot_time.get((msg.src, msg.dst, n - 1), 0.0))
            made.append(key)
        return made

    programs = [[(arrive, index, step) for index, (arrive, step) in enumerate_steps(plan.steps)] for plan in plans]
    cursor = drive(programs, needs, run)
    stuck = [f"device {d} at step {programs[d][c][1]}" for d, (c, program) in enumerate(zip(cursor, programs))
             if c < len(program)]
    if stuck:
        raise CommError("p2p plan deadlocks (a receive waits for a message never sent before it): " + "; ".join(stuck))
    return starts, slot_time


def _overlaps(step) -> bool:
    """An F run overlapped with the next step (program.ProgramStep.overlaps_next; a plain Step has no pairs)."""
    return getattr(step, "overlaps_next", False)


def enumerate_steps(steps):
    """``(index, (arrive, step))`` of :func:`messages.with_arrivals`, with each step's plan index."""
    index = -1
    for arrive, step in with_arrivals(steps):
        if not arrive:
            index += 1
        yield (index + 1 if arrive else index), (arrive, step)


def _slot_keys(device: int, step, recv_position) -> list[tuple[int, int, int]]:
    """The slots (src, dst, n) carrying ``step``'s receives, by the receiver's labels."""
    try:
        return [(m.src, device, recv_position[(m.src, device, m)]) for m in step.recvs]
    except KeyError as missing:
        raise CommError(f"device {device} receives {missing} but its recv_order lacks it") from None


def _fuse(sequences) -> dict[_Event, int]:
    """Slot -> batch id: a slot joins the batch of the slot right before it on *both* of its ranks."""
    previous: dict[_Event, list[_Event | None]] = defaultdict(list)  # the event before, on each of its ranks
    for sequence in sequences:
        for i, event in enumerate(sequence):
            if not event.is_pass:
                previous[event].append(sequence[i - 1] if i else None)
    batches: dict[_Event, int] = {}
    for event in sorted(previous):  # G order: the batch of the slot before is known
        prior, other = previous[event]
        joinable = prior is not None and prior == other  # then a slot of the same two ranks
        batches[event] = batches[prior] if joinable else len(batches)
    return batches


def _emit(rank, sequence, batches, plan: DevicePlan, sends, slack: int, eager_waits: bool = False,
          num_ranks: int = 1, holder: int = 0, embedding: _EmbeddingOps | None = None,
          expert_layers: Sequence[int] = (), carried: dict[int, int] | None = None) -> tuple[Op, ...]:
    """This rank's operations: each batch POSTed at its place in G; its WAIT as late as allowed.

    A batch that receives is waited for right before the first pass that consumes one of its
    messages. A batch that only sends is waited for ``slack`` passes after it (after that pass's
    receive-waits), or at the end: a gloo send completes only once the receiver has posted its
    receive, which it does at its own place in G, so a sender that waited at once stopped until a
    busy receiver got there; the slack bounds how many sent tensors stay alive (on GPU the output
    a send holds is freed at its wait). A pair's F waits for both halves' receives.
    """
    ops: list[Op] = []
    current: list[Transfer] = []
    current_batch = None
    unwaited: dict[int, bool] = {}  # POST position -> it receives; in post order
    receiving: dict[Message, int] = {}  # received message -> its POST position
    sending: list[tuple[int, int]] = []  # send-only POSTs not waited for: (passes issued before it, position)
    passes = 0
    training = any(step.action.kind is VocabKind.G for step in plan.steps)
    waited_in_g: dict[int, tuple[int, ...]] = {}  # microbatch -> H's collectives its G waits for
    unsent: dict[int, int] = {}  # the other ranks: microbatch -> its reduce, until its send buffer is let go
    vocab = any(step.action.kind is VocabKind.H for step in plan.steps)
    if vocab:
        embedding.slot(ops)  # slot 0: in the runtime's prologue, before any of this program's operations

    def close():
        if current:
            src, dst = current[0].src, current[0].dst
            ops.append(Op(OpKind.POST, Communicator.of(PAIR_GROUP, src, dst), tuple(current)))
            position = len(ops) - 1
            receives = any(t.dst == rank for t in current)
            unwaited[position] = receives
            receiving.update((t.message, position) for t in current if t.dst == rank)
            if not receives:
                sending.append((passes, position))
            current.clear()
            if eager_waits:
                wait(position)

    def wait(position):
        if unwaited.pop(position, None) is not None:
            ops.append(Op(OpKind.WAIT, index=position))

    for event in sequence:
        if event.is_pass:
            close()
            current_batch = None
            step = plan.steps[event.b]
            recvs = step.recvs + (plan.steps[event.b + 1].recvs if _overlaps(step) else ())
            for position in sorted({receiving[m] for m in recvs if receiving.get(m) in unwaited}):
                wait(position)
            while sending and passes - sending[0][0] >= slack:
                wait(sending.pop(0)[1])
            action = plan.steps[event.b].action
            if action.kind is VocabKind.H:
                embedding.slot(ops)
                waited_in_g[action.microbatch] = _emit_h(ops, event.b, action.microbatch, rank == holder, training,
                                                         num_ranks, carried or {}, unsent)
            else:
                if vocab and action.kind is Kind.F and action.stage == 0:
                    ops.append(Op(OpKind.WAIT, index=embedding.lookups.pop(action.microbatch)))
                if action.kind is VocabKind.G:
                    send = unsent.pop(action.microbatch, None)
                    for position in (() if send is None else (send,)) + waited_in_g.pop(action.microbatch, ()):
                        ops.append(Op(OpKind.WAIT, index=position))
                if expert_layers:
                    _emit_a2a(ops, rank, plan, event.b, expert_layers)
                ops.append(Op(OpKind.COMPUTE, index=event.b))
            passes += 1
            continue
        src, dst, n = event.a, event.b, event.n
        if batches[event] != current_batch:
            close()
            current_batch = batches[event]
        message = sends[(src, dst)][n] if src == rank else plan.recv_order[src][n]
        current.append(Transfer(src, dst, message))
    close()
    for position in list(unwaited):
        wait(position)
    if vocab:
        embedding.slot(ops)  # the last slot: in the runtime's epilogue, after the exchange has finished
        embedding.settle(ops)
    return tuple(ops)


def a2a_labels(plan, index: int, expert_layers: Sequence[int]) -> tuple[str, ...]:
    """The all-to-alls plan step ``index`` issues, in Megatron's order (its schedule plan's ``run``): an F
    or B alone, per layer a dispatch then a combine (a B: from its last layer down); the F of a pair,
    per overlapped layer the B's combine, the F's dispatch, the B's dispatch, the F's combine, then the
    longer half's layers alone; the B of a pair, nothing (its F recorded them)."""
    steps = plan.steps
    step = steps[index]
    action = step.action
    if isinstance(action.kind, VocabKind) or action.kind is Kind.W:
        return ()
    if action.kind is Kind.B and index > 0 and _overlaps(steps[index - 1]):
        return ()

    def alone(act, layers):
        return [f"{act} L{i} {what}" for i in layers for what in ("dispatch", "combine")]

    forward = action if action.kind is Kind.F else None
    backward = steps[index + 1].action if _overlaps(step) else (action if action.kind is Kind.B else None)
    f_layers = list(range(expert_layers[forward.stage])) if forward is not None else []
    b_layers = list(reversed(range(expert_layers[backward.stage]))) if backward is not None else []
    both = min(len(f_layers), len(b_layers))
    labels = []
    for fl, bl in zip(f_layers[:both], b_layers[:both]):
        labels += [f"{backward} L{bl} combine", f"{forward} L{fl} dispatch", f"{backward} L{bl} dispatch",
                   f"{forward} L{fl} combine"]
    labels += alone(backward, b_layers[both:]) if backward is not None else []
    labels += alone(forward, f_layers[both:]) if forward is not None else []
    return tuple(labels)


def _emit_a2a(ops: list[Op], rank: int, plan, index: int, expert_layers: Sequence[int]) -> None:
    """Step ``index``'s all-to-alls on the expert queue, each waited for at once (see the module docstring)."""
    group = Communicator(EXPERT_GROUP, rank, rank)
    for label in a2a_labels(plan, index, expert_layers):
        ops.append(Op(OpKind.COLLECTIVE, group, queue=EXPERT_QUEUE, label=label))
        ops.append(Op(OpKind.WAIT, index=len(ops) - 1))


class _EmbeddingOps:
    """The embedding's collectives on one rank (runtime/vocab_embedding.py): at each slot the earlier
    slots' collectives are waited for (settled), then (slot 0) its lookups' tokens T(k) posted, D(k) posted,
    each E(k) posted after waiting for its tokens, and the next slot's tokens posted; the first stage's rank
    waits for E(k) right before its F(0, k) instead of at the next slot."""

    def __init__(self, first: bool, slots, num_ranks: int):
        self.first, self.slots, self.next = first, slots, 0
        self.tokens_at = token_slots(slots)
        self.whole = Communicator(PIPELINE_GROUP, 0, num_ranks - 1)
        self.lookups: dict[int, int] = {}  # first stage: microbatch -> its E's position
        self.tokens: dict[int, int] = {}  # microbatch -> its T's position, until its E waits for it
        self.unsettled: list[int] = []

    def settle(self, ops: list[Op]) -> None:
        ops.extend(Op(OpKind.WAIT, index=position) for position in self.unsettled)
        self.unsettled.clear()

    def _post(self, ops: list[Op], label: str) -> int:
        ops.append(Op(OpKind.COLLECTIVE, self.whole, queue=VOCAB_QUEUE, label=label))
        return len(ops) - 1

    def slot(self, ops: list[Op]) -> None:
        slot, self.next = self.next, self.next + 1
        self.settle(ops)
        for k in self.slots.lookups[0] if slot == 0 else ():
            self.tokens[k] = self._post(ops, f"T{k} tokens")
        for k in self.slots.grads[slot]:
            self.unsettled.append(self._post(ops, f"D{k} embedding"))
        for k in self.slots.lookups[slot]:
            ops.append(Op(OpKind.WAIT, index=self.tokens.pop(k)))
            position = self._post(ops, f"E{k} embedding")
            if self.first:
                self.lookups[k] = position
            else:
                self.unsettled.append(position)
        for k in self.tokens_at[slot]:
            self.tokens[k] = self._post(ops, f"T{k} tokens")


def _emit_h(ops: list[Op], step: int, microbatch: int, holder: bool, training: bool, num_ranks: int,
            carried: dict[int, int], unsent: dict[int, int]) -> tuple[int, ...]:
    """H(k)'s operations on one rank, as runtime/vocab_h.py issues them: the packed hidden state and labels,
    with the loss gradient of the microbatch whose g rides with it (``carried``, loss_grads.py) (waited at
    once, but not by the last stage's rank, which sends them), the compute, the statistics' all-gather
    (waited at once: the rendezvous), and when training the hidden gradient's reduce (waited by the last
    stage's rank before its B) and, where g(k) does not ride with the next H, the loss gradient's broadcast.
    Returns the positions G(k) waits for: the broadcast (a carried g arrived in the next H, which every other
    rank waited for before its G(k)). ``unsent``: on the other ranks, microbatch -> its reduce's position, not
    yet waited: each is waited at the next H, once its broadcast is posted (the send buffer let go), or at
    G(k) where that comes first; this H's is added."""
    whole = Communicator(PIPELINE_GROUP, 0, num_ranks - 1)

    def post(what: str) -> int:
        ops.append(Op(OpKind.COLLECTIVE, whole, queue=VOCAB_QUEUE, label=f"H{microbatch} {what}"))
        return len(ops) - 1

    rides = [k for k, n in carried.items() if n == microbatch]
    arrived = post("hidden state and labels" + "".join(f", loss gradient of {k}" for k in rides))
    if not holder:
        for position in unsent.values():
            ops.append(Op(OpKind.WAIT, index=position))
        unsent.clear()
        ops.append(Op(OpKind.WAIT, index=arrived))
    ops.append(Op(OpKind.COMPUTE, index=step))
    ops.append(Op(OpKind.WAIT, index=post("statistics")))
    if not training:
        return ()
    reduced = post("hidden gradient")
    if not holder:
        unsent[microbatch] = reduced
    if microbatch in carried:
        if holder:
            ops.append(Op(OpKind.WAIT, index=reduced))
        return ()
    sent = post("loss gradient")
    if holder:
        ops.append(Op(OpKind.WAIT, index=reduced))
    return (sent,)
