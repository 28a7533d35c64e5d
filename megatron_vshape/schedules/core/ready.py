"""The one ready-time rule: when the inputs of a pass are on its device.

F(s) needs F(s-1); B(s) its own F(s) and the gradient of B(s+1) (of W(s+1) when the backward is
fused: the gradient leaves only when that fused B+W ends); W(s) its own B(s). An input from
another device arrives ``comm`` after it ends. This is the rule of ``dependencies``, on the
timing core's flat pass ids (``(kind * num_stages + stage) * num_microbatches + microbatch``)
and flat end-time lists (a negative end: not placed yet).

The rule is one table (:func:`input_table`), indexed by ``pass_id // num_microbatches``: each
pass has at most two inputs, each an id offset and the delay its result takes to arrive. The
greedy scheduler, the idle-filling reorder and the constructive zero-bubble builders call the
function :func:`ready_rule` returns (a closure over the table); the timing core reads the same
table in its hot loop (it also needs the id of a missing input, and a call per pass there cost
the simulator about 20 %, several simulations per generated schedule).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

__all__ = ["UNSET", "InputTable", "ReadyRule", "input_table", "ready_rule"]

UNSET = -1.0  # end time of a pass not placed yet (any negative value reads as not placed)

# ready(pass_id, end) -> when its inputs are all on its device (>= 0), or -1 - the id of an
# input that is not placed yet (< 0).
ReadyRule = Callable[[int, Sequence[float]], float]


class InputTable(NamedTuple):
    """The rule as data, per ``k = pass_id // num_microbatches``: at most two inputs, the pass ids
    ``pass_id - first[k]`` and ``pass_id - second[k]`` (an offset of 0: no such input), whose
    results arrive ``first_delay[k]`` / ``second_delay[k]`` after they end."""

    num_microbatches: int
    first: tuple[int, ...]
    first_delay: tuple[float, ...]
    second: tuple[int, ...]
    second_delay: tuple[float, ...]


def input_table(device_of: Sequence[int], num_microbatches: int, comm: float,
                fused_backward: bool = False, vocab_shards: int = 0) -> InputTable:
    """The inputs of every (kind, stage) of a placement (``device_of[stage]``).

    ``vocab_shards`` > 0: the vocabulary passes too (kinds H and G after F, B, W; shard r on device r).
    Their collective inputs are not in the table: every shard's H of a microbatch starts together (the
    timing core's rendezvous), so only the last stage's device lists H's input (the last F, on it) and
    the last B's (its H, on it); G needs its own H and, on another device, the end of the last stage's
    device's H, which broadcasts the loss gradient G needs (a collective's result, not a message: a timing
    input only, not in ``dependencies``; where every shard's H takes as long, the two end together).
    """
    num_stages, m = len(device_of), num_microbatches
    per_kind = num_stages * m
    grad = -(m + (per_kind if fused_backward else 0))  # B(s) waits for pass id x + m (+ per_kind)
    kinds = 5 if vocab_shards else 3
    first, first_delay = [0] * (kinds * num_stages), [0.0] * (kinds * num_stages)
    second, second_delay = [0] * (kinds * num_stages), [0.0] * (kinds * num_stages)
    if vocab_shards:
        last = num_stages - 1
        holder = device_of[last]  # H of this shard is the one on the last stage's device
        first[3 * num_stages + holder] = (3 * num_stages + holder - last) * m  # H <- F(last)
        second[num_stages + last] = (num_stages + last - 3 * num_stages - holder) * m  # B(last) <- H
        for shard in range(vocab_shards):
            first[4 * num_stages + shard] = per_kind  # G <- its H
            if shard != holder:  # G <- the last stage's device's H (the loss gradient's broadcast)
                second[4 * num_stages + shard] = (num_stages + shard - holder) * m
    for stage, device in enumerate(device_of):
        if stage:
            first[stage] = m
            first_delay[stage] = comm if device_of[stage - 1] != device else 0.0
        first[num_stages + stage] = first[2 * num_stages + stage] = per_kind  # own F / own B
        if stage < num_stages - 1:
            second[num_stages + stage] = grad
            second_delay[num_stages + stage] = comm if device_of[stage + 1] != device else 0.0
    return InputTable(m, tuple(first), tuple(first_delay), tuple(second), tuple(second_delay))


def ready_rule(device_of: Sequence[int], num_microbatches: int, comm: float,
               fused_backward: bool = False) -> ReadyRule:
    """The ready-time function of a placement (``device_of[stage]``) for ``num_microbatches`` (the
    transformer passes: the generators' rule)."""
    m, first, first_delay, second, second_delay = input_table(device_of, num_microbatches, comm, fused_backward)

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
