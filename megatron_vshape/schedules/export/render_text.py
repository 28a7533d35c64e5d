"""Text grid of a simulated schedule: one row per device, one column per time quantum."""

from __future__ import annotations

import math

from ..core.inputs import EPS
from ..core.simulator import SimulationResult


def text_grid(result: SimulationResult, quantum: float | None = None, width: int = 4) -> str:
    """Each cell shows the pass running at that time (``F3.7``: F of stage 3, microbatch 7),
    ``.`` where the device idles. ``quantum`` defaults to the shortest pass."""
    timeline = result.timeline
    if not timeline:
        return ""
    if quantum is None:
        quantum = min(iv.end - iv.start for iv in timeline.values())
    columns = math.ceil(result.makespan_total / quantum - EPS)
    rows = [["." * 1] * columns for _ in range(result.schedule.num_devices)]
    # An overlapped pair's halves share one interval: its F takes the first half of the cells, its B the rest.
    halves = {half: i for pair in result.schedule.pairs for i, half in enumerate(pair)}
    for action, iv in timeline.items():
        first = int(round(iv.start / quantum))
        last = max(first + 1, int(round(iv.end / quantum)))
        if action in halves:
            middle = first + max(1, (last - first) // 2)
            first, last = (first, middle) if halves[action] == 0 else (middle, max(middle + 1, last))
        for col in range(first, min(last, columns)):
            rows[iv.device][col] = str(action)
    lines = []
    for device, cells in enumerate(rows):
        lines.append(f"d{device:<3}" + " ".join(cell.ljust(width) for cell in cells).rstrip())
    return "\n".join(lines)
