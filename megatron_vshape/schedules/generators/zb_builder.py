"""ZB-1P / ZB-2P built constructively on the looped placement, one microbatch round at a time.

The idea (from the paper authors' ZB generator, re-implemented here): every pass is appended to
its device's program with its exact start time, so the builder knows how long a device would
wait for its next input. Round 0 places a warm-up of forwards per device, sized by memory and
by when the backward of the first microbatch comes back. Every later round places at most one F
per device (first to last stage) and one B per device (last to first), filling waits with
pending W passes; a device may also skip its F when the next stage is far behind (``prioritize_b``),
and moves a W ahead of a wait that is longer than its idle-time allowance (the largest idle
time of any device minus its own). The remaining W passes go last.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.actions import Action, Kind
from ..core.inputs import EPS
from ..core.ledger import MemoryLedger
from ..core.ready import UNSET, ready_rule
from ..core.schedule import Costs, MemoryModel, Placement, Schedule

_F, _B, _W = 0, 1, 2
_KIND = (Kind.F, Kind.B, Kind.W)


class BuildFailed(Exception):
    """This variant cannot complete under the memory cap."""


@dataclass(frozen=True)
class ZbVariant:
    bubble_before_first_b: bool  # warm-up: allow a forward that ends after the first B could start
    prioritize_b: bool  # skip an F when the next stage is two forwards behind and the F would delay it
    move_w_ahead: bool  # also move a W ahead of a wait within the idle-time allowance


VARIANTS = tuple(
    ZbVariant(a, b, c) for a in (True, False) for b in (True, False) for c in (True, False)
)


class _Builder:
    def __init__(self, d, m, costs: Costs, cap_units: float, variant: ZbVariant, memory: MemoryModel,
                 inflight_limits=None):
        self.d, self.m, self.variant = d, m, variant
        # Per device: most forwards whose B has not run (ZB-H1 keeps 1F1B's d - i); None: no limit.
        self.limits = inflight_limits
        self.comm = costs.comm
        costs.check_stages(d, "the looped zero-bubble schedule")
        # Per stage (= device): (F, B, W) time, one stage = two V chunks; memory change per kind
        # and level per device from the shared ledger (the simulator's count under ``memory``).
        self.cost = [tuple(2.0 * costs.of(kind, stage) for kind in _KIND) for stage in range(d)]
        placement = Placement.looped(d)
        self.ledger = MemoryLedger(placement, costs, memory)
        self.delta = [self.ledger.stage_deltas(stage) for stage in range(d)]
        self.cap = cap_units + EPS
        # End times on the timing core's flat pass ids, read by the shared ready-time rule.
        self.end = [UNSET] * (3 * d * m)
        self.ready_of = ready_rule([placement.device_of(stage) for stage in range(d)], m, costs.comm)
        self.count = [[0, 0, 0] for _ in range(d)]
        self.now = [0.0] * d
        self.mem = self.ledger.level  # updated in place by put (the hot loop), read by the ledger
        self.idle = [0.0] * d
        self.programs: list[list[tuple[int, int]]] = [[] for _ in range(d)]

    def pass_id(self, stage: int, kind: int, mb: int) -> int:
        return (kind * self.d + stage) * self.m + mb

    def put(self, stage: int, kind: int, ready: float | None = None) -> None:
        """Append (kind, next microbatch) to ``stage``'s program. ``ready``: the shared rule's
        ready time of that pass, when the caller has asked it already."""
        c = self.count[stage]
        mb = c[kind]
        if mb >= self.m or (kind == _B and c[_F] <= mb) or (kind == _W and c[_B] <= mb):
            raise BuildFailed("order")
        if self.mem[stage] + self.delta[stage][kind] > self.cap:
            raise BuildFailed("memory cap")
        start = self.now[stage]
        x = (kind * self.d + stage) * self.m + mb
        if ready is None:
            ready = self.ready_of(x, self.end)  # the shared rule; < 0: an input is not placed
        if ready < 0:
            raise BuildFailed("input not placed")
        if ready > start:
            if c[_F] > 0:
                self.idle[stage] += ready - start
            start = ready
        end = start + self.cost[stage][kind]
        self.end[x] = end
        self.now[stage] = end
        self.mem[stage] += self.delta[stage][kind]
        c[kind] += 1
        self.programs[stage].append((kind, mb))

    def pending_w(self, stage: int) -> bool:
        c = self.count[stage]
        return c[_W] < c[_B]

    def slack(self, stage: int) -> float:
        return max(self.idle) - self.idle[stage]

    def put_with_fill(self, stage: int, kind: int) -> None:
        while self.mem[stage] + self.delta[stage][kind] > self.cap:
            if not self.pending_w(stage):
                raise BuildFailed("memory cap")
            self.put(stage, _W)
        ready = self.ready_of((kind * self.d + stage) * self.m + self.count[stage][kind], self.end)
        if ready > self.now[stage]:  # a wait for an input from another stage: fill it (< 0: put fails)
            w = self.cost[stage][_W]
            while self.pending_w(stage) and self.now[stage] + w <= ready:
                self.put(stage, _W)
            if self.pending_w(stage) and self.now[stage] < ready:
                if ready - self.now[stage] > self.slack(stage) or self.variant.move_w_ahead:
                    self.put(stage, _W)
        self.put(stage, kind, ready)  # placing W did not move this pass's inputs

    def warm_up(self) -> None:
        d, m = self.d, self.m
        for j in range(d):
            self.put(j, _F)
        extra = [0] * d
        back = 0.0
        for j in range(d - 1, -1, -1):
            if j == d - 1:
                back = self.end[self.pass_id(j, _F, 0)] + self.cost[j][_B]
                continue
            f_cost, b_cost = self.cost[j][_F], self.cost[j][_B]
            mem, time = self.mem[j], self.now[j]
            while (
                self.count[j][_F] + extra[j] < m and mem + self.delta[j][_F] <= self.cap
                and (self.limits is None or self.count[j][_F] + extra[j] < self.limits[j])
            ):
                if self.variant.bubble_before_first_b:
                    if time + f_cost > back + self.comm:
                        break
                elif time >= back + self.comm:
                    break
                mem += self.delta[j][_F]
                time += f_cost
                extra[j] += 1
            back = max(time, back + self.comm) + b_cost
        for j in range(1, d):
            while extra[j] > 0 and extra[j] >= extra[j - 1] and self.count[j][_F] + extra[j] < m:
                extra[j] -= 1
        for j in range(d):
            for _ in range(extra[j]):
                self.put(j, _F)
        for j in range(d - 1, -1, -1):
            self.put(j, _B)

    def wants_forward(self, j: int) -> bool:
        c = self.count[j]
        if c[_F] >= self.m or (self.limits is not None and c[_F] - c[_B] >= self.limits[j]):
            return False
        if not (self.variant.prioritize_b and j + 1 < self.d and c[_F] >= self.count[j + 1][_F] + 2):
            return True
        f_cost, w_cost = self.cost[j][_F], self.cost[j][_W]
        next_done = self.now[j + 1] + self.cost[j + 1][_F] + self.cost[j + 1][_B] + self.comm
        if self.now[j] >= next_done:
            return False
        w_needed, mem, w_time = 0, self.mem[j] + self.delta[j][_F], 0.0
        while mem > self.cap and c[_W] + w_needed < c[_B]:
            w_needed += 1
            mem += self.delta[j][_W]
            w_time += w_cost
        if self.now[j] + f_cost + w_time <= next_done:
            return True
        return next_done - self.now[j] > self.slack(j)

    def round(self, i: int) -> None:
        d = self.d
        wanted = [self.wants_forward(j) for j in range(d)]
        for j in range(d - 2, -1, -1):
            wanted[j] = wanted[j] and wanted[j + 1]
        for j in range(d):
            if wanted[j]:
                self.put_with_fill(j, _F)
        for j in range(d - 1, -1, -1):
            if self.count[j][_B] != i:
                raise BuildFailed("round out of step")
            if j == 0 and self.count[j][_F] == self.m:
                while self.pending_w(j):
                    self.put(j, _W)
            self.put_with_fill(j, _B)

    def build(self) -> None:
        self.warm_up()
        for i in range(1, self.m):
            self.round(i)
        for j in range(self.d):
            while self.pending_w(j):
                self.put(j, _W)


def build_zb(
    num_devices: int,
    num_microbatches: int,
    costs: Costs,
    cap_units: float,
    variant: ZbVariant,
    name: str,
    memory: MemoryModel = MemoryModel(),
    inflight_limits=None,
) -> Schedule | None:
    """One variant's schedule on the looped placement, or None if it cannot fit the cap (or the
    per-device limits on forwards in flight)."""
    builder = _Builder(num_devices, num_microbatches, costs, cap_units, variant, memory, inflight_limits)
    try:
        builder.build()
    except BuildFailed:
        return None
    programs = tuple(
        tuple(Action(_KIND[kind], stage, mb) for kind, mb in program)
        for stage, program in enumerate(builder.programs)
    )
    return Schedule(name, Placement.looped(num_devices), num_microbatches, programs)
