"""Reference orders with overlapped F&B pairs, for the simulator's comparisons (not trainable schedules).

* :func:`dualpipe_v`: DeepSeek's DualPipeV ("cut-in-half" DualPipe) on the V placement, written from the
  public description of its order (the DualPipe repository's README and its eight steps per rank): warm-up
  forwards of chunk 0, then alternating chunks, a zero-bubble phase, the main phase of overlapped
  (F chunk 0 & B chunk 1) and (F chunk 1 & B chunk 0) pairs, and a drain that defers weight gradients
  into the cool-down. A backward that is not deferred runs its W right after it (DualPipe's full backward).
* :func:`combined_interleaved_1f1b`: Megatron's interleaved 1F1B as ``--overlap-moe-expert-parallel-comm``
  runs it (``combined_1f1b.py``): one more warm-up forward than the plain order, so that in every steady
  step the forward and the backward are independent, and each steady F runs overlapped with that step's
  backward (W right after: Megatron's backward is not split).

Both are built for the simulator's ``a2a`` costs; they are not in the registry (no executor runs them).
"""

from __future__ import annotations

from collections import deque

from ..core.actions import Action, Kind, Pair
from ..core.schedule import Placement, Schedule, ScheduleError
from . import baselines


class _Rank:
    """One rank's program as DualPipeV builds it: per-chunk microbatch counters and the deferred-W queue."""

    def __init__(self, stages: tuple[int, int]):
        self.stages = stages
        self.next_forward = [0, 0]
        self.next_backward = [0, 0]
        self.deferred: deque[Action] = deque()  # W of zero-bubble backwards, first in first out
        self.program: list[Action] = []
        self.pairs: list[Pair] = []

    def forward(self, chunk: int) -> Action:
        action = Action(Kind.F, self.stages[chunk], self.next_forward[chunk])
        self.next_forward[chunk] += 1
        self.program.append(action)
        return action

    def backward(self, chunk: int, defer_w: bool = False) -> Action:
        stage, microbatch = self.stages[chunk], self.next_backward[chunk]
        self.next_backward[chunk] += 1
        self.program.append(Action(Kind.B, stage, microbatch))
        w = Action(Kind.W, stage, microbatch)
        if defer_w:
            self.deferred.append(w)
        else:
            self.program.append(w)
        return Action(Kind.B, stage, microbatch)

    def weight(self) -> None:
        self.program.append(self.deferred.popleft())

    def overlapped(self, forward_chunk: int, backward_chunk: int) -> None:
        """F of one chunk and the full backward of the other, as one overlapped pair (W right after)."""
        forward = self.forward(forward_chunk)
        backward = self.backward(backward_chunk)
        self.pairs.append(Pair(forward, backward))


def dualpipe_v(num_devices: int, num_microbatches: int) -> Schedule:
    """DualPipeV's order on ``num_devices`` ranks (V placement: rank r holds stages r and 2d-1-r) for
    ``num_microbatches`` >= 2d microbatches."""
    d, m = num_devices, num_microbatches
    if m < 2 * d:
        raise ScheduleError(f"dualpipe-v with {d} devices needs at least {2 * d} microbatches; got {m}")
    placement = Placement.v_shape(d)
    ranks = [_Rank(placement.stages_per_device[r]) for r in range(d)]
    for r, rank in enumerate(ranks):
        last = r == d - 1
        for _ in range((d - r - 1) * 2):  # 1: forwards of chunk 0
            rank.forward(0)
        for _ in range(r + 1):  # 2: chunk 0 and chunk 1 alternate
            rank.forward(0)
            rank.forward(1)
        for _ in range(d - r - 1):  # 3: zero bubble: B of chunk 1, a deferred W, F of chunk 1
            rank.backward(1, defer_w=True)
            rank.weight()
            rank.forward(1)
        for i in range(m - 2 * d + r + 1):  # 4, the main phase: two overlapped pairs
            if i == 0 and last:
                rank.forward(0)  # the last rank's first pair is not overlapped (DualPipe: less bubble)
                rank.backward(1)
            else:
                rank.overlapped(0, 1)
            rank.overlapped(1, 0)
        for _ in range(d - r - 1):  # 5: B of chunk 1, then an overlapped pair
            rank.backward(1)
            rank.overlapped(1, 0)
        defer = False
        for i in range(r + 1):  # 6: the last backwards; the second half defers its W
            if i == (r + 1) // 2 and r % 2 == 1:
                defer = True
            rank.backward(1, defer_w=defer)
            if i == (r + 1) // 2 and r % 2 == 0:
                defer = True
            rank.backward(0, defer_w=defer)
        for _ in range(d - r - 1):  # 7: a deferred W, then B of chunk 0 (its W deferred)
            rank.weight()
            rank.backward(0, defer_w=True)
        while rank.deferred:  # 8: the remaining W
            rank.weight()
    return Schedule("dualpipe-v", placement, m, tuple(tuple(rank.program) for rank in ranks),
                    pairs=frozenset(pair for rank in ranks for pair in rank.pairs))


def combined_interleaved_1f1b(num_devices: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    """Megatron's combined interleaved 1F1B: the interleaved order with one more warm-up forward, each steady
    F overlapped with the backward that follows it. ``num_microbatches``: a multiple of ``num_devices``."""
    d, m = num_devices, num_microbatches
    if m < d or m % d:
        raise ScheduleError(f"combined interleaved 1F1B with {d} devices needs a multiple of {d} microbatches; got {m}")
    plain = baselines.interleaved_one_f_one_b(d, m, chunks)  # its (microbatch, chunk) table, read from its order
    programs, pairs = [], []
    for device, program in enumerate(plain.programs):
        forwards = [a for a in program if a.kind is Kind.F]
        backwards = [a for a in program if a.kind is Kind.B]
        warmup = min((d - device - 1) * 2 + (chunks - 1) * d + 1, len(forwards))
        order = list(forwards[:warmup])
        for k, forward in enumerate(forwards[warmup:]):
            backward = backwards[k]
            order += [forward, backward, Action(Kind.W, backward.stage, backward.microbatch)]
            pairs.append(Pair(forward, backward))
        for backward in backwards[len(forwards) - warmup:]:
            order += [backward, Action(Kind.W, backward.stage, backward.microbatch)]
        programs.append(tuple(order))
    return Schedule("combined-interleaved-1f1b", plain.placement, m, tuple(programs), {"chunks": chunks},
                    fused_backward=True, pairs=frozenset(pairs))
