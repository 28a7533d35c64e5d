"""Actions: the atoms of every schedule.

An action is one pass (F, B or W) of one stage on one microbatch. Stages are *global* stage
indices (0 .. num_stages-1); which device runs a stage is the placement's business.
The text form is ``F3.7`` (kind, stage, ``.``, microbatch) and round-trips through
:func:`parse_action`.
"""

from __future__ import annotations

import enum
import re
from typing import NamedTuple


class Kind(enum.Enum):
    """Pass kind. ``B`` computes only the input gradient; ``W`` the weight gradients."""

    F = "F"
    B = "B"
    W = "W"

    def __str__(self) -> str:
        return self.value

    # Members are singletons: identity hashing is correct and, unlike Enum's default
    # (which hashes the name in Python), runs in C. Schedules hash millions of actions.
    __hash__ = object.__hash__


class Action(NamedTuple):
    """Immutable; a NamedTuple rather than a dataclass because schedules hold hundreds of
    thousands of actions as dict keys, and tuple hashing is done in C."""

    kind: Kind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.stage}.{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"


_ACTION_RE = re.compile(r"^\s*([FBW])(\d+)\.(\d+)\s*$")


def parse_action(text: str) -> Action:
    """Inverse of ``str(action)``: ``parse_action("B2.5") == Action(Kind.B, 2, 5)``."""
    match = _ACTION_RE.match(text)
    if match is None:
        raise ValueError(f"not an action: {text!r} (expected e.g. 'F0.3', 'B2.5', 'W1.0')")
    kind, stage, microbatch = match.groups()
    return Action(Kind(kind), int(stage), int(microbatch))


def F(stage: int, microbatch: int) -> Action:  # noqa: N802 - reads like the paper
    return Action(Kind.F, stage, microbatch)


def B(stage: int, microbatch: int) -> Action:  # noqa: N802
    return Action(Kind.B, stage, microbatch)


def W(stage: int, microbatch: int) -> Action:  # noqa: N802
    return Action(Kind.W, stage, microbatch)
