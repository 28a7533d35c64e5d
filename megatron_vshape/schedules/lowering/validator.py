"""Validation of a schedule: completeness, dependency order, one order of the collective passes,
deadlock-free p2p."""

from __future__ import annotations

from collections import Counter

from ..core.actions import Kind, VocabKind
from ..core.dependencies import all_actions, dependencies
from ..core.gc_pause import without_gc
from ..core.schedule import Costs, Schedule, ScheduleError, VocabWork
from .messages import check_plan, lower


class InvalidSchedule(ScheduleError):
    pass


@without_gc
def validate(schedule: Schedule) -> None:
    """Raise :class:`InvalidSchedule` (or a subclass of ScheduleError) if anything is wrong."""
    _check_complete(schedule)
    _check_local_order(schedule)
    _check_collective_order(schedule)
    check_pairs(schedule)
    check_plan(lower(schedule))


def _check_complete(schedule: Schedule) -> None:
    counts = Counter(a for program in schedule.programs for a in program)
    duplicated = [str(a) for a, n in counts.items() if n > 1]
    if duplicated:
        raise InvalidSchedule(f"{schedule.name}: actions scheduled more than once: {duplicated[:5]}")
    expected = all_actions(schedule.num_stages, schedule.num_microbatches, schedule.vocab_shards)
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
            for dep in dependencies(action, schedule.num_stages, schedule.vocab_shards):
                j = position.get(dep)
                if j is not None and j > i:
                    raise InvalidSchedule(
                        f"{schedule.name}: device {device} runs {action} before its dependency {dep}"
                    )


def check_pairs(schedule: Schedule) -> None:
    """Each overlapped pair is an F and a B of one device, adjacent in its program, forward first (so the
    serial order is legal and the ledger counts the F's allocation before the B's release), each action in
    one pair at most, neither half needing the other's result (they run together), and the programs with
    the pairs as units do not deadlock (a pair waits for both halves' inputs before either starts)."""
    if not schedule.pairs:
        return
    position = {a: (device, i) for device, program in enumerate(schedule.programs) for i, a in enumerate(program)}
    used: Counter = Counter(a for pair in schedule.pairs for a in pair)
    twice = sorted(str(a) for a, n in used.items() if n > 1)
    if twice:
        raise InvalidSchedule(f"{schedule.name}: actions in more than one pair: {twice[:5]}")
    for pair in sorted(schedule.pairs, key=str):
        if pair.forward.kind is not Kind.F or pair.backward.kind is not Kind.B:
            raise InvalidSchedule(f"{schedule.name}: pair {pair} is not an F and a B")
        where, after = position.get(pair.forward), position.get(pair.backward)
        if where is None or after is None:
            raise InvalidSchedule(f"{schedule.name}: pair {pair} names an action the programs do not run")
        if after != (where[0], where[1] + 1):
            raise InvalidSchedule(f"{schedule.name}: pair {pair} is not its F then its B, adjacent on one device")
        for first, second in ((pair.forward, pair.backward), (pair.backward, pair.forward)):
            if _needs(second, first, schedule):
                raise InvalidSchedule(f"{schedule.name}: pair {pair} cannot overlap: {second} needs {first}'s result")
    # Deferred import: the simulator's timing core is the one place that runs programs with pairs as units.
    from ..core.simulator import DeadlockError, simulate

    try:
        simulate(schedule, Costs(vocab=VocabWork() if schedule.vocab_parallel else None))
    except DeadlockError as err:
        raise InvalidSchedule(f"{schedule.name}: the pairs deadlock the programs ({err})") from None


def _needs(action, ancestor, schedule: Schedule) -> bool:
    """Whether ``action`` consumes ``ancestor``'s result, directly or through other passes."""
    if action.microbatch != ancestor.microbatch:
        return False  # dependencies never cross microbatches
    seen, stack = set(), [action]
    while stack:
        for dep in dependencies(stack.pop(), schedule.num_stages, schedule.vocab_shards):
            if dep == ancestor:
                return True
            if dep not in seen:
                seen.add(dep)
                stack.append(dep)
    return False


def _check_collective_order(schedule: Schedule) -> None:
    """Every device meets the collective (H) passes in one order: the pipeline group's collectives are
    issued in that order on every rank, and NCCL pairs the n-th of one rank with the n-th of the others."""
    orders = [[a.microbatch for a in program if a.kind is VocabKind.H] for program in schedule.programs]
    for device, order in enumerate(orders[1:], start=1):
        if order != orders[0]:
            first = next((i for i, (a, b) in enumerate(zip(order, orders[0])) if a != b), min(len(order), len(orders[0])))
            raise InvalidSchedule(
                f"{schedule.name}: device {device} runs its vocabulary passes in another order than device 0 "
                f"(at H number {first}); the collectives need one order on every device")


# --- W-after-B order (Transformer Engine's deferred weight gradients) ------------------------------
#
# TE's linears with ``delay_wgrad_compute=True`` queue each backward's weight-gradient work first-in
# first-out per module, and ``backward_dw()`` pops the oldest entry: it cannot be told which
# microbatch to run. A module belongs to one stage, so a schedule can hand its W passes to TE only
# if, on every stage, the W passes run in the order of the B passes.


def w_order_breaks(schedule: Schedule) -> list[str]:
    """Stages whose W passes do not run in their B passes' order, one line each (empty: order kept).

    The program order of each device is the time order of its passes, and a stage lives on one device.
    """
    b_order: dict[int, list[int]] = {}
    w_order: dict[int, list[int]] = {}
    for program in schedule.programs:
        for action in program:
            if action.kind is Kind.B:
                b_order.setdefault(action.stage, []).append(action.microbatch)
            elif action.kind is Kind.W:
                w_order.setdefault(action.stage, []).append(action.microbatch)
    breaks = []
    for stage in sorted(b_order):
        bs, ws = b_order[stage], w_order.get(stage, [])
        if bs != ws:
            first = next(i for i, (b, w) in enumerate(zip(bs, ws + [None] * len(bs))) if b != w)
            breaks.append(f"stage {stage}: pass {first} of B is microbatch {bs[first]}, of W microbatch "
                          f"{ws[first] if first < len(ws) else 'none'}")
    return breaks


def keeps_w_order(schedule: Schedule) -> bool:
    """Whether every stage runs its W passes in the order of its B passes (TE's FIFO can serve them)."""
    return not w_order_breaks(schedule)
