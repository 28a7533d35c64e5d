"""Where the vocabulary-parallel embedding's collectives go: per microbatch, at the H passes (pure Python).

With ``--pipeline-vocab-parallel`` every pipeline rank looks up its rows of microbatch k's tokens; the
sum is **reduced** onto the first stage's rank (E(k)), which needs it before its F of stage 0; after that
rank's B of stage 0 the embedding's gradient is **broadcast** back (D(k)), and every rank adds its rows'
weight gradient. Every rank must issue these collectives in one order, at points they all pass in one
order: the H passes (the validator makes their order the same on every rank), plus the call's start
(slot 0, the prologue) and end (the last slot, the epilogue).

The first stage's rank's own program decides the slots, as late as its passes allow: E(k) at the last H
before its F(0, k) (slot 0 if none), D(k) at the first H after its B(0, k) (the end if none). So the
first stage's rank holds only the embeddings between their E and their F, and the gradients between
their B and the next H: a number the schedule bounds (about its warm-up), not m. The tokens of microbatch
k go to every rank per microbatch too: T(k), a broadcast from the first stage's rank one slot before E(k)
(:func:`token_slots`; slot 0 also carries, waited at once, the tokens of its own lookups). The runtime
(runtime/vocab_embedding.py) and the lowering (exchange.py) both read :func:`embedding_slots`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .actions import Action, Kind, VocabKind


@dataclass(frozen=True)
class EmbeddingSlots:
    """``lookups[i]`` / ``grads[i]``: the microbatches whose E / D collectives go at slot i; slot 0 is
    the call's start, slot i (1..n) the start of the i-th H (in the order every rank runs them), slot
    n + 1 the call's end."""

    lookups: tuple[tuple[int, ...], ...]
    grads: tuple[tuple[int, ...], ...]

    @property
    def num_slots(self) -> int:
        return len(self.lookups)


def embedding_slots(first_rank_actions: Sequence[Action], training: bool) -> EmbeddingSlots:
    """The slots of every microbatch's E and (``training``) D, from the program of the rank that holds
    stage 0 (its actions in run order; H passes included)."""
    num_h = sum(1 for a in first_rank_actions if a.kind is VocabKind.H)
    lookups: list[list[int]] = [[] for _ in range(num_h + 2)]
    grads: list[list[int]] = [[] for _ in range(num_h + 2)]
    seen = 0
    for action in first_rank_actions:
        if action.kind is VocabKind.H:
            seen += 1
        elif action.stage == 0 and action.kind is Kind.F:
            lookups[seen].append(action.microbatch)
        elif action.stage == 0 and action.kind is Kind.B and training:
            grads[seen + 1].append(action.microbatch)
    return EmbeddingSlots(tuple(map(tuple, lookups)), tuple(map(tuple, grads)))


def token_slots(slots: EmbeddingSlots) -> tuple[tuple[int, ...], ...]:
    """``out[i]``: the microbatches whose tokens' broadcast T(k) is posted at the end of slot i (after its D
    and E): those of the next slot's lookups, so that they have arrived when that slot's E needs them. (Slot
    0's own lookups get theirs at its start, waited at once: nothing comes before it.)"""
    return tuple(slots.lookups[i + 1] if i + 1 < slots.num_slots else () for i in range(slots.num_slots))


def held_peak(first_rank_actions: Sequence[Action], training: bool) -> int:
    """The most microbatches whose embedding or embedding gradient the first stage's rank holds at once
    (an embedding from its slot to its F, a gradient from its B to its slot): what the planner and the
    ledger count, in microbatches of b x s x h."""
    slots = embedding_slots(first_rank_actions, training)
    held = peak = 0
    seen = 0

    def at_slot(i: int) -> None:
        nonlocal held, peak
        held -= len(slots.grads[i])  # sent: the gradients go
        held += len(slots.lookups[i])
        peak = max(peak, held)

    at_slot(0)
    for action in first_rank_actions:
        if action.kind is VocabKind.H:
            seen += 1
            at_slot(seen)
        elif action.stage == 0 and action.kind is Kind.F:
            held -= 1  # handed to F(0, k), which owns it from now on
        elif action.stage == 0 and action.kind is Kind.B and training:
            held += 1
            peak = max(peak, held)
    return peak


