"""Peak activation memory vs bubble: v-auto over a range of memory limits, with the fixed schedules
(V-Min, V-Half, V-ZB, 1F1B, ZB-1P, ZB-2P) as points. Prints the table it draws.

    python scripts/plot_frontier.py --stages 8 -o docs/frontier.png [--json FILE]

Memory is a fraction of 1F1B's peak on its worst device (1F1B = 1.0); one panel per cost set.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_vshape.schedules.core.schedule import Costs, ScheduleError
from megatron_vshape.schedules.core.simulator import simulate
from megatron_vshape.schedules.generators.adaptive import lowest_reachable_limit, v_auto
from megatron_vshape.schedules.generators.registry import get_schedule

BASELINES = ("1f1b", "zb-1p", "zb-2p", "v-min", "v-half", "v-zb")
DEFAULT_COSTS = ("f=1,b=1,w=1,comm=0", "f=1,b=1.1,w=0.9,comm=0.05")
MARKERS = {"1f1b": "s", "zb-1p": "^", "zb-2p": "v", "v-min": "D", "v-half": "P", "v-zb": "*"}
LABEL_OFFSETS = {"zb-1p": (8, -12), "v-zb": (-28, 6)}  # points; keeps the labels at memory 1.0 apart


@dataclass(frozen=True)
class Point:
    label: str  # schedule name, or the candidate v-auto chose
    limit: float | None  # v-auto's memory limit (fraction of 1F1B's peak); None for fixed schedules
    memory: float  # peak activation, fraction of 1F1B's peak (worst device)
    bubble: float


@dataclass(frozen=True)
class Panel:
    costs: str
    lowest_limit: float
    v_auto: list[Point]
    baselines: list[Point]


def _limits(low: float, high: float, step: float) -> list[float]:
    count = int(round((high - low) / step))
    return [round(low + i * step, 6) for i in range(count + 1)]


def build_panel(d: int, m: int, costs_text: str, limits: list[float]) -> Panel:
    costs = Costs.parse(costs_text)
    lowest = lowest_reachable_limit(d, m, costs)
    frontier = []
    for limit in limits:
        if limit < lowest:
            continue  # v-auto refuses it (the error names `lowest`)
        schedule = v_auto(d, m, costs, limit)
        result = simulate(schedule, costs)
        frontier.append(Point(schedule.meta["candidate"], limit, result.peak_memory_max / d, result.bubble_rate))
    baselines = []
    for name in BASELINES:
        result = simulate(get_schedule(name, d, m, costs), costs)
        baselines.append(Point(name, None, result.peak_memory_max / d, result.bubble_rate))
    return Panel(costs_text, lowest, frontier, baselines)


def print_table(d: int, m: int, panel: Panel) -> None:
    print(f"\nd={d} m={m} costs {panel.costs}  (lowest reachable limit {panel.lowest_limit:.3f})")
    print(f"{'schedule':<34} {'limit':>6} {'memory':>7} {'bubble':>7}")
    for point in panel.v_auto:
        print(f"{'v-auto: ' + point.label:<34} {point.limit:>6.2f} {point.memory:>7.3f} {point.bubble:>7.4f}")
    for point in panel.baselines:
        print(f"{point.label:<34} {'':>6} {point.memory:>7.3f} {point.bubble:>7.4f}")


def draw(d: int, m: int, panels: list[Panel], output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.8), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        limits = [p.limit for p in panel.v_auto]
        ax.step(limits, [p.bubble for p in panel.v_auto], where="post", color="tab:blue", alpha=0.5,
                linestyle="--", label="v-auto: bubble vs memory limit")
        ax.plot([p.memory for p in panel.v_auto], [p.bubble for p in panel.v_auto], "o", color="tab:blue",
                label="v-auto: schedule chosen (its peak)")
        for point in panel.baselines:
            ax.plot(point.memory, point.bubble, MARKERS[point.label], markersize=9, label=point.label)
            ax.annotate(point.label, (point.memory, point.bubble), textcoords="offset points",
                        xytext=LABEL_OFFSETS.get(point.label, (6, 4)),
                        fontsize=8)
        ax.set_title(f"d={d}, m={m}, costs {panel.costs}", fontsize=10)
        ax.set_xlabel("peak activation memory (x 1F1B's peak, worst device)")
        ax.set_ylabel("bubble rate")
        # The low-memory end (one microbatch at a time) has a bubble far above everything else:
        # clip it so the interesting region stays readable, and say so.
        top = 1.6 * max(p.bubble for p in panel.baselines if p.label != "zb-2p")
        clipped = [p for p in panel.v_auto if p.bubble > top]
        if clipped:
            first = min(clipped, key=lambda p: p.memory)
            ax.annotate(f"off scale: bubble {first.bubble:.2f} at memory {first.memory:.2f}\n"
                        f"(limits {min(p.limit for p in clipped):.2f}-{max(p.limit for p in clipped):.2f})",
                        (first.memory, top), textcoords="offset points", xytext=(4, -28), fontsize=8,
                        arrowprops={"arrowstyle": "->"})
        ax.set_ylim(0, top)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", "-d", type=int, default=8, help="pipeline devices (default 8)")
    parser.add_argument("--microbatches", "-m", type=int, default=None, help="microbatches (default 4 x stages)")
    parser.add_argument("--costs", nargs="+", default=list(DEFAULT_COSTS), metavar="f=1,b=1,w=1,comm=0",
                        help="one panel per cost set (default: equal costs and f=1,b=1.1,w=0.9,comm=0.05)")
    parser.add_argument("--limits", nargs=3, type=float, default=(0.3, 1.0, 0.02), metavar=("LOW", "HIGH", "STEP"),
                        help="memory limits swept for v-auto (default 0.3 1.0 0.02)")
    parser.add_argument("-o", "--output", type=Path, required=True, help="picture to write (.png/.svg/.pdf)")
    parser.add_argument("--json", type=Path, default=None, help="also write the points as JSON")
    args = parser.parse_args(argv)
    d = args.stages
    m = args.microbatches or 4 * d
    low, high, step = args.limits
    if d < 2 or m < 1 or not 0 < low <= high <= 1 or step <= 0:
        parser.error("need --stages >= 2, --microbatches >= 1 and 0 < LOW <= HIGH <= 1, STEP > 0")
    try:
        panels = [build_panel(d, m, text, _limits(low, high, step)) for text in args.costs]
    except (ScheduleError, ValueError) as exc:
        print(f"plot_frontier: error: {exc}", file=sys.stderr)
        return 2
    for panel in panels:
        print_table(d, m, panel)
    draw(d, m, panels, args.output)
    print(f"\nwrote {args.output}")
    if args.json:
        args.json.write_text(json.dumps({"stages": d, "microbatches": m,
                                         "panels": [asdict(panel) for panel in panels]}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
