"""V-ZB built constructively, device program by device program, in rounds.

The idea (from the paper authors' V-ZB generator, re-implemented here): every pass is appended
to its device's program with its exact start time (program order, as the simulator runs it), so
the builder always knows how long a device would wait for the input of its next F or B. It
fills such waits with pending W passes, and moves a W *ahead* of the wait when the wait would
push this device's idle time above an allowance: the largest idle time seen on any device (a
device may idle as long as the worst one without lengthening the iteration). A second pass
reruns with each device's allowance set from the first run ("approved bubble"), which lets
devices that idled less absorb more, and so on while it helps.

Phases: a warm-up of chunk-0 forwards sized by memory and by when the chunk-1 forward comes
back, a balancing step that gives each device at least the forwards of the one before it, then
rounds of (one B per device, one F per device), and the remaining W passes last.

Lanes: each device holds stage ``i`` (low, chunk 0) and stage ``2d-1-i`` (high, chunk 1).
F_LOW and B_HIGH take their input from device ``i-1``; F_HIGH and B_LOW from device ``i+1``
(the tip of the V, device ``d-1``, hands over locally). Ready times come from the shared rule
(``ready.ready_rule``) on the timing core's flat pass ids; each lane is one (kind, stage).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import repeat

from ..core.actions import Action, Kind
from ..core.inputs import EPS
from ..core.ledger import MemoryLedger
from ..core.ready import UNSET, ready_rule
from ..core.schedule import Costs, MemoryModel, Placement, Schedule, one_f_one_b_peak

F_LOW, F_HIGH, B_HIGH, B_LOW, W_HIGH, W_LOW = range(6)
_KIND = (Kind.F, Kind.F, Kind.B, Kind.B, Kind.W, Kind.W)
_KIND_INDEX = (0, 0, 1, 1, 2, 2)  # the timing core's kind index of each lane


class BuildFailed(Exception):
    """This variant cannot complete (a dependency or memory rule it relies on does not hold)."""


@dataclass(frozen=True)
class VzbVariant:
    fill_b: bool  # move a W ahead of a long wait before a B
    fill_f: bool  # ... and before an F


class _Builder:
    def __init__(self, d, m, costs: Costs, variant: VzbVariant, approved, cap_units, memory: MemoryModel):
        self.d, self.m, self.variant = d, m, variant
        self.comm = costs.comm
        costs.check_stages(2 * d, "v-zb")
        # Unequal stages: a device may get ahead of its inputs, so the phases skip (or place
        # upstream first) what is not ready instead of failing; equal stages never need it.
        self.uneven = not costs.uniform
        # Per device and lane: the time of the pass, and the memory change from the shared ledger
        # in chunk activations (unit 2: one F of one uniform chunk = 1; 1F1B's peak d units = 2d).
        placement = Placement.v_shape(d)
        self.ledger = MemoryLedger(placement, costs, memory, unit=2.0)
        self.cost, self.delta = [], []
        # End times on the timing core's flat pass ids; the pass id of (device, lane, mb) is
        # base[device][lane] + mb.
        self.base = []
        for device in range(d):
            stage = (device, 2 * d - 1 - device)
            lane_stage = (stage[0], stage[1], stage[1], stage[0], stage[1], stage[0])
            self.cost.append(tuple(costs.of(_KIND[lane], lane_stage[lane]) for lane in range(6)))
            self.delta.append(tuple(self.ledger.delta(_KIND[lane], lane_stage[lane]) for lane in range(6)))
            self.base.append(tuple((_KIND_INDEX[lane] * 2 * d + lane_stage[lane]) * m for lane in range(6)))
        self.cap = 2.0 * cap_units + EPS
        self.end = [UNSET] * (6 * d * m)
        self.ready_of = ready_rule([placement.device_of(stage) for stage in range(2 * d)], m, costs.comm)
        self.count = [[0] * 6 for _ in range(d)]
        self.now = [0.0] * d
        self.mem = self.ledger.level  # updated in place by put (the hot loop), read by the ledger
        self.idle = [0.0] * d
        self.max_idle = 0.0  # max(self.idle), kept up to date (asked for before every F and B)
        self.pending_w: list[deque] = [deque() for _ in range(d)]
        self.programs: list[list[tuple[int, int]]] = [[] for _ in range(d)]
        self.approved = approved
        self.max_approved = max(approved) if approved else -1.0

    # -- primitives ------------------------------------------------------------------------
    def put(self, device: int, lane: int, ready: float | None = None) -> None:
        """Append (lane, next microbatch) to ``device``'s program. ``ready``: the shared rule's
        ready time of that pass, when the caller has asked it already."""
        # The hot spot of the builder (every pass, several runs): locals, one call (the rule).
        count = self.count[device]
        mb = count[lane]
        if mb >= self.m:
            raise BuildFailed("lane exhausted")
        mem = self.mem[device] + self.delta[device][lane]
        if mem > self.cap:
            raise BuildFailed("memory cap")
        x = self.base[device][lane] + mb
        if ready is None:
            ready = self.ready_of(x, self.end)
        if ready < 0:
            raise BuildFailed(f"input of lane {lane} mb {mb} on device {device} not placed")
        start = self.now[device]
        if ready > start:  # (a local input has ended by ``start``: only another device's waits)
            if self.programs[device]:
                idle = self.idle[device] + ready - start
                self.idle[device] = idle
                if idle > self.max_idle:
                    self.max_idle = idle
            start = ready
        end = start + self.cost[device][lane]
        self.end[x] = end
        self.now[device] = end
        self.mem[device] = mem
        count[lane] = mb + 1
        self.programs[device].append((lane, mb))
        if lane == B_HIGH:
            self.pending_w[device].append(W_HIGH)
        elif lane == B_LOW:
            self.pending_w[device].append(W_LOW)

    def put_w(self, device: int) -> None:
        if not self.pending_w[device]:
            raise BuildFailed("no W to free memory")
        # A pending W's one input is its own B, already run on this device: by the shared rule
        # it is ready when the device is free (asking the rule for each W cost ~8 % of a build).
        self.put(device, self.pending_w[device].popleft(), self.now[device])

    def allowance(self, device: int) -> float:
        worst = self.max_idle
        if self.approved:
            worst = max(worst, self.max_approved - self.approved[device])
        return worst - self.idle[device]

    def put_with_fill(self, device: int, lane: int, move_w_ahead: bool) -> None:
        """Fill the wait before (lane) with W passes; move one more W ahead if the wait is long."""
        while self.mem[device] + self.delta[device][lane] > self.cap:
            self.put_w(device)
        ready = self.ready_of(self.base[device][lane] + self.count[device][lane], self.end)
        pending = self.pending_w[device]
        if ready > self.now[device]:  # a wait for another device: fill it (< 0: put fails)
            cost = self.cost[device]
            while pending and ready >= self.now[device] + cost[pending[0]]:
                self.put_w(device)
            if pending and move_w_ahead and ready - self.now[device] > self.allowance(device):
                self.put_w(device)
        self.put(device, lane, ready)  # placing W did not move this pass's inputs

    def placed(self, device: int, lane: int, mb: int) -> bool:
        return 0 <= device < self.d and self.end[self.base[device][lane] + mb] != UNSET  # mb < m

    # -- phases ----------------------------------------------------------------------------
    def warm_up(self) -> None:
        d, m = self.d, self.m
        for i in range(d):
            self.put(i, F_LOW)
        for i in range(d - 1, -1, -1):
            if i < d - 1:
                back = self.end[self.base[i + 1][F_HIGH]] + self.comm
                # Chunk-0 forwards while they fit (keeping room for the chunk-1 forwards that
                # the i+1 devices closer to the start hold) and end before chunk 1 returns.
                room = (i + 1) * (self.delta[i][F_LOW] + self.delta[i][F_HIGH])
                while (
                    self.mem[i] + room <= self.cap
                    and self.now[i] + self.cost[i][F_LOW] <= back
                    and self.count[i][F_LOW] < m
                ):
                    for j in range(i + 1):
                        self.put(j, F_LOW)
            self.put(i, F_HIGH)
        lane = F_LOW
        for i in range(1, d):
            c, p = self.count[i], self.count[i - 1]
            while c[F_LOW] + c[F_HIGH] < p[F_LOW] + p[F_HIGH] or c[F_HIGH] <= p[F_HIGH] < m:
                for j in range(d - 1, i - 1, -1):
                    if self.count[j][lane] < m:
                        if self.uneven:
                            self.place_forward_inputs(j, lane, self.count[j][lane])
                        self.put(j, lane)
                lane = F_HIGH if lane == F_LOW else F_LOW

    def place_forward_inputs(self, device: int, lane: int, mb: int) -> None:
        """Place, upstream first, the forwards that forward (lane, mb) of ``device`` needs: the
        warm-up sizes devices by time, and a slow first stage leaves later devices short."""
        if lane == F_LOW:
            source = (device - 1, F_LOW) if device > 0 else None
        else:
            source = (device + 1, F_HIGH) if device < self.d - 1 else (device, F_LOW)
        if source is None:
            return
        src_device, src_lane = source
        while self.count[src_device][src_lane] <= mb:
            self.place_forward_inputs(src_device, src_lane, self.count[src_device][src_lane])
            self.put(src_device, src_lane)

    def inputs_ready(self, device: int, lane: int) -> bool:
        """Whether (lane, next microbatch) of ``device`` has its inputs placed (always true with
        equal stages, where the rounds keep the devices in step)."""
        if not self.uneven:
            return True
        mb = self.count[device][lane]
        return mb >= self.m or self.ready_of(self.base[device][lane] + mb, self.end) >= 0

    def fits(self, device: int, lane: int) -> bool:
        """Whether (lane) fits the cap once every pending W of ``device`` has run (with unequal
        stages a device can fill its memory with forwards before its backwards come back)."""
        if not self.uneven:
            return True
        delta = self.delta[device]
        return self.mem[device] + delta[lane] + sum(delta[w] for w in self.pending_w[device]) <= self.cap

    def backward_round(self) -> None:
        d = self.d
        low_next, high_next = [], []
        for i in range(d):
            c = self.count[i]
            if c[B_HIGH] >= self.m and c[B_LOW] >= self.m:
                continue
            if c[B_LOW] >= c[B_HIGH]:
                high_next.append(i)
            elif i == d - 1 or c[B_HIGH] >= self.m or self.placed(i + 1, B_LOW, c[B_LOW]):
                low_next.append(i)
            else:
                high_next.append(i)
        for i in reversed(low_next):
            if self.inputs_ready(i, B_LOW):
                self.put_with_fill(i, B_LOW, True)
        for i in high_next:
            if self.inputs_ready(i, B_HIGH):
                self.put_with_fill(i, B_HIGH, self.variant.fill_b)

    def forward_round(self) -> None:
        d, m = self.d, self.m
        for i in range(d):
            c = self.count[i]
            if c[F_HIGH] >= m:
                continue
            if c[F_HIGH] >= c[F_LOW]:
                lane = F_LOW
            elif i == d - 1 or self.placed(i + 1, F_HIGH, c[F_HIGH]):
                lane = F_HIGH
            elif c[F_LOW] < m and (i == 0 or self.placed(i - 1, F_LOW, c[F_LOW])):
                lane = F_LOW
            else:
                continue
            if self.inputs_ready(i, lane) and self.fits(i, lane):
                self.put_with_fill(i, lane, self.variant.fill_f)

    def build(self) -> None:
        self.warm_up()
        for _ in range(2 * self.m * (2 if self.uneven else 1)):
            self.backward_round()
            self.forward_round()
        for i in range(self.d):
            while self.pending_w[i]:
                self.put_w(i)
            if any(self.count[i][lane] != self.m for lane in range(6)):
                raise BuildFailed("incomplete")


def _run(d, m, costs, variant, approved, cap_units, memory) -> _Builder:
    builder = _Builder(d, m, costs, variant, approved, cap_units, memory)
    builder.build()
    return builder


def build_v_zb(
    num_devices: int,
    num_microbatches: int,
    costs: Costs,
    variant: VzbVariant,
    cap_units: float | None = None,
    memory: MemoryModel = MemoryModel(),
    max_rounds: int = 8,
) -> Schedule | None:
    """The V-ZB schedule of one variant, refined with approved idle times; None if it fails."""
    d, m = num_devices, num_microbatches
    cap = one_f_one_b_peak(d, costs) if cap_units is None else cap_units
    try:
        best = _run(d, m, costs, variant, None, cap, memory)
    except BuildFailed:
        return None
    for _ in range(max_rounds):
        if best.max_idle <= 0.0:
            break  # no idle time at all: nothing to approve
        try:
            again = _run(d, m, costs, variant, list(best.idle), cap, memory)
        except BuildFailed:
            break
        if again.max_idle >= best.max_idle - EPS:
            break
        best = again
    return _to_schedule(best, d, m)


def _to_schedule(builder: _Builder, d: int, m: int) -> Schedule:
    placement = Placement.v_shape(d)
    make = tuple.__new__  # Action(...) without the NamedTuple's Python-level __new__: 2x faster here
    programs = []
    for device, program in enumerate(builder.programs):
        low, high = placement.stages_per_device[device]
        stage = (low, high, high, low, high, low)
        lanes, mbs = zip(*program) if program else ((), ())
        # Column-wise in C (a generator per pass cost ~0.1 s a build at d=64, m=512).
        fields = zip(map(_KIND.__getitem__, lanes), map(stage.__getitem__, lanes), mbs)
        programs.append(tuple(map(make, repeat(Action), fields)))
    return Schedule("v-zb", placement, m, tuple(programs))


VARIANTS = tuple(VzbVariant(fill_b, fill_f) for fill_b in (True, False) for fill_f in (True, False))

