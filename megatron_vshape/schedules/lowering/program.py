"""One lowering chain: a schedule turned into what each pipeline rank runs, by named passes.

As in PyTorch's pipelining (named lowering passes with an explicit level), each pass takes the level
before it and adds one thing; :func:`lower_program` runs them in this order:

1. ``messages`` (:attr:`Level.MESSAGES`): per device, each compute step with the p2p messages it
   receives before it runs and sends after it (``messages.lower``; hand-overs on one device are none),
   and which F runs overlapped with the B after it (an F&B pair, ``Schedule.pairs``: ``overlaps_next``).
2. ``forward_only``: an evaluation call keeps the forwards (and the vocabulary H passes, whose forward
   part gives the loss) and their activations only.
3. ``fused_backward_pairs`` (:attr:`Level.PAIRED`): which B leaves its weight gradients to its W pass
   and which runs B and W as one backward (:func:`deferred_backwards`).
4. ``chunk_marks`` (:attr:`Level.MARKED`): the steps where a chunk's parameters must be gathered
   (its first F) and where its gradient reduction may start (its last backward pass, B or W): the
   grad-sync points. (Within a chunk, ``runtime/grad_sync.py`` launches bucket by bucket.)
5. ``exchange`` (:attr:`Level.EXCHANGE`): every rank's p2p operations in issue order
   (``exchange.exchange_programs``: one global order of pairwise rendezvous); a pair is one unit there
   (both halves' receives waited before it, both halves' sends after it), and with ``expert_layers`` each
   F and B of a stage with MoE layers records the expert-parallel all-to-alls that Megatron's schedule plan
   issues (on the expert queue, ``exchange.EXPERT_QUEUE``), for the NCCL model.

Three readers take the same :class:`Program`: the executor (``runtime/iteration.py`` runs a rank's
steps and its exchange), the NCCL model (``nccl_model.check_program`` runs every rank's exchange under
NCCL's rules) and the replay of measured passes (``runtime/timeline.replay_idle``). The simulator that
generators use works on the schedule itself (the level before ``messages``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from ..core.actions import Action, Kind, VocabKind
from ..core.schedule import Costs, Placement, Schedule
from .exchange import Op, exchange_programs
from .messages import DevicePlan, Message, Payload, Step, lower

VOCAB_CHUNK = 0  # the local model chunk that holds a rank's vocabulary shard


class Level(enum.IntEnum):
    """How far a :class:`Program` is lowered (each level holds everything of the ones below)."""

    MESSAGES = 1
    PAIRED = 2
    MARKED = 3
    EXCHANGE = 4


class ProgramStep(NamedTuple):
    """One compute step of a rank, with everything the passes attached to it."""

    action: Action
    recvs: tuple[Message, ...] = ()
    sends: tuple[Message, ...] = ()
    defers_w: bool = False  # a B whose weight gradients wait for its W pass (else B computes them)
    # (a vocabulary H always leaves its weight gradient to its G)
    gathers_params_of: tuple[int, ...] = ()  # local chunks whose first F this is: gather parameters first
    reduces_grads_of: tuple[int, ...] = ()  # local chunks whose last backward pass (B or W) this is
    # An F that runs overlapped with the next step, its pair's B (actions.Pair: one microbatch's F and another's
    # B as one unit, Megatron's combined 1F1B step): both halves' receives come before it, both sends after.
    overlaps_next: bool = False


@dataclass(frozen=True)
class RankProgram:
    """What one pipeline rank runs: its steps, the order it receives from each peer, its p2p program."""

    steps: tuple[ProgramStep, ...]
    recv_order: dict[int, tuple[Message, ...]]  # per peer: exactly the order in which that peer sends
    exchange: tuple[Op, ...] = ()

    def deferred(self) -> frozenset[Action]:
        """The B actions of this rank that leave their weight gradients to their W pass."""
        return frozenset(step.action for step in self.steps if step.defers_w)


@dataclass(frozen=True)
class Program:
    """Every rank's program for one call (training, or ``forward_only`` evaluation) of ``schedule``."""

    schedule: Schedule
    forward_only: bool
    level: Level
    ranks: tuple[RankProgram, ...]


