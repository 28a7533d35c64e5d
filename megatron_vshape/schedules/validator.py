"""Validation of a schedule: completeness, dependency order, deadlock-free p2p."""

from __future__ import annotations

from collections import Counter

from .comm import check_plan, lower
from .dependencies import all_actions, dependencies
from .gc_pause import without_gc
from .schedule import Schedule, ScheduleError


class InvalidSchedule(ScheduleError):
    pass


@without_gc
def validate(schedule: Schedule) -> None:
    """Raise :class:`InvalidSchedule` (or a subclass of ScheduleError) if anything is wrong."""
    _check_complete(schedule)
    _check_local_order(schedule)
    check_plan(lower(schedule))


def _check_complete(schedule: Schedule) -> None:
    counts = Counter(a for program in schedule.programs for a in program)
    duplicated = [str(a) for a, n in counts.items() if n > 1]
    if duplicated:
        raise InvalidSchedule(f"{schedule.name}: actions scheduled more than once: {duplicated[:5]}")
    expected = all_actions(schedule.num_stages, schedule.num_microbatches)
    missing = expected - counts.keys()
    extra = counts.keys() - expected
    if missing or extra:
        raise InvalidSchedule(
            f"{schedule.name}: missing {sorted(map(str, missing))[:5]}, unexpected {sorted(map(str, extra))[:5]}"
        )
    for device, program in enumerate(schedule.programs):
        wrong = [str(a) for a in program if schedule.device_of(a) != device]
        if wrong:
            raise InvalidSchedule(f"{schedule.name}: device {device} runs stages it does not hold: {wrong[:5]}")


def _check_local_order(schedule: Schedule) -> None:
    for device, program in enumerate(schedule.programs):
        position = {a: i for i, a in enumerate(program)}
        for i, action in enumerate(program):
            for dep in dependencies(action, schedule.num_stages):
                j = position.get(dep)
                if j is not None and j > i:
                    raise InvalidSchedule(
                        f"{schedule.name}: device {device} runs {action} before its dependency {dep}"
                    )
