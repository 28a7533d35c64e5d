"""One memory accounting for the generators and the simulator.

A schedule is capped under the same :class:`MemoryModel` it is reported under only if both
count alike. Here is that count: F allocates its stage's activation, B and W release it in the
shares the model says (``MemoryModel.delta``), each stage weighted by ``Costs.memory_of``.
A device runs its program in order, so its level after each pass in program order is the level
the simulator's timed memory timeline reports (F allocates at its start, B/W release at their
end, both after the previous pass ended): a generator that keeps every prefix within a cap keeps
the simulated peak within it.

Tables are flat and indexed like the timing core's durations (``kind * num_stages + stage``).
The ready-time rule is :mod:`ready`'s (``input_ready`` asks it about one pass).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .actions import Kind
from .inputs import EPS
from .ready import ready_rule
from .schedule import Costs, MemoryModel, Placement
from .schedule import stage_activation as activation  # one formula, shared with Schedule.activation
from .timing import KIND_INDEX, KINDS, PassIds, vocab_rows

__all__ = ["MemoryLedger", "activation", "input_ready", "pass_deltas"]


def pass_deltas(placement: Placement, costs: Costs, memory: MemoryModel = MemoryModel(),
                unit: float = 1.0) -> tuple[float, ...]:
    """Memory change of every (kind, stage), at index ``kind * num_stages + stage``.

    ``unit``: memory units per counted unit (2.0 counts V chunk activations: one uniform V
    F = 1; a power of two, so every count stays exactly the simulator's, scaled).
    With ``costs.vocab``, the vocabulary passes' kinds (H, G) follow at ``(3 + i) * num_stages + shard``.
    """
    stages = range(placement.num_stages)
    costs.check_stages(placement.num_stages)
    deltas = tuple(memory.delta(kind, activation(placement, stage, costs) * unit) for kind in KINDS for stage in stages)
    if costs.vocab is None:
        return deltas
    # Vocabulary passes (H then G, one shard per device): H allocates what its G frees. In units of one
    # microbatch over L/d layers, like stage_activation (one V chunk F is half of one).
    held = costs.vocab.shard_memory(placement.num_devices) / 2.0 * unit
    return deltas + vocab_rows((held, -held), placement.num_devices, placement.num_stages)


class MemoryLedger:
    """Activation level and peak of every device as passes are placed in program order."""

    def __init__(self, placement: Placement, costs: Costs, memory: MemoryModel = MemoryModel(),
                 unit: float = 1.0):
        self.num_stages = placement.num_stages
        self.deltas = pass_deltas(placement, costs, memory, unit)
        self.level = [0.0] * placement.num_devices
        self.peak = [0.0] * placement.num_devices

    def delta(self, kind: Kind, stage: int) -> float:
        return self.deltas[KIND_INDEX[kind] * self.num_stages + stage]

    def stage_deltas(self, stage: int) -> tuple[float, float, float]:
        """(F, B, W) change of ``stage``."""
        s = self.num_stages
        return self.deltas[stage], self.deltas[s + stage], self.deltas[2 * s + stage]

    def fits(self, device: int, amount: float, cap: float) -> bool:
        """Whether ``amount`` more on ``device`` stays within ``cap`` (to the shared tolerance)."""
        return self.level[device] + amount <= cap + EPS

    def apply(self, device: int, kind: Kind, stage: int) -> float:
        """Place one pass on ``device``; returns the new level."""
        level = self.level[device] + self.deltas[KIND_INDEX[kind] * self.num_stages + stage]
        self.level[device] = level
        if level > self.peak[device]:
            self.peak[device] = level
        return level

    def replay(self, programs: Iterable[Sequence]) -> tuple[float, ...]:
        """Peak of every device over its program (fresh levels), rounded as the simulator reports."""
        out = []
        for device, program in enumerate(programs):
            self.level[device] = self.peak[device] = 0.0
            for action in program:
                self.apply(device, action[0], action[1])
            out.append(round(self.peak[device], 9))
        return tuple(out)


def input_ready(pass_id: int, end: Sequence[float], ids: PassIds, device_of: Sequence[int],
                comm: float) -> float | None:
    """When the inputs of pass ``pass_id`` are all on its device, or None while one is missing.

    The shared rule (:func:`ready.ready_rule`) for one pass; loops build the rule once instead.
    ``end``: end time per pass id, ``UNSET`` where not yet placed.
    """
    ready = ready_rule(device_of, ids.num_microbatches, comm)(pass_id, end)
    return None if ready < 0 else ready
