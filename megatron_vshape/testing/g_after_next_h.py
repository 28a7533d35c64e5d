"""A schedule with every G(k) moved to right after the next H, on every rank (tests and the benchmark).

The generators (``schedules/generators/vocab_passes.py``) already run each G(k) after H(k+1) on every rank
but the last stage's (there right after H(k), or in an idle gap), so that g(k), the loss gradient G(k)
needs, rides with the next H's broadcast (``schedules/lowering/loss_grads.py``). This moves the last stage's
rank's G(k) after H(k+1) too, and any G that a hand-made order runs before the next H: the runtime, the
lowering and the NCCL model are checked on that order here as well, and
``scripts/bench_layout.py --g-after-next-h`` times it. Each moved G holds its inputs (its softmax shard and
hidden state) from H(k) until after H(k+1).
"""

from __future__ import annotations

from dataclasses import replace

from megatron_vshape.runtime.executor import ScheduleExecutor
from megatron_vshape.schedules.core.actions import VocabKind
from megatron_vshape.schedules.core.schedule import Schedule
from megatron_vshape.schedules.lowering.validator import validate


def g_after_next_h(schedule: Schedule) -> Schedule:
    """``schedule`` with each G(k) right after the H that follows H(k) (where it ran before that H); the G of
    the last H stays where it was."""
    holder = schedule.placement.device_of(schedule.num_stages - 1)
    order = [a.microbatch for a in schedule.programs[holder] if a.kind is VocabKind.H]
    after = dict(zip(order[1:], order))  # H(n) -> the k whose G goes right after it
    programs = []
    for program in schedule.programs:
        at = {(a.kind, a.microbatch): i for i, a in enumerate(program) if isinstance(a.kind, VocabKind)}
        moved = {k for n, k in after.items() if at[(VocabKind.G, k)] < at[(VocabKind.H, n)]}
        row = []
        for action in program:
            if action.kind is VocabKind.G and action.microbatch in moved:
                continue
            row.append(action)
            k = after.get(action.microbatch) if action.kind is VocabKind.H else None
            if k in moved:
                row.append(next(a for a in program if a.kind is VocabKind.G and a.microbatch == k))
        programs.append(tuple(row))
    return replace(schedule, programs=tuple(programs))


class GAfterNextHExecutor(ScheduleExecutor):
    """Runs the registry's schedule with every G(k) moved right after the next H (``executor_type``)."""

    def _build(self, num_devices, num_microbatches):
        schedule = g_after_next_h(super()._build(num_devices, num_microbatches))
        validate(schedule)
        return schedule
