"""Measured peak activation memory per pipeline rank for every schedule, next to the simulator's.

    python scripts/bench_memory.py [--pp 4] [--microbatches 16] [--seq 256] [--json FILE]

Runs ``vshape verify``'s harness (megatron_vshape.testing.run_check): one process group of ``--pp``
CPU ranks (gloo) runs one training iteration of a megatron-core GPT (local spec, fp32, dropout off)
under each schedule with the vshape executor, checks the gradients against a single-process
reference, and measures each rank's peak activation bytes with the runtime's ActivationMeter (the
transformer layers' activations, i.e. what the schedules trade). The model is chosen so that layer
activations dominate: long-ish sequence, small hidden size and vocabulary.

For each schedule the table prints the measured bytes per rank, the simulator's predicted peak in
memory units (unit F/B/W costs) under two memory models, and the worst rank's ratio to 1F1B's worst
rank, measured and predicted:

* *paper*: the simulator's default (``MemoryModel()``): B frees nothing, W frees a microbatch's
  whole activation (what ``vshape verify`` prints);
* *gpt*: ``MemoryModel.for_gpt(hidden, heads, seq)``: B frees all but the linear layers' inputs that
  W still needs (the paper's per-token GPT accounting, 34h + 5as allocated, 32h kept for W).

``v-auto`` runs at ``--memory-limit`` (a fraction of 1F1B's peak).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

from megatron_vshape.testing import ModelSettings, RunSpec, run_check

DEFAULT_SCHEDULES = ("1f1b", "interleaved-1f1b", "gpipe", "zb-h1", "zb-1p", "zb-2p",
                     "v-min", "v-half", "v-zb", "v-auto")
BASELINE = "1f1b"
# Gradients must still match the single-process reference: a memory figure of a wrong run is worthless.
GRAD_TOLERANCE = 1e-5


@dataclass(frozen=True)
class MemoryRow:
    schedule: str
    peak_bytes: list[int]  # per pipeline rank
    predicted_units: list[float]  # per pipeline rank, simulator (unit costs), paper memory model
    predicted_units_gpt: list[float]  # same, GPT memory model (B frees all but W's inputs)
    measured_ratio: float  # worst rank / 1F1B's worst rank
    predicted_ratio: float
    predicted_ratio_gpt: float
    max_grad_rel_err: float


def gpt_model_peaks(spec: RunSpec) -> dict[str, list[float]]:
    """Per-rank simulated peaks of each schedule under the GPT memory model, as the executor built it."""
    from megatron_vshape.runtime import build_forward_backward_func
    from megatron_vshape.schedules.core.schedule import Costs, MemoryModel
    from megatron_vshape.schedules.core.simulator import simulate
    from megatron_vshape.schedules.generators.registry import SCHEDULES

    memory = MemoryModel.for_gpt(spec.model.hidden_size, spec.model.num_heads, spec.model.seq_length)
    peaks = {}
    for name in spec.schedules:
        limit = spec.memory_limit if SCHEDULES[name].takes_memory_limit else None
        schedule = build_forward_backward_func(name, memory_limit=limit).schedule(spec.pp, spec.microbatches)
        peaks[name] = list(simulate(schedule, Costs(), memory).peak_memory)
    return peaks


def make_rows(merged: dict, gpt_peaks: dict[str, list[float]]) -> list[MemoryRow]:
    """Table rows from run_check's merged results (which must include the 1F1B baseline)."""
    base = merged[BASELINE]
    base_bytes, base_units = max(base["peak_activation_bytes"]), max(base["predicted_peak_units"])
    base_gpt = max(gpt_peaks[BASELINE])
    return [MemoryRow(name, list(r["peak_activation_bytes"]), list(r["predicted_peak_units"]), gpt_peaks[name],
                      max(r["peak_activation_bytes"]) / base_bytes, max(r["predicted_peak_units"]) / base_units,
                      max(gpt_peaks[name]) / base_gpt, r["max_grad_rel_err"])
            for name, r in merged.items()]


def format_table(rows: list[MemoryRow]) -> str:
    pp = len(rows[0].peak_bytes)
    head = ("| schedule | " + " | ".join(f"rank {r}: MiB (units paper / gpt)" for r in range(pp))
            + " | worst / 1F1B measured | predicted, paper | predicted, gpt |")
    lines = [head, "|" + "---|" * (pp + 4)]
    for row in rows:
        cells = [f"{b / 2**20:.2f} ({u:g} / {g:.2f})"
                 for b, u, g in zip(row.peak_bytes, row.predicted_units, row.predicted_units_gpt)]
        lines.append(f"| {row.schedule} | " + " | ".join(cells) + f" | {row.measured_ratio:.3f} "
                     f"| {row.predicted_ratio:.3f} | {row.predicted_ratio_gpt:.3f} |")
    return "\n".join(lines)


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=16)
    parser.add_argument("--schedules", default=",".join(DEFAULT_SCHEDULES))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--memory-limit", type=float, default=0.5, help="v-auto's limit, x 1F1B's peak")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    schedules = tuple(s for s in args.schedules.split(",") if s)
    from megatron_vshape.schedules.generators.registry import SCHEDULES

    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        parser.error(f"--schedules: unknown {unknown}; choose from {', '.join(SCHEDULES)}")
    if BASELINE not in schedules:
        parser.error(f"--schedules must include {BASELINE} (the ratios are to it)")
    if args.pp < 2:
        parser.error("--pp must be >= 2")
    if args.layers % (2 * args.pp):
        parser.error(f"--layers must be a multiple of 2*pp = {2 * args.pp} (V and interleaved use 2 chunks per rank)")
    if args.hidden % args.heads:
        parser.error("--hidden must be a multiple of --heads")
    return args, schedules


def main(argv=None) -> int:
    args, schedules = _parse(argv)
    model = ModelSettings(num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                          seq_length=args.seq, vocab_size=args.vocab, micro_batch_size=args.micro_batch_size)
    spec = RunSpec(schedules=schedules, pp=args.pp, microbatches=args.microbatches, model=model,
                   memory_limit=args.memory_limit)
    start = time.perf_counter()
    merged = run_check(spec, timeout=args.timeout)
    rows = make_rows(merged, gpt_model_peaks(spec))
    print(f"pp={args.pp} m={args.microbatches} layers={args.layers} hidden={args.hidden} seq={args.seq} "
          f"vocab={args.vocab} mbs={args.micro_batch_size} (v-auto at --memory-limit {args.memory_limit:g}); "
          f"{time.perf_counter() - start:.0f} s")
    print(format_table(rows))
    bad = [r.schedule for r in rows if r.max_grad_rel_err > GRAD_TOLERANCE]
    if bad:
        print(f"gradient mismatch vs single-process reference: {bad}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"config": vars(args), "rows": [asdict(r) for r in rows]}, handle, indent=2)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