# --- the passes ------------------------------------------------------------------------------------


def messages(schedule: Schedule) -> tuple[RankProgram, ...]:
    """Pass 1: each device's steps with the messages they receive and send, and the pairs marked."""
    return mark_pairs(schedule, from_plans(lower(schedule)))


def mark_pairs(schedule: Schedule, ranks: Sequence[RankProgram]) -> tuple[RankProgram, ...]:
    """Pass 1's second half: the F of each overlapped pair gets ``overlaps_next`` (its B is the next step;
    the validator has checked that the halves are adjacent, forward first)."""
    if not schedule.pairs:
        return tuple(ranks)
    forwards = {pair.forward: pair.backward for pair in schedule.pairs}
    out = []
    for rank in ranks:
        steps = list(rank.steps)
        for i, step in enumerate(steps):
            backward = forwards.get(step.action)
            if backward is not None:
                if i + 1 >= len(steps) or steps[i + 1].action != backward:
                    raise ValueError(f"pair {step.action}&{backward}: the halves are not adjacent, forward first")
                steps[i] = step._replace(overlaps_next=True)
        out.append(replace(rank, steps=tuple(steps)))
    return tuple(out)


def forward_only(ranks: Sequence[RankProgram]) -> tuple[RankProgram, ...]:
    """Pass 2 (evaluation calls): the forwards and the activations they exchange."""
    return tuple(_forwards(rank) for rank in ranks)


def forward_only_plan(plan: DevicePlan) -> DevicePlan:
    """Pass 2 on a messages-level plan (the tests' and tools' form)."""
    kept = _forwards(from_plans((plan,))[0])
    return DevicePlan(tuple(Step(*step[:3]) for step in kept.steps), kept.recv_order)


def fused_backward_pairs(schedule: Schedule, ranks: Sequence[RankProgram], defer_every_w: bool = False,
                         split_remote_pairs: bool = True) -> tuple[RankProgram, ...]:
    """Pass 3: mark the B steps that defer their W (see :func:`deferred_backwards`).

    ``defer_every_w``: every B defers, also one whose W follows directly (Transformer Engine's deferring
    linears queue a weight gradient in every backward, so every W must pop one).
    """
    out = []
    for rank in ranks:
        deferred = ({s.action for s in rank.steps if s.action.kind is Kind.B} if defer_every_w
                    else deferred_backwards(schedule, rank, split_remote_pairs))
        out.append(replace(rank, steps=tuple(s._replace(defers_w=s.action in deferred) for s in rank.steps)))
    return tuple(out)


def deferred_backwards(schedule: Schedule, plan: DevicePlan | RankProgram, split_remote_pairs: bool = True) -> set[Action]:
    """B actions that leave their weight gradients to the store, for their W pass to compute.

    A B directly followed by its own W runs as one ordinary backward, but only when its input gradient
    stays on this rank (first stage, or the consumer is local): the fused backward sends that gradient
    only after the weight gradients too, so for a consumer on another rank it would arrive W's
    duration later than the schedule (and the simulator) assume. Fused-backward schedules (1F1B,
    GPipe, interleaved) are simulated that way and never split. ``split_remote_pairs=False`` is the old
    policy (every such pair fused), kept for the benchmarks' side-by-side rows.
    """
    if schedule.fused_backward:
        return set()
    steps = plan.steps
    deferred = set()
    for i, step in enumerate(steps):
        action = step.action
        if action.kind is Kind.B:
            follows = i + 1 < len(steps) and steps[i + 1].action == Action(Kind.W, action.stage, action.microbatch)
            if not follows or (split_remote_pairs and step.sends):
                deferred.add(action)
    return deferred


