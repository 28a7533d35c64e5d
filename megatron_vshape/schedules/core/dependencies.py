"""The data dependencies between passes: the single source of truth for simulator,
validator, p2p lowering and the greedy schedulers."""

from __future__ import annotations

from .actions import Action, Kind


def dependencies(action: Action, num_stages: int) -> tuple[Action, ...]:
    """Actions whose results ``action`` consumes.

    F(s) needs F(s-1). B(s) needs its own F(s) and the gradient from B(s+1) (the last stage
    starts the backward from its own loss). W(s) needs B(s).
    """
    s, m = action.stage, action.microbatch
    if action.kind is Kind.F:
        return (Action(Kind.F, s - 1, m),) if s > 0 else ()
    if action.kind is Kind.B:
        own = Action(Kind.F, s, m)
        return (own, Action(Kind.B, s + 1, m)) if s < num_stages - 1 else (own,)
    return (Action(Kind.B, s, m),)


def all_actions(num_stages: int, num_microbatches: int) -> set[Action]:
    return {
        Action(kind, stage, mb)
        for kind in Kind
        for stage in range(num_stages)
        for mb in range(num_microbatches)
    }
