"""The paper's building-block framework, as a public API.

A :class:`BuildingBlock` places every pass of *one* microbatch: for each (kind, stage) a start
slot. Microbatch k runs the same block shifted by ``k * interval``. From a block you get its
lifespans, its memory bound and its collisions, and :func:`schedule_from_block` turns it into a
schedule: repeat -> reorder the warm-up/cool-down (move passes into earlier idle slots while no
device's peak passes the block's largest; ``slot_reorder``) -> squeeze (the simulator runs each
device's order as soon as possible).

Writing a new schedule is a matter of writing offsets; see the README.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from .actions import Action, Kind
from .reorder import fill_idle
from .schedule import Costs, Placement, Schedule, ScheduleError
from .simulator import simulate
from .slot_reorder import has_early_cooldown, slot_schedule


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


# Above this many cells (devices x microbatches) only the slot reorder runs: the real-time
# reorder replays the whole schedule per look-ahead step and takes minutes at d=64, m=512.
_COMPARE_CELLS = 2048


def schedule_from_block(block: BuildingBlock, num_microbatches: int, costs: Costs, name: str) -> Schedule:
    """Repeat, squeeze and reorder.

    Two reorders of the warm-up and cool-down compete: the slot reorder (``slot_reorder``: in
    slot time, W lazily in idle slots, every device up to the largest peak of the repeated
    block) and the real-time idle filling (``fill_idle``: W at the block's slots, each device up
    to its own peak). The lower bubble under ``costs`` wins (then the lower peak). Either way no
    device exceeds the block's steady peak (``steady_peak``, W at the block's own slots): the slot
    reorder is dropped when its lazy W would need more. Above ``_COMPARE_CELLS`` only the slot
    reorder runs (it is the one that wins on long runs: measured d = 2..16, m = d..8d).
    """
    costs.check_stages(block.placement.num_stages, name)
    if not costs.uniform:
        return _weighted_from_block(block, num_microbatches, costs, name)
    slotted = slot_schedule(block, num_microbatches, name, max(block.steady_peak()))
    if slotted is None:  # lazy W needs more memory than the block's own W slots
        return _idle_filled(block, num_microbatches, costs, name)
    if block.placement.num_devices * num_microbatches > _COMPARE_CELLS:
        return slotted
    candidates = [slotted, _idle_filled(block, num_microbatches, costs, name)]
    if has_early_cooldown(block, num_microbatches):  # the authors' phases differ from ours there
        candidates.append(slot_schedule(block, num_microbatches, name, math.inf, early_cooldown=False))
    results = [simulate(c, costs) for c in candidates]
    best = min(range(len(candidates)), key=lambda i: (round(results[i].bubble_rate, 9), results[i].peak_memory_max, i))
    return candidates[best]


def _weighted_from_block(block: BuildingBlock, num_microbatches: int, costs: Costs, name: str) -> Schedule:
    """:func:`schedule_from_block` under per-stage memory: the slot reorder counts chunk
    activations, so each candidate's simulated (weighted) peak is checked against the block's
    weighted steady peak, and the plain repeated block stays as the fallback."""
    bound = max(block.steady_peak(costs)) + 1e-9
    candidates = [slot_schedule(block, num_microbatches, name, math.inf)]
    if block.placement.num_devices * num_microbatches <= _COMPARE_CELLS:
        candidates.append(_idle_filled(block, num_microbatches, costs, name))
        if has_early_cooldown(block, num_microbatches):
            candidates.append(slot_schedule(block, num_microbatches, name, math.inf, early_cooldown=False))
    candidates.append(block.repeat(num_microbatches, name))
    results = [simulate(c, costs) for c in candidates]
    fitting = [i for i, r in enumerate(results) if r.peak_memory_max <= bound] or [len(candidates) - 1]
    best = min(fitting, key=lambda i: (round(results[i].bubble_rate, 9), results[i].peak_memory_max, i))
    return candidates[best]


def _idle_filled(block: BuildingBlock, num_microbatches: int, costs: Costs, name: str) -> Schedule:
    """The repeated block with W at its own slots, idle time filled by ``fill_idle`` when that
    shortens the makespan under ``costs`` without raising any device's own peak."""
    repeated = block.repeat(num_microbatches, name)
    squeezed = simulate(repeated, costs)
    reordered, makespan, reached = fill_idle(
        repeated, costs, list(squeezed.peak_memory), lookahead=2 * block.placement.num_devices
    )
    fits = all(new <= old + 1e-9 for new, old in zip(reached, squeezed.peak_memory))
    return reordered if fits and makespan < squeezed.makespan - 1e-9 else repeated