@dataclass(frozen=True)
class BufferEvent:
    """A change of what one device holds for the embedding's passes: at the start (``at_end`` False) or end
    of the pass at ``index`` in its program (``index`` = the program's length: the call's end), ``embeddings``
    more microbatches' embeddings or embedding gradients (b x s x h; the first stage's device only) and
    ``tokens`` more microbatches' tokens (b x s; every device)."""

    index: int
    at_end: bool
    embeddings: int
    tokens: int


def buffer_events(programs: Sequence[Sequence[Action]], first_device: int,
                  training: bool = True) -> tuple[tuple[BufferEvent, ...], ...]:
    """Per device, in program order, what the runtime (runtime/vocab_embedding.py) holds for the embedding:
    the first stage's device an embedding from its E's slot to its F(0, k) and a gradient from its B(0, k) to
    its D's slot; every device microbatch k's tokens from T(k) (one slot before E(k): :func:`token_slots`) to
    D(k)'s slot (to E(k) when not ``training``). Slot 0 is the start of a device's first pass, slot i the
    start of its i-th H (every device runs the H passes in one order), the last slot the call's end. The
    simulator's memory timeline and the planner's activation peaks count these beside the passes'."""
    slots = embedding_slots(programs[first_device], training)
    tokens_at = token_slots(slots)
    last = slots.num_slots - 1
    out = []
    for device, program in enumerate(programs):
        h_index = [i for i, action in enumerate(program) if action.kind is VocabKind.H]
        where = [0, *h_index, len(program)]  # slot -> program index (at that pass's start)
        events: list[BufferEvent] = []
        for slot in range(slots.num_slots):
            at = where[slot] if slot < last else len(program)
            sent = len(slots.grads[slot])  # D: the first stage's gradients go
            # A microbatch's tokens go once its D is done: at D's slot on the first stage's device, which sends
            # it; elsewhere at the next slot, which waits for it and adds the weight gradient (the last slot
            # settles its own too).
            if device == first_device:
                gone = sent
            else:
                gone = (len(slots.grads[slot - 1]) if slot else 0) + (sent if slot == last else 0)
            posted = len(tokens_at[slot]) + (len(slots.lookups[0]) if slot == 0 else 0)
            used = 0 if training else len(slots.lookups[slot])  # evaluating: E is the tokens' last use
            embeddings = (len(slots.lookups[slot]) - sent) if device == first_device else 0
            if embeddings or posted - gone - used:
                events.append(BufferEvent(at, False, embeddings, posted - gone - used))
        if device == first_device:
            for i, action in enumerate(program):
                if action.stage == 0 and action.kind is Kind.F:
                    events.append(BufferEvent(i, False, -1, 0))  # handed to F(0, k)
                elif action.stage == 0 and action.kind is Kind.B and training:
                    events.append(BufferEvent(i, True, 1, 0))  # its gradient, until D(k)
        events.sort(key=lambda e: (e.index, e.at_end))
        out.append(tuple(events))
    return tuple(out)


def send_events(programs: Sequence[Sequence[Action]], last_device: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per device, (program index, change) of the hidden gradient's send buffers a training call's H passes
    leave (runtime/vocab_h.py): every device but the last stage's (``last_device``, which receives the reduce)
    makes one at each H and lets it go once its reduce is waited, at the start of its next H (before that H
    makes its own) or at the start of G(k), whichever comes first; so it holds one at most. At the H's index
    the change is its own buffer less the ones it lets go."""
    out = []
    for device, program in enumerate(programs):
        changes: list[tuple[int, int]] = []
        if device != last_device:
            held: int | None = None  # the microbatch whose send buffer the device holds (one at most)
            for index, action in enumerate(program):
                if action.kind is VocabKind.H:
                    if held is None:
                        changes.append((index, 1))  # a held one is let go as this one is made: no change
                    held = action.microbatch
                elif action.kind is VocabKind.G and action.microbatch == held:
                    held = None
                    changes.append((index, -1))
        out.append(tuple(changes))
    return tuple(out)
