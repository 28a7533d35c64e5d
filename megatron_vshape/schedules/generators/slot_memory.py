"""Memory of one device in slot time (``slot_reorder``), counted with the shared ledger.

The slot reorder runs before any real cost is known, so every stage weighs alike: the changes
are the ledger's (:class:`ledger.MemoryLedger`) under the given :class:`MemoryModel` for one
uniform stage, in chunk activations (one F of one V chunk = 1; under the paper's model F adds 1,
B frees nothing, W frees 1, so every level is a whole number, exactly as the simulator counts).
"""

from __future__ import annotations

from typing import NamedTuple

from ..core.actions import Action, Kind
from ..core.ledger import MemoryLedger
from ..core.schedule import Costs, MemoryModel, Placement


class SlotDeltas(NamedTuple):
    """Memory change of one F, B and W on a device, in chunk activations."""

    f: float
    b: float
    w: float


def slot_deltas(placement: Placement, memory: MemoryModel = MemoryModel()) -> tuple[SlotDeltas, ...]:
    """Per device, the ledger's change of each kind (its stages weigh alike: uniform costs)."""
    ledger = MemoryLedger(placement, Costs(), memory, unit=2.0 / placement.layer_scale)
    out = []
    for stages in placement.stages_per_device:
        changes = {ledger.stage_deltas(stage) for stage in stages}
        if len(changes) != 1:  # cannot happen with uniform costs; the lazy W count relies on it
            raise AssertionError(f"stages {stages} of one device change memory differently: {changes}")
        out.append(SlotDeltas(*changes.pop()))
    return tuple(out)


def explicit_levels(row: list[Action | None], deltas: SlotDeltas) -> list[float]:
    """Memory after each slot when W passes are in the row (explicit)."""
    levels, level = [], 0.0
    f, b, w = deltas
    for action in row:
        if action is not None:
            kind = action.kind
            level += f if kind is Kind.F else b if kind is Kind.B else w
        levels.append(level)
    return levels


class LazyMemory:
    """Memory of one device when W is implicit (an idle slot runs the oldest pending W).

    Moving a pass from slot t into the idle slot s < t leaves the levels before s as they were,
    never raises a level from t on (the idle slot moves later, so Ws run no later), and raises a
    level in [s, t) by at most F - W for an F (the F itself, and a W that lost slot s) or
    max(B, 0) - W for a B (1 under the paper's model). ``upper`` keeps bounds that follow from
    this; only when a bound could break the budget is the device replayed exactly, from the
    first slot that may have changed.
    """

    def __init__(self, row: list[Action | None], budget: float, deltas: SlotDeltas) -> None:
        self.row = row
        self.budget = budget
        self.deltas = deltas
        self.rise_f, self.rise_b = deltas.f - deltas.w, max(deltas.b, 0.0) - deltas.w
        self.level: list[float] = [0.0] * len(row)
        self.pending: list[int] = [0] * len(row)
        self.exact_below = 0  # level/pending are exact for the slots below this one
        self.stopped_at = 0  # where the last replay stopped (the row's length: it ran to the end)
        self._replay(0)
        self.upper = list(self.level)

    def peak(self) -> float:
        return max(self.level, default=0.0)

    def _replay(self, start: int, stop_above: float = float("inf")) -> float:
        """Recompute level/pending from ``start`` on; return the highest level from there. With ``stop_above``:
        stop at the first level above it (and return it); the slots after it are then left as they were and
        ``exact_below`` is not raised (the caller of a rejected move lowers it to the move's slot)."""
        row, level_out, pending_out = self.row, self.level, self.pending
        f, b, w = self.deltas
        level = level_out[start - 1] if start else 0.0
        pending = pending_out[start - 1] if start else 0
        peak = level
        for s in range(start, len(row)):
            action = row[s]
            if action is None:
                if pending:
                    pending -= 1
                    level += w
            elif action.kind is Kind.F:
                level += f
                if level > peak:
                    peak = level
            elif action.kind is Kind.B:
                pending += 1
                level += b
                if level > peak:
                    peak = level
            level_out[s] = level
            pending_out[s] = pending
            if peak > stop_above:
                self.stopped_at = s
                return peak
        self.exact_below = self.stopped_at = len(row)
        return peak

    def accept(self, action: Action, target: int, current: int) -> bool:
        """Called with ``action`` already moved from ``current`` to ``target``: keep it there?"""
        rise = self.rise_f if action.kind is Kind.F else self.rise_b
        upper = self.upper
        if max(upper[target:current]) + rise <= self.budget:
            for s in range(target, current):
                upper[s] += rise
            self.exact_below = min(self.exact_below, target)
            return True
        start = min(self.exact_below, target)
        # A rejection needs only the first level over the budget: it is at or after ``target`` (the levels
        # before it hold an accepted order, within the budget), so the replay stops there.
        if self._replay(start, self.budget) <= self.budget:
            upper[start:] = self.level[start:]
            return True
        # The replay saw the move; slots below it (and below where the replay stopped) are still right.
        self.exact_below = min(target, self.stopped_at)
        return False
