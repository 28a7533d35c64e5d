"""Hand-ordered baselines on the looped placement: GPipe, 1F1B and Megatron's interleaved 1F1B.

In these schedules W runs right after its B (the runtime fuses such a pair into one ordinary
backward), so they behave exactly like the originals.
"""

from __future__ import annotations

from ..core.actions import Action, Kind
from ..core.schedule import Placement, Schedule, ScheduleError


def _backward(stage: int, microbatch: int) -> list[Action]:
    return [Action(Kind.B, stage, microbatch), Action(Kind.W, stage, microbatch)]


def gpipe(num_devices: int, num_microbatches: int) -> Schedule:
    programs = []
    for device in range(num_devices):
        forwards = [Action(Kind.F, device, mb) for mb in range(num_microbatches)]
        backwards = [a for mb in range(num_microbatches) for a in _backward(device, mb)]
        programs.append(tuple(forwards + backwards))
    return Schedule("gpipe", Placement.looped(num_devices), num_microbatches, tuple(programs), fused_backward=True)


def one_f_one_b(num_devices: int, num_microbatches: int) -> Schedule:
    programs = []
    for device in range(num_devices):
        warmup = min(num_devices - 1 - device, num_microbatches)
        forwards = [Action(Kind.F, device, mb) for mb in range(num_microbatches)]
        backwards = [_backward(device, mb) for mb in range(num_microbatches)]
        programs.append(_one_f_one_b_order(forwards, backwards, warmup))
    return Schedule("1f1b", Placement.looped(num_devices), num_microbatches, tuple(programs), fused_backward=True)


def _one_f_one_b_order(forwards: list[Action], backwards: list[list[Action]], warmup: int) -> tuple:
    """Warm-up forwards, then alternate one forward / one backward, then drain backwards."""
    program = list(forwards[:warmup])
    steady = len(forwards) - warmup
    for k in range(steady):
        program.append(forwards[warmup + k])
        program.extend(backwards[k])
    for k in range(steady, len(backwards)):
        program.extend(backwards[k])
    return tuple(program)


def interleaved_one_f_one_b(num_devices: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    """Megatron's virtual-pipeline order (microbatches in groups of ``num_devices`` per chunk).

    Only for whole groups (``num_microbatches`` a multiple of ``num_devices``): the registry's
    check for interleaved-1f1b states that rule and ``get_schedule`` enforces it.
    """
    if chunks < 2:
        raise ScheduleError("interleaved-1f1b: --chunks must be >= 2 (use 1f1b for one chunk)")
    group = num_devices
    table = [
        (mb, chunk)
        for first in range(0, num_microbatches, group)
        for chunk in range(chunks)
        for mb in range(first, min(first + group, num_microbatches))
    ]
    total = len(table)
    programs = []
    for device in range(num_devices):
        forwards = [Action(Kind.F, chunk * num_devices + device, mb) for mb, chunk in table]
        backwards = [_backward((chunks - 1 - chunk) * num_devices + device, mb) for mb, chunk in table]
        warmup = min((num_devices - device - 1) * 2 + (chunks - 1) * group, total)
        programs.append(_one_f_one_b_order(forwards, backwards, warmup))
    placement = Placement.looped(num_devices, chunks)
    return Schedule(
        "interleaved-1f1b", placement, num_microbatches, tuple(programs), {"chunks": chunks}, fused_backward=True
    )
