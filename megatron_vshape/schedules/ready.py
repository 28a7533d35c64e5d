"""The one ready-time rule: when the inputs of a pass are on its device.

F(s) needs F(s-1); B(s) its own F(s) and the gradient of B(s+1) (of W(s+1) when the backward is
fused: the gradient leaves only when that fused B+W ends); W(s) its own B(s). An input from
another device arrives ``comm`` after it ends. This is the rule of ``dependencies``, on the
timing core's flat pass ids (``(kind * num_stages + stage) * num_microbatches + microbatch``)
and flat end-time lists (a negative end: not placed yet).

The timing core, the greedy scheduler, the idle-filling reorder and the constructive
zero-bubble builders all call the function :func:`ready_rule` returns, so they cannot disagree.
It is a closure over two flat tables, indexed by ``pass_id // num_microbatches``: each pass
has at most two inputs, each an id offset and the delay its result takes to arrive. That is
as cheap as the per-lane tables the builders had (they run it for every pass they place).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["UNSET", "ReadyRule", "missing_input", "ready_rule"]

UNSET = -1.0  # end time of a pass not placed yet (any negative value reads as not placed)

# ready(pass_id, end) -> when its inputs are all on its device (>= 0), or -1 - the id of an
# input that is not placed yet (< 0).
ReadyRule = Callable[[int, Sequence[float]], float]


def missing_input(result: float) -> int:
    """The pass id a negative ``ready`` result says is missing."""
    return int(-1 - result)


def ready_rule(device_of: Sequence[int], num_microbatches: int, comm: float,
               fused_backward: bool = False) -> ReadyRule:
    """The ready-time function of a placement (``device_of[stage]``) for ``num_microbatches``."""
    num_stages, m = len(device_of), num_microbatches
    per_kind = num_stages * m
    grad = -(m + (per_kind if fused_backward else 0))  # B(s) waits for pass id x + m (+ per_kind)
    # first/second[k]: the input's id is pass_id - offset (0: no input); *_delay: its arrival.
    first, first_delay = [0] * (3 * num_stages), [0.0] * (3 * num_stages)
    second, second_delay = [0] * (3 * num_stages), [0.0] * (3 * num_stages)
    for stage, device in enumerate(device_of):
        if stage:
            first[stage] = m
            first_delay[stage] = comm if device_of[stage - 1] != device else 0.0
        first[num_stages + stage] = first[2 * num_stages + stage] = per_kind  # own F / own B
        if stage < num_stages - 1:
            second[num_stages + stage] = grad
            second_delay[num_stages + stage] = comm if device_of[stage + 1] != device else 0.0

    def ready(pass_id: int, end: Sequence[float]) -> float:
        k = pass_id // m
        at = 0.0
        offset = first[k]
        if offset:
            e = end[pass_id - offset]
            if e < 0:
                return -1.0 - (pass_id - offset)
            at = e + first_delay[k]
        offset = second[k]
        if offset:
            e = end[pass_id - offset]
            if e < 0:
                return -1.0 - (pass_id - offset)
            e += second_delay[k]
            if e > at:
                at = e
        return at

    return ready
