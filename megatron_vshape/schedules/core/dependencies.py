"""The data dependencies between passes: the single source of truth for simulator,
validator, p2p lowering and the greedy schedulers."""

from __future__ import annotations

from .actions import Action, Kind, VocabKind


def dependencies(action: Action, num_stages: int, vocab_shards: int = 0) -> tuple[Action, ...]:
    """Actions whose results ``action`` consumes.

    F(s) needs F(s-1). B(s) needs its own F(s) and the gradient from B(s+1) (the last stage
    starts the backward from its own loss). W(s) needs B(s).

    With vocabulary passes (``vocab_shards`` > 0, one shard per device): every shard's H of a
    microbatch needs the last stage's F (its final hidden state); the last stage's B needs every
    shard's H (the hidden state's gradient, summed over the shards) instead of a loss of its own; G
    needs its H. Between devices these travel in the pipeline group's collectives, not as messages.
    """
    s, m = action.stage, action.microbatch
    kind = action.kind
    if kind is Kind.F:
        return (Action(Kind.F, s - 1, m),) if s > 0 else ()
    if kind is Kind.B:
        own = Action(Kind.F, s, m)
        if s < num_stages - 1:
            return (own, Action(Kind.B, s + 1, m))
        return (own, *(Action(VocabKind.H, shard, m) for shard in range(vocab_shards)))
    if kind is Kind.W:
        return (Action(Kind.B, s, m),)
    if kind is VocabKind.H:
        return (Action(Kind.F, num_stages - 1, m),)
    return (Action(VocabKind.H, s, m),)


def all_actions(num_stages: int, num_microbatches: int, vocab_shards: int = 0) -> set[Action]:
    passes = {
        Action(kind, stage, mb)
        for kind in Kind
        for stage in range(num_stages)
        for mb in range(num_microbatches)
    }
    passes.update(Action(kind, shard, mb) for kind in VocabKind for shard in range(vocab_shards)
                  for mb in range(num_microbatches))
    return passes
