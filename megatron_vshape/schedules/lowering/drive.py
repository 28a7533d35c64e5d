"""Running per-device programs in order when each step waits for tokens from other devices.

Shared by the simulator (tokens = finished passes) and the p2p check (tokens = sent messages).
Event driven: a device that cannot proceed registers as a waiter of the one missing token and is
woken when it appears, so the cost is linear in the number of steps.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Hashable, Iterable, Sequence


def drive(
    programs: Sequence[Sequence],
    needs: Callable[[int, object], Iterable[Hashable]],
    run: Callable[[int, object], Iterable[Hashable]],
) -> list[int]:
    """Advance every device through its program.

    ``needs(device, step)`` lists the tokens the step waits for; ``run(device, step)`` executes it
    and returns the tokens it produces. Returns each device's cursor: a device whose cursor is
    short of its program's length is stuck (a deadlock).
    """
    available: set = set()
    waiters: dict[Hashable, list[int]] = defaultdict(list)
    cursor = [0] * len(programs)
    queue = deque(range(len(programs)))
    while queue:
        device = queue.popleft()
        program = programs[device]
        while cursor[device] < len(program):
            step = program[cursor[device]]
            missing = next((t for t in needs(device, step) if t not in available), None)
            if missing is not None:
                waiters[missing].append(device)
                break
            for token in run(device, step):
                available.add(token)
                queue.extend(waiters.pop(token, ()))
            cursor[device] += 1
    return cursor
