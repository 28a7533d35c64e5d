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
their B and the next H: a number the schedule bounds (about its warm-up), not m. The runtime
(runtime/vocab_embedding.py) and the lowering (exchange.py) both read :func:`embedding_slots`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..core.actions import Action, Kind, VocabKind


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
