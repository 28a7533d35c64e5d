"""The simulation table of issue 43: the expert all-to-all hidden by overlapped F&B pairs.

For d pipeline devices, m = 4d microbatches, F = B = W = 1 and an all-to-all of ``a2a`` x F per F and per
B, each schedule's lost share of the makespan, split into bubble (idle) and exposed all-to-all, and its
peak activation memory (x 1F1B's). V-ZB, V-Half and V-Min appear without pairs (the family's order, every
all-to-all exposed) and with them (the registry's order under the a2a costs: pairs within the family's
memory bound); V-ZB also with pairs under DualPipeV's peak memory. References: DualPipeV and Megatron's
combined interleaved 1F1B (2 chunks per device).

    python scripts/a2a_overlap_table.py                # d = 4..16, a2a = 0.5 and 1 (markdown)
    python scripts/a2a_overlap_table.py --devices 4 8 --a2a 1
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_vshape.schedules.core.schedule import Costs, MemoryModel, Schedule  # noqa: E402
from megatron_vshape.schedules.core.simulator import SimulationResult, simulate  # noqa: E402
from megatron_vshape.schedules.generators.overlap_references import (  # noqa: E402
    combined_interleaved_1f1b,
    dualpipe_v,
)
from megatron_vshape.schedules.generators.pairing import with_pairs  # noqa: E402
from megatron_vshape.schedules.generators.registry import get_schedule  # noqa: E402
from megatron_vshape.schedules.lowering.validator import validate  # noqa: E402

MICROBATCHES_PER_DEVICE = 4


@dataclasses.dataclass(frozen=True)
class Row:
    """One simulated schedule: shares of its makespan (mean over devices) and its peak memory."""

    makespan: float
    bubble: float  # idle: neither compute nor exposed all-to-all
    exposed: float  # all-to-all that no compute hides
    peak: float  # x 1F1B's peak activation
    pairs: int

    @property
    def lost(self) -> float:
        return self.bubble + self.exposed

    def cell(self) -> str:
        return f"{100 * self.lost:.1f} = {100 * self.bubble:.1f} + {100 * self.exposed:.1f} @ {self.peak:.3g}"


def row_of(result: SimulationResult) -> Row:
    n = len(result.work_each)
    busy, exposed = sum(result.work_each) / n, sum(result.exposed_a2a) / n
    return Row(result.makespan, 1 - busy / result.makespan, exposed / result.makespan,
               result.peak_memory_max / result.schedule.num_devices, len(result.schedule.pairs))


def columns(d: int, m: int, costs: Costs) -> dict[str, Callable[[], Schedule]]:
    dual = dualpipe_v(d, m)
    dual_peak = simulate(dual, costs).peak_memory_max
    v_zb = get_schedule("v-zb", d, m)
    return {
        "DualPipeV": lambda: dual,
        "combined I-1F1B": lambda: combined_interleaved_1f1b(d, m),
        "V-ZB": lambda: v_zb,
        "V-ZB + pairs": lambda: get_schedule("v-zb", d, m, costs),
        "V-ZB + pairs @ DualPipeV mem": lambda: with_pairs(v_zb, costs, MemoryModel(), [dual_peak + 1e-9] * d),
        "V-Half": lambda: get_schedule("v-half", d, m),
        "V-Half + pairs": lambda: get_schedule("v-half", d, m, costs),
        "V-Min": lambda: get_schedule("v-min", d, m),
        "V-Min + pairs": lambda: get_schedule("v-min", d, m, costs),
    }


def table(devices: list[int], ratios: list[float]) -> tuple[list[str], list[tuple[int, float, dict[str, Row]]]]:
    out, names = [], []
    for a2a in ratios:
        costs = Costs(a2a=a2a)
        for d in devices:
            m = MICROBATCHES_PER_DEVICE * d
            rows = {}
            for name, build in columns(d, m, costs).items():
                schedule = build()
                validate(schedule)
                rows[name] = row_of(simulate(schedule, costs))
            names = list(rows)
            out.append((d, a2a, rows))
    return names, out


def markdown(names: list[str], rows) -> str:
    lines = ["| a2a | d | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for d, a2a, cells in rows:
        lines.append(f"| {a2a:g} | {d} | " + " | ".join(cells[name].cell() for name in names) + " |")
    return "\n".join(lines)


def verdict(rows) -> str:
    """Where V-ZB with pairs is at or below DualPipeV's lost share, at its own and at DualPipeV's memory."""
    own = [(d, a2a) for d, a2a, cells in rows if cells["V-ZB + pairs"].lost <= cells["DualPipeV"].lost + 1e-12]
    at_dual = [(d, a2a) for d, a2a, cells in rows
               if cells["V-ZB + pairs @ DualPipeV mem"].lost <= cells["DualPipeV"].lost + 1e-12
               and cells["V-ZB + pairs @ DualPipeV mem"].peak <= cells["DualPipeV"].peak + 1e-12]
    return (f"V-ZB + pairs at or below DualPipeV's lost share: {len(own)} of {len(rows)} cells at V-ZB's own "
            f"memory (1F1B's peak); {len(at_dual)} of {len(rows)} at DualPipeV's peak memory or less")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=list(range(4, 17)))
    parser.add_argument("--a2a", type=float, nargs="+", default=[0.5, 1.0], help="all-to-all per F and B, x F")
    args = parser.parse_args(argv)
    names, rows = table(args.devices, args.a2a)
    print("Cells: lost % of the makespan = bubble % + exposed all-to-all %, @ peak activation memory x 1F1B's. "
          f"m = {MICROBATCHES_PER_DEVICE}d, F = B = W = 1.")
    print()
    print(markdown(names, rows))
    print()
    print(verdict(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
