"""Actions: the atoms of every schedule.

An action is one pass (F, B or W) of one stage on one microbatch. Stages are *global* stage
indices (0 .. num_stages-1); which device runs a stage is the placement's business.
The text form is ``F3.7`` (kind, stage, ``.``, microbatch) and round-trips through
:func:`parse_action`.

With vocabulary parallelism a schedule also holds the vocabulary passes (:class:`VocabKind`): their
"stage" is the vocabulary shard, which is the pipeline device that holds it (``H2.5``: shard 2's
output-layer pass of microbatch 5). They are a kind of their own so that every loop over the
transformer passes (``for kind in Kind``) stays what it is.
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


class VocabKind(enum.Enum):
    """The vocabulary passes of one shard (Yeung et al., MLSys 2025, here fused into one collective pass).

    ``H``: the output layer and the loss of one microbatch on this shard's rows: its logits, the
    softmax statistics gathered over every shard, the loss, and the shard's part of the final hidden
    state's input gradient, reduced to the last stage. A *collective* pass: every shard's H of one
    microbatch runs together (their collectives are one rendezvous of the pipeline group), so every
    device holds the H passes in the same order. ``G``: the shard's output-layer weight gradient, a
    W like any other (deferrable).
    """

    H = "H"
    G = "G"

    def __str__(self) -> str:
        return self.value

    __hash__ = object.__hash__  # singletons (see Kind)


class Action(NamedTuple):
    """Immutable; a NamedTuple rather than a dataclass because schedules hold hundreds of
    thousands of actions as dict keys, and tuple hashing is done in C."""

    kind: Kind | VocabKind
    stage: int  # a vocabulary pass: its shard (= the device that holds it)
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.stage}.{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"


_ACTION_RE = re.compile(r"^\s*([FBWHG])(\d+)\.(\d+)\s*$")
_KIND_OF_LETTER = {kind.value: kind for kind in (*Kind, *VocabKind)}


def parse_action(text: str) -> Action:
    """Inverse of ``str(action)``: ``parse_action("B2.5") == Action(Kind.B, 2, 5)``."""
    match = _ACTION_RE.match(text)
    if match is None:
        raise ValueError(f"not an action: {text!r} (expected e.g. 'F0.3', 'B2.5', 'W1.0', 'H1.0')")
    kind, stage, microbatch = match.groups()
    return Action(_KIND_OF_LETTER[kind], int(stage), int(microbatch))


class Pair(NamedTuple):
    """An overlapped F&B pair: one microbatch's F and another microbatch's B, run together on one device.

    DualPipe's and Megatron's combined 1F1B's unit of overlap: each pass's expert-parallel all-to-all runs
    under the other pass's compute. Text form ``F3.7&B5.2`` (forward first), round-tripping through
    :func:`parse_step`. A schedule keeps the two halves adjacent in its device's program, forward first
    (``Schedule.pairs`` names them): run one after the other they are a legal order of their own, so code
    that does not know pairs runs them serially.
    """

    forward: Action
    backward: Action

    def __str__(self) -> str:
        return f"{self.forward}&{self.backward}"

    def __repr__(self) -> str:
        return f"Pair({self})"


def parse_step(text: str) -> Action | Pair:
    """An action (``F0.3``) or a pair (``F0.3&B5.1``): the inverse of ``str`` of either."""
    forward, sep, backward = text.partition("&")
    if not sep:
        return parse_action(text)
    pair = Pair(parse_action(forward), parse_action(backward))
    if pair.forward.kind is not Kind.F or pair.backward.kind is not Kind.B:
        raise ValueError(f"not a pair: {text!r} (expected an F, '&', then a B, e.g. 'F0.3&B5.1')")
    return pair


def F(stage: int, microbatch: int) -> Action:  # noqa: N802 - reads like the paper
    return Action(Kind.F, stage, microbatch)


def B(stage: int, microbatch: int) -> Action:  # noqa: N802
    return Action(Kind.B, stage, microbatch)


def W(stage: int, microbatch: int) -> Action:  # noqa: N802
    return Action(Kind.W, stage, microbatch)


def H(shard: int, microbatch: int) -> Action:  # noqa: N802
    return Action(VocabKind.H, shard, microbatch)


def G(shard: int, microbatch: int) -> Action:  # noqa: N802
    return Action(VocabKind.G, shard, microbatch)
