"""The paper's building-block framework, as a public API.

A :class:`BuildingBlock` places every pass of *one* microbatch: for each (kind, stage) a start
slot. Microbatch k runs the same block shifted by ``k * interval``. From a block you get its
lifespans, its memory bound and its collisions; :func:`fill_w` completes a block from its F and B
offsets. Turning a block into a schedule (repeat, reorder, squeeze) is ``block_schedule``'s job.

Writing a new schedule is a matter of writing offsets; see the README.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..core.actions import Action, Kind
from ..core.schedule import Costs, Placement, Schedule, ScheduleError


@dataclass(frozen=True)
class BuildingBlock:
    """Start slots of one microbatch's passes. Every pass lasts ``durations[kind]`` slots."""

    placement: Placement
    interval: int
    offsets: Mapping[tuple[Kind, int], int]
    durations: Mapping[Kind, int] = field(default_factory=lambda: {Kind.F: 1, Kind.B: 1, Kind.W: 1})

    def end(self, kind: Kind, stage: int) -> int:
        return self.offsets[(kind, stage)] + self.durations[kind]

    def lifespans(self) -> dict[int, int]:
        """Per stage: start of its F to the end of its W."""
        return {
            stage: self.end(Kind.W, stage) - self.offsets[(Kind.F, stage)]
            for stage in range(self.placement.num_stages)
        }

    def memory_bound(self, costs: Costs | None = None) -> list[float]:
        """Per device: sum over its stages of ceil(lifespan / interval) * activation (paper's bound),
        each stage's activation weighted by ``costs.memory_of(stage)`` when costs are given."""
        activation = self.placement.layer_scale / 2.0
        weight = _memory_weights(self.placement, costs)
        spans = self.lifespans()
        return [
            sum(math.ceil(spans[s] / self.interval) * activation * weight[s] for s in stages)
            for stages in self.placement.stages_per_device
        ]

    def steady_peak(self, costs: Costs | None = None) -> list[float]:
        """Per device: the exact peak activation when the block repeats forever (each stage's
        activation weighted by ``costs.memory_of(stage)`` when costs with per-stage memory are given)."""
        activation = self.placement.layer_scale / 2.0
        windows = [[(self.offsets[(Kind.F, s)], self.end(Kind.W, s)) for s in stages]
                   for stages in self.placement.stages_per_device]
        if costs is None or costs.uniform:
            return [steady_live(device, self.interval) * activation for device in windows]
        weight = _memory_weights(self.placement, costs)
        return [
            steady_live(device, self.interval, [weight[s] for s in stages]) * activation
            for device, stages in zip(windows, self.placement.stages_per_device)
        ]

    def collisions(self) -> list[str]:
        """Pairs of passes of one device that overlap modulo the interval, and broken dependencies."""
        problems = []
        for device, stages in enumerate(self.placement.stages_per_device):
            busy: dict[int, tuple[Kind, int]] = {}
            for stage in stages:
                for kind in Kind:
                    start = self.offsets[(kind, stage)]
                    for slot in range(start, start + self.durations[kind]):
                        other = busy.setdefault(slot % self.interval, (kind, stage))
                        if other != (kind, stage):
                            problems.append(
                                f"device {device}: {kind.value}{stage} collides with "
                                f"{other[0].value}{other[1]} at slot {slot % self.interval} (mod {self.interval})"
                            )
        problems.extend(self._broken_dependencies())
        return problems

    def _broken_dependencies(self) -> list[str]:
        problems = []
        last = self.placement.num_stages - 1
        for stage in range(last + 1):
            needs = [((Kind.B, stage), (Kind.F, stage)), ((Kind.W, stage), (Kind.B, stage))]
            if stage > 0:
                needs.append(((Kind.F, stage), (Kind.F, stage - 1)))
            if stage < last:
                needs.append(((Kind.B, stage), (Kind.B, stage + 1)))
            for (kind, s), (dep_kind, dep_s) in needs:
                if self.offsets[(kind, s)] < self.end(dep_kind, dep_s):
                    problems.append(f"{kind.value}{s} starts before {dep_kind.value}{dep_s} ends")
        return problems

    def repeat(self, num_microbatches: int, name: str) -> Schedule:
        """Each device's passes of all microbatches, ordered by start slot."""
        problems = self.collisions()
        if problems:
            raise ScheduleError(f"{name}: building block is invalid: {problems[0]}")
        programs = []
        for stages in self.placement.stages_per_device:
            timed = [
                (self.offsets[(kind, s)] + mb * self.interval, Action(kind, s, mb))
                for s in stages
                for kind in Kind
                for mb in range(num_microbatches)
            ]
            programs.append(tuple(action for _, action in sorted(timed)))
        return Schedule(name, self.placement, num_microbatches, tuple(programs))


def steady_live(windows, interval: int, weights=None):
    """Most copies of the windows [start, end) alive at once when each repeats every ``interval``
    (each window's copies counted ``weights[i]`` times when given)."""
    if weights is None:
        return max(
            sum((tau - start) // interval - (tau - end) // interval for start, end in windows)
            for tau in range(interval)
        )
    return max(
        sum(((tau - start) // interval - (tau - end) // interval) * weight
            for (start, end), weight in zip(windows, weights))
        for tau in range(interval)
    )


def _memory_weights(placement: Placement, costs: Costs | None) -> list[float]:
    if costs is None:
        return [1.0] * placement.num_stages
    costs.check_stages(placement.num_stages)
    return [costs.memory_of(stage) for stage in range(placement.num_stages)]


def fill_w(placement: Placement, interval: int, fb_offsets: Mapping[tuple[Kind, int], int]) -> BuildingBlock:
    """Complete a block given only F and B offsets: put each W in a free slot after its B,
    choosing per device the assignment with the lowest steady peak (then the shortest lifespans).

    Devices do not interact through W placement, so each is scored on its own stages only;
    that is what keeps enumerating hundreds of blocks (``v-auto``) affordable.
    """
    offsets = dict(fb_offsets)
    for stages in placement.stages_per_device:
        used = {fb_offsets[(k, s)] % interval for s in stages for k in (Kind.F, Kind.B)}
        free = [slot for slot in range(interval) if slot not in used]
        if len(free) < len(stages):
            raise ScheduleError(f"no free slot for W on a device holding stages {stages}")
        best, best_key = None, None
        for residues in itertools.permutations(free, len(stages)):
            w = {}
            for stage, residue in zip(stages, residues):
                after = fb_offsets[(Kind.B, stage)] + 1
                w[stage] = after + (residue - after) % interval
            windows = [(fb_offsets[(Kind.F, s)], w[s] + 1) for s in stages]
            key = (steady_live(windows, interval), sum(end - start for start, end in windows))
            if best_key is None or key < best_key:
                best, best_key = w, key
        offsets.update({(Kind.W, stage): slot for stage, slot in best.items()})
    return BuildingBlock(placement, interval, offsets)
