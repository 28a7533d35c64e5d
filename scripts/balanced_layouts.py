"""Predicted MFU with the uniform (or the paper's) layer layout vs the balanced one, and a picture of
the work per device.

    python scripts/balanced_layouts.py [--json out.json] [--picture docs/balanced-layout.png] [--quick]

Rows: a Llama-3-8B-like model (32 layers, hidden 4096, vocabulary 128256, seq 8192; GPT-style
FFN 4h, no GQA) on 8 and 16 H100s as a pure pipeline (TP1, DP1, microbatch 1, 128 sequences per
iteration) under 1F1B, V-Half and V-ZB; and the paper's 98.5B rows (40 A100s), each on the
DP x TP x PP layout the planner picked for that schedule (docs/RESULTS.md, "best configuration
per schedule"). Where the layers do not split evenly (98.5B: 78 layers), the reference is the
paper's layout (embedding and head each take one layer's slot). Costs: `vshape plan`'s cost model
with its default calibration; per-stage work from FLOPs (:mod:`megatron_vshape.planner.balance`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_vshape.layout_flag import format_layout
from megatron_vshape.planner import CostModel, GPTModel, ParallelLayout, calibrate_efficiency, get_gpu, get_model
from megatron_vshape.planner.balance import device_work, placement_for, stage_work
from megatron_vshape.planner.cli import PAPER_F_MS
from megatron_vshape.planner.layer_layout_mfu import LayoutComparison, chunk_costs, compare_layouts

LLAMA = GPTModel("Llama-3-8B-like", 32, 4096, 32, 8192, 128256)
LLAMA_BATCH = 128  # sequences per iteration (about 1M tokens)


@dataclass(frozen=True)
class Case:
    setting: str
    model: GPTModel
    gpu: str
    schedule: str
    layout: ParallelLayout
    flash_attention: bool


def llama_cases() -> list[Case]:
    return [Case(f"Llama-3-8B-like, {pp} x H100, seq 8192", LLAMA, "h100", name, ParallelLayout(1, 1, pp, 1, LLAMA_BATCH), True)
            for pp in (8, 16) for name in ("1f1b", "v-half", "v-zb")]


# The planner's best layout per schedule for the paper's MFU rows (docs/RESULTS.md).
PAPER_ROWS = (
    (1024, 160, "1f1b", (1, 4, 10)), (1024, 160, "v-zb", (1, 2, 20)),
    (3072, 640, "1f1b", (1, 4, 10)), (3072, 640, "v-half", (1, 2, 20)), (3072, 640, "v-zb", (1, 4, 10)),
    (16384, 160, "v-half", (1, 8, 5)),
)


def paper_cases() -> list[Case]:
    return [Case(f"98.5B, 40 x A100, seq {seq}, batch {batch}", get_model("98.5b").with_seq(seq), "a100", name,
                 ParallelLayout(dp, tp, pp, 1, batch), True)
            for seq, batch, name, (dp, tp, pp) in PAPER_ROWS]


def cost_model(gpu: str) -> CostModel:
    efficiency = calibrate_efficiency(get_gpu("a100"), get_model("9.6b"), 4, PAPER_F_MS / 1e3)
    return CostModel(get_gpu(gpu), efficiency)


def run(cases: list[Case]) -> list[tuple[Case, LayoutComparison | str, float]]:
    """One row per case: the comparison, or the one-line error that stopped it."""
    out = []
    for case in cases:
        start = time.perf_counter()
        try:
            comparison = compare_layouts(case.schedule, case.model, cost_model(case.gpu), case.layout,
                                         case.flash_attention)
        except ValueError as error:  # ScheduleError included
            comparison = " ".join(str(error).split())
        out.append((case, comparison, time.perf_counter() - start))
        print(f"  {case.setting} {case.schedule}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return out


def table(results) -> str:
    lines = ["| setting | schedule | layout | reference layers | balanced layers | MFU reference | MFU balanced "
             "| speedup | search (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for case, c, seconds in results:
        if isinstance(c, str):
            lines.append(f"| {case.setting} | {case.schedule} | {case.layout} | error: {c} | | | | | {seconds:.1f} |")
            continue
        ref = f"{c.choice.reference_name} {format_layout(c.choice.reference_layers)}"
        lines.append(f"| {case.setting} | {case.schedule} | {c.layout} | {ref} | {format_layout(c.choice.layers_per_stage)} "
                     f"| {c.reference_mfu:.2%} | {c.balanced_mfu:.2%} | {c.reference_iteration / c.balanced_iteration:.3f} "
                     f"| {seconds:.1f} |")
    return "\n".join(lines)


def picture(results, path: Path) -> None:
    """Per-device work (F+B+W of one microbatch, in layers' worth) for the Llama rows at PP 8."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(case, c) for case, c, _ in results
            if case.model is LLAMA and case.layout.pp == 8 and not isinstance(c, str)]
    fig, axes = plt.subplots(1, len(rows), figsize=(4.2 * len(rows), 3.4), sharey=True, squeeze=False)
    for ax, (case, c) in zip(axes[0], rows):
        placement = placement_for(case.schedule, case.layout.pp)
        costs = chunk_costs(case.model, cost_model(case.gpu), case.layout)
        layer = (costs.f + costs.b + costs.w) * 2 * case.layout.pp / case.model.layers  # one layer's F+B+W
        devices = range(placement.num_devices)
        width = 0.4
        for offset, label, layers in ((-width / 2, c.choice.reference_name, c.choice.reference_layers),
                                      (width / 2, "balanced", c.choice.layers_per_stage)):
            work = device_work(stage_work(case.model, layers), placement, costs)
            ax.bar([d + offset for d in devices], [w / layer for w in work], width, label=label)
        ax.set_title(f"{case.schedule}, PP {case.layout.pp}: x{c.reference_iteration / c.balanced_iteration:.2f}")
        ax.set_xlabel("device")
        ax.set_xticks(list(devices))
    axes[0][0].set_ylabel("work per microbatch (layers' worth)")
    axes[0][0].legend()
    fig.suptitle(f"{LLAMA.name}: device 0 holds the embedding, and the LM head + loss (V) or device d-1 (1F1B)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write every row as JSON")
    parser.add_argument("--picture", type=Path, help="write the per-device work picture (matplotlib)")
    parser.add_argument("--quick", action="store_true", help="Llama-3-8B-like rows on 8 GPUs only (a smoke test)")
    args = parser.parse_args(argv)
    cases = [c for c in llama_cases() if c.layout.pp == 8] if args.quick else llama_cases() + paper_cases()
    results = run(cases)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps([{"setting": case.setting, "schedule": case.schedule, "seconds": seconds,
                                          **({"error": c} if isinstance(c, str) else c.to_json())}
                                         for case, c, seconds in results], indent=1) + "\n")
    if args.picture:
        picture(results, args.picture)
    return 0


if __name__ == "__main__":
    sys.exit(main())