def chunk_marks(placement: Placement, ranks: Sequence[RankProgram]) -> tuple[RankProgram, ...]:
    """Pass 4: per step, the local chunks whose first F and whose last backward pass it is.

    A vocabulary shard's parameters belong to the rank's first chunk (``VOCAB_CHUNK``): its H counts as
    that chunk's forward (the parameters must be there) and its G as a backward pass of it (the
    gradient reduction waits for the last one).
    """
    out = []
    for device, rank in enumerate(ranks):
        first_f: dict[int, int] = {}
        last_backward: dict[int, int] = {}
        vocab_stage = placement.stages_per_device[device][VOCAB_CHUNK]
        for index, step in enumerate(rank.steps):
            stage = vocab_stage if isinstance(step.action.kind, VocabKind) else step.action.stage
            if step.action.kind is Kind.F or step.action.kind is VocabKind.H:
                first_f.setdefault(stage, index)
            else:
                last_backward[stage] = index

        def at(marks: dict[int, int], index: int) -> tuple[int, ...]:
            return tuple(placement.chunk_of(stage) for stage, i in marks.items() if i == index)

        out.append(replace(rank, steps=tuple(
            step._replace(gathers_params_of=at(first_f, i), reduces_grads_of=at(last_backward, i))
            for i, step in enumerate(rank.steps))))
    return tuple(out)


def exchange(ranks: Sequence[RankProgram], costs: Costs = Costs(), eager_waits: bool = False,
             expert_layers: Sequence[int] = ()) -> tuple[RankProgram, ...]:
    """Pass 5: every rank's p2p operations, in one global order of pairwise rendezvous (``expert_layers``:
    MoE layers per stage, whose all-to-alls each F and B records; empty: none)."""
    programs = exchange_programs(ranks, costs, eager_waits, expert_layers)
    return tuple(replace(rank, exchange=ops) for rank, ops in zip(ranks, programs))


# --- the chain -------------------------------------------------------------------------------------


def lower_program(schedule: Schedule, costs: Costs = Costs(), *, forward_only_call: bool = False,
                  defer_every_w: bool = False, split_remote_pairs: bool = True, eager_waits: bool = False,
                  plans: Sequence[DevicePlan] | None = None, level: Level = Level.EXCHANGE,
                  expert_layers: Sequence[int] = ()) -> Program:
    """Run the passes on ``schedule`` up to ``level``.

    ``plans``: the messages level, when the caller lowered it itself (the executor's hook, through
    which the tests hand it a corrupted plan). ``costs`` time the exchange's global order (the costs
    the schedule was built from). ``expert_layers``: the MoE layers of each stage (one entry per stage;
    empty: a model without experts), whose expert-parallel all-to-alls the exchange records.
    """
    ranks = messages(schedule) if plans is None else mark_pairs(schedule, from_plans(plans))
    if forward_only_call:
        ranks = forward_only(ranks)
    reached = Level.MESSAGES
    for pass_level, run in (
        (Level.PAIRED, lambda r: fused_backward_pairs(schedule, r, defer_every_w and not forward_only_call,
                                                      split_remote_pairs)),
        (Level.MARKED, lambda r: chunk_marks(schedule.placement, r)),
        (Level.EXCHANGE, lambda r: exchange(r, costs, eager_waits, expert_layers)),
    ):
        if pass_level > level:
            break
        ranks, reached = run(ranks), pass_level
    return Program(schedule, forward_only_call, reached, ranks)


def from_plans(plans: Sequence[DevicePlan]) -> tuple[RankProgram, ...]:
    """The messages level from plans lowered elsewhere (``messages.lower``, or a test's own)."""
    return tuple(RankProgram(tuple(ProgramStep(*step) for step in plan.steps), plan.recv_order) for plan in plans)


def _forwards(rank: RankProgram) -> RankProgram:
    # An evaluation call's loss needs the vocabulary H's forward part too.
    steps = tuple(step._replace(overlaps_next=False) for step in rank.steps
                  if step.action.kind is Kind.F or step.action.kind is VocabKind.H)
    recv_order = {peer: kept for peer, msgs in rank.recv_order.items()
                  if (kept := tuple(m for m in msgs if m.payload is Payload.ACTIVATION))}
    return RankProgram(steps, recv_order)
