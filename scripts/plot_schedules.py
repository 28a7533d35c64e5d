"""Pictures of every schedule: one timeline per schedule (like the paper's figures) and peak
activation memory versus bubble rate for all schedules at d = 8 and d = 16.

    python scripts/plot_schedules.py [--out docs] [--costs f=1,b=1,w=1,comm=0]

Writes docs/timeline-<schedule>.png (d=4, m=8) and docs/memory-vs-bubble.png, and prints the
numbers behind the second picture. Memory is the worst device's peak in units of one 1F1B
stage-microbatch (1F1B's peak is d); both come from the project's simulator.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_vshape.schedules.core.schedule import Costs, ScheduleError
from megatron_vshape.schedules.core.simulator import simulate
from megatron_vshape.schedules.export.render_plot import plot_schedule
from megatron_vshape.schedules.generators.registry import get_schedule, schedule_names

TIMELINE_SIZE = (4, 8)  # devices, microbatches: small enough to read every box
FRONTIER_DEVICES = (8, 16)
MICROBATCHES_PER_DEVICE = 3  # m = 3d: past the warm-up, still quick to generate
MARKERS = {"gpipe": "o", "1f1b": "s", "interleaved-1f1b": "X", "zb-h1": "<", "zb-1p": "^", "zb-2p": "v",
           "v-min": "D", "v-half": "P", "v-zb": "*"}


@dataclass(frozen=True)
class Point:
    schedule: str
    devices: int
    memory: float  # worst device's peak, 1F1B stage-microbatch units
    bubble: float


def fixed_schedules() -> list[str]:
    """Every registered schedule except adaptive ones, whose memory is an input, not a property."""
    return [name for name in schedule_names() if not name.startswith("v-auto")]


def timelines(out: Path, costs: Costs) -> list[Path]:
    devices, microbatches = TIMELINE_SIZE
    paths = []
    for name in fixed_schedules():
        result = simulate(get_schedule(name, devices, microbatches, costs), costs)
        paths.append(plot_schedule(result, out / f"timeline-{name}.png"))
    return paths


def frontier_points(costs: Costs) -> list[Point]:
    points = []
    for d in FRONTIER_DEVICES:
        for name in fixed_schedules():
            try:
                result = simulate(get_schedule(name, d, MICROBATCHES_PER_DEVICE * d, costs), costs)
            except ScheduleError:
                continue
            points.append(Point(name, d, result.peak_memory_max, result.bubble_rate))
    return points


def draw_frontier(points: list[Point], path: Path, costs: Costs) -> Path:
    from matplotlib.figure import Figure  # bare Figure: no pyplot global state

    fig = Figure(figsize=(11, 4.6), layout="constrained")
    for index, d in enumerate(FRONTIER_DEVICES):
        ax = fig.add_subplot(1, len(FRONTIER_DEVICES), index + 1)
        for p in (p for p in points if p.devices == d):
            ax.scatter(p.memory, 100 * p.bubble, marker=MARKERS.get(p.schedule, "o"), s=70, label=p.schedule)
            ax.annotate(p.schedule, (p.memory, 100 * p.bubble), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set_title(f"d = {d}, m = {MICROBATCHES_PER_DEVICE * d}")
        ax.set_xlabel("peak activation memory (1F1B stage-microbatches; 1F1B = d)")
        ax.set_ylabel("bubble rate (%)")
        ax.grid(alpha=0.3)
    fig.suptitle(f"Peak memory vs bubble, costs f={costs.f:g} b={costs.b:g} w={costs.w:g} comm={costs.comm:g}")
    fig.savefig(path, dpi=120)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs"), help="folder for the PNGs (default docs)")
    parser.add_argument("--costs", default="f=1,b=1,w=1,comm=0", help="simulator costs, e.g. f=1,b=1.1,w=0.9,comm=0.05")
    args = parser.parse_args(argv)
    try:
        costs = Costs.parse(args.costs)
    except ValueError as error:
        print(f"plot_schedules: error: {error}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    for path in timelines(args.out, costs):
        print(f"wrote {path}")
    points = frontier_points(costs)
    print(f"{'schedule':18s} {'d':>3s} {'peak memory':>12s} {'bubble':>8s}")
    for p in points:
        print(f"{p.schedule:18s} {p.devices:3d} {p.memory:12.2f} {p.bubble:8.2%}")
    print(f"wrote {draw_frontier(points, args.out / 'memory-vs-bubble.png', costs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
