"""Predict every (seed) row of the paper's results table with `vshape plan`'s cost model and
print it next to the paper's numbers; write docs/RESULTS.md and the pictures.

    python scripts/reproduce_paper.py [--json out.json] [--no-pictures] [--docs docs]

Calibration: exactly one published number, the 9.6B model's F pass (one layer, microbatch 4,
sequence 1024, A100) of 12.96 ms, fixes the achievable fraction of peak FLOP/s. Every other
input is a datasheet number or a stated assumption (see docs/RESULTS.md). Targets: each
predicted after/before ratio within +-5% of the paper's, and every ordering between schedules
in one setting as in the paper.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

from megatron_vshape.planner import CostModel, Grid, Layout, calibrate_efficiency, get_gpu, get_model, predict, search
from megatron_vshape.planner.cli import PAPER_F_MS

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling script: plot_schedules

TOLERANCE = 0.05
GB = 1e9  # the paper's memory numbers read as 10^9 bytes
HYBRID_SCHEDULES = ("1f1b", "1f1b-r", "v-min", "v-half", "v-zb")
# PP = 40 (one stage per GPU) is left out of the hybrid grid to keep this script under a minute:
# generating V schedules for 40 devices costs seconds per size. `vshape plan` searches it.
HYBRID_GRID = Grid(pp=(2, 4, 5, 8, 10, 20), micro_batch=(1, 2, 4, 8))
QUICK_GRID = Grid(tp=(2, 4, 8), pp=(5, 10, 20), micro_batch=(1,))  # --quick: a smoke test of the script
HYBRID = {"seq 1024, batch 160": (1024, 160), "seq 3072, batch 640": (3072, 640), "seq 16384, batch 160": (16384, 160)}


@dataclass(frozen=True)
class Row:
    """One comparison of the paper's table: ``metric`` goes from ``before`` to ``after``."""

    setting: str
    metric: str  # "MFU %", "activation memory GB" or "bubble %"
    schedule_before: str
    schedule_after: str
    paper_before: float
    paper_after: float
    source: str  # key into the predictions: a hybrid setting or a pure-pipeline setting
    note: str = ""


ROWS = (
    Row("98.5B, 40 GPUs, seq 1024, batch 160", "MFU %", "1f1b", "v-zb", 54.77, 63.31, "seq 1024, batch 160"),
    Row("98.5B, 40 GPUs, seq 3072, batch 640", "MFU %", "1f1b", "v-half", 62.95, 66.34, "seq 3072, batch 640"),
    Row("98.5B, 40 GPUs, seq 16384, batch 160", "MFU %", "1f1b-r", "v-half", 42.05, 57.85, "seq 16384, batch 160"),
    Row("98.5B, 40 GPUs, seq 3072, batch 640", "MFU %", "v-zb", "v-half", 62.56, 66.34, "seq 3072, batch 640"),
    Row("9.6B, 16 GPUs, microbatch 4, 16 microbatches", "activation memory GB", "1f1b", "v-min", 46, 19, "9.6B m16"),
    Row("9.6B, 16 GPUs, microbatch 4, 16 microbatches", "MFU %", "1f1b-r", "v-half", 24.5, 38.3, "9.6B m16"),
    Row("9.6B, 16 GPUs, microbatch 4, 256 microbatches", "MFU %", "1f1b", "v-zb", 57.1, 61.3, "9.6B m256"),
    Row("9.6B, 16 GPUs, microbatch 4, 256 microbatches", "bubble %", "1f1b", "v-zb", 8.8, 1.5, "9.6B m256",
        "paper: 1-2 %, midpoint used"),
    Row("38.5B, 32 GPUs, microbatch 1", "activation memory GB", "1f1b", "v-half", 35, 19, "38.5B"),
    Row("38.5B, 32 GPUs, microbatch 1", "activation memory GB", "1f1b", "v-min", 35, 14, "38.5B"),
)

# Pure pipeline runs: (model, devices, microbatch size, microbatches, schedules). The 38.5B
# microbatch size (1) and count (d) are assumptions: the paper lists sizes 4, 2, 1 for its
# pure-pipeline models without pairing them; peak memory is the same for every count >= d
# (tests/test_planner.py checks this for 1F1B, V-Min and V-Half).
PURE = {
    "9.6B m16": ("9.6b", 16, 4, 16, ("1f1b", "1f1b-r", "v-min", "v-half")),
    "9.6B m256": ("9.6b", 16, 4, 256, ("1f1b", "v-zb")),
    "38.5B": ("38.5b", 32, 1, 32, ("1f1b", "v-half", "v-min")),
}


def cost_model() -> CostModel:
    gpu = get_gpu("a100")
    return CostModel(gpu, calibrate_efficiency(gpu, get_model("9.6b"), 4, PAPER_F_MS / 1e3))


def _summary(prediction) -> dict:
    return {**prediction.to_json(), "layout": str(prediction.layout),
            "peak_activation_gb": prediction.memory.peak_activation / GB}


def run_pure(key: str) -> tuple[str, dict]:
    model_name, d, mb, m, schedules = PURE[key]
    layout = Layout(1, 1, d, mb, mb * m)
    return key, {s: _summary(predict(s, layout, get_model(model_name), cost_model())) for s in schedules}


def run_hybrid(key: str, grid: Grid = HYBRID_GRID) -> tuple[str, dict]:
    seq, batch = HYBRID[key]
    model = get_model("98.5b").with_seq(seq)
    # Flash attention: at seq 16384 the 5as term alone is 107 GB per layer and microbatch, so
    # the paper's runs cannot have stored attention scores; all hybrid rows use the same model.
    # --quick skips V-Min, which no hybrid row compares.
    schedules = [s for s in HYBRID_SCHEDULES if grid is not QUICK_GRID or s != "v-min"]
    results = search(schedules, model, cost_model(), 40, batch, grid, flash_attention=True)
    return key, {r.schedule: (_summary(r.best) if r.best else {"oom": True, "reason": r.reason}) for r in results}


def value(prediction: dict, metric: str) -> float | None:
    if prediction.get("oom") and "mfu" not in prediction:
        return None
    return {"MFU %": 100 * prediction["mfu"], "bubble %": 100 * prediction["bubble_rate"],
            "activation memory GB": prediction["peak_activation_gb"]}[metric]


def records(predictions: dict) -> list[dict]:
    out = []
    for row in ROWS:
        source = predictions[row.source]
        before = value(source[row.schedule_before], row.metric)
        after = value(source[row.schedule_after], row.metric)
        paper_ratio = row.paper_after / row.paper_before
        ratio = after / before if before and after is not None else None
        record = {"setting": row.setting, "metric": row.metric, "schedule_before": row.schedule_before,
                  "schedule_after": row.schedule_after, "paper_before": row.paper_before,
                  "paper_after": row.paper_after, "predicted_before": before, "predicted_after": after,
                  "paper_ratio": paper_ratio, "predicted_ratio": ratio,
                  "ratio_error": None if ratio is None else ratio / paper_ratio - 1,
                  "ordering_matches": None if ratio is None else (ratio > 1) == (paper_ratio > 1),
                  "note": row.note}
        record["within_tolerance"] = record["ratio_error"] is not None and abs(record["ratio_error"]) <= TOLERANCE
        out.append(record)
    return out


def setting_orderings(recs: list[dict]) -> list[dict]:
    """Every pair of schedules the paper ranks within one setting and metric (incl. implied pairs)."""
    by_setting: dict[tuple[str, str], dict[str, tuple[float, float | None]]] = {}
    for r in recs:
        values = by_setting.setdefault((r["setting"], r["metric"]), {})
        values[r["schedule_before"]] = (r["paper_before"], r["predicted_before"])
        values[r["schedule_after"]] = (r["paper_after"], r["predicted_after"])
    out = []
    for (setting, metric), values in by_setting.items():
        for (a, (pa, qa)), (b, (pb, qb)) in combinations(sorted(values.items()), 2):
            paper_first = a if pa > pb else b
            predicted_first = None if qa is None or qb is None else (a if qa > qb else b)
            margin = None if predicted_first is None else abs(qa - qb) / min(qa, qb)
            out.append({"setting": setting, "metric": metric, "pair": f"{a} vs {b}",
                        "paper_higher": paper_first, "predicted_higher": predicted_first,
                        "matches": paper_first == predicted_first, "margin": margin})
    return out


def draw_pictures(out: Path) -> tuple[str, dict]:
    import plot_schedules

    out.mkdir(parents=True, exist_ok=True)
    plot_schedules.main(["--out", str(out)])
    return "pictures", {}


def predict_all(workers: int, quick: bool = False, pictures: Path | None = None) -> dict:
    """Every pure-pipeline setting and hybrid search (and the pictures), in ``workers`` processes."""
    grid = QUICK_GRID if quick else HYBRID_GRID
    jobs = [(run_hybrid, (key, grid)) for key in HYBRID] + [(run_pure, (key,)) for key in PURE]
    if pictures is not None:
        jobs.insert(len(HYBRID), (draw_pictures, (pictures,)))
    if workers <= 1:
        results = dict(fn(*job_args) for fn, job_args in jobs)
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(fn, *job_args) for fn, job_args in jobs]  # slowest first
            results = dict(f.result() for f in futures)
    results.pop("pictures", None)
    return results


def _fmt(x: float | None, digits: int = 2) -> str:
    return "OOM" if x is None else f"{x:.{digits}f}"


def print_table(recs: list[dict]) -> None:
    print(f"{'setting':47s} {'metric':21s} {'before -> after':18s} {'paper':>15s} {'predicted':>15s} "
          f"{'ratio paper':>11s} {'predicted':>9s}  ok")
    for r in recs:
        ok = "yes" if r["within_tolerance"] else "NO"
        print(f"{r['setting']:47s} {r['metric']:21s} {r['schedule_before'] + ' -> ' + r['schedule_after']:18s} "
              f"{r['paper_before']:6.2f} -> {r['paper_after']:5.2f} {_fmt(r['predicted_before']):>6s} -> "
              f"{_fmt(r['predicted_after']):>5s} {r['paper_ratio']:11.3f} {_fmt(r['predicted_ratio'], 3):>9s}  {ok}")


def print_search(predictions: dict) -> None:
    for key in HYBRID:
        print(f"\n98.5B on 40 x A100, {key}: best configuration per schedule")
        ranked = sorted(predictions[key].items(), key=lambda kv: -kv[1].get("mfu", -1))
        for name, p in ranked:
            if "mfu" not in p:
                print(f"  {name:8s} {p['reason']}")
                continue
            print(f"  {name:8s} {p['layout']:24s} MFU {100 * p['mfu']:5.2f} %  bubble {100 * p['bubble_rate']:5.2f} %"
                  f"  peak {p['peak_memory_gib']:5.1f} GiB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the comparison records as JSON")
    parser.add_argument("--docs", type=Path, default=Path(__file__).resolve().parent.parent / "docs",
                        help="where RESULTS.md and the pictures go (default: the repository's docs/)")
    parser.add_argument("--no-pictures", action="store_true", help="skip the PNGs (RESULTS.md still links them)")
    parser.add_argument("--no-results-md", action="store_true", help="do not (re)write RESULTS.md")
    parser.add_argument("--workers", type=int, default=2, help="processes for the independent settings (default 2)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: hybrid grid cut to PP 10/20 and microbatch 1 (not the published numbers)")
    args = parser.parse_args(argv)
    if args.quick and not args.no_results_md:
        parser.error("--quick results are not the published numbers; add --no-results-md")
    start = time.perf_counter()
    predictions = predict_all(args.workers, args.quick, None if args.no_pictures else args.docs)
    recs = records(predictions)
    orderings = setting_orderings(recs)
    print_table(recs)
    print_search(predictions)
    misses = [o for o in orderings if not o["matches"]]
    print(f"\nratios within +-{TOLERANCE:.0%}: {sum(r['within_tolerance'] for r in recs)}/{len(recs)}; "
          f"orderings matching: {len(orderings) - len(misses)}/{len(orderings)}")
    if args.json:
        args.json.write_text(json.dumps([{k: r[k] for k in JSON_KEYS} | {"extra": {k: v for k, v in r.items()
                                         if k not in JSON_KEYS}} for r in recs], indent=2))
    if not args.no_results_md:
        path = write_results_md(args.docs / "RESULTS.md", recs, orderings, predictions)
        print(f"wrote {path}")
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0


# ---- docs/RESULTS.md ---------------------------------------------------------------------------

PART3_BEGIN, PART3_END = "<!-- part3:begin -->", "<!-- part3:end -->"
PART3_PLACEHOLDER = """## Part 3: CPU benchmarks against PyTorch's schedules

*Owned by the runtime benchmarks (not written by this script).* Peak memory and runtime of the
real executor on CPU (gloo) for V-Min / V-Half / V-ZB versus `torch.distributed.pipelining`'s
schedules go here, each with the command that regenerates it. This script keeps whatever stands
between the part3 markers when it rewrites the page."""

# Why a row misses (shown only for rows that miss). The reasoning is static; the live numbers of
# the row (layouts, bubbles) are prepended by _context, so the text never contradicts the tables.
WHY = {
    ("MFU %", "1f1b", "v-zb", "seq 1024"): (
        "The paper's V-ZB (63.31 % MFU) is within 2 % of the model's per-pass ceiling (65.9 % of peak, "
        "times 78 of 80 layer slots doing model FLOPs), which needs both an almost empty pipeline and no "
        "TP communication. In the model no V-ZB layout has both: TP1 layouts either do not fit (DP2 x TP1 x "
        "PP20: 59 GB of weights, grads and optimizer state before activations) or, at TP1 x PP40 (outside "
        "this script's grid; `--pp 40 --tp 1 --schedules v-zb` searches it) need 40 pipeline stages. The "
        "model's best V-ZB layout (TP2 x PP20) already has a bubble under 1 %, so the remaining gap is the TP2 "
        "communication and per-pass efficiency the model charges, not the schedule. 1F1B itself is "
        "predicted within 3 % of the paper. Main suspect: the model's TP cost at small per-rank GEMMs."),
    ("MFU %", "1f1b-r", "v-half", "seq 16384"): (
        "1F1B-R is modelled as paying exactly one extra F per backward. At seq 16384 with flash attention "
        "F : B : W is about 1.27 : 1.53 : 1, which caps the gain of dropping recomputation at "
        "(2F+B+W)/(F+B+W) = 1.33 on equal layouts; the paper's 1.376 implies its 1F1B-R paid more than one "
        "F (recomputed memory-bound kernels, the recomputed forward's TP traffic not overlapped, a worse "
        "layout), none of which the model charges. V-Half is predicted within 5 % of the paper."),
    ("bubble %", "1f1b", "v-zb", ""): (
        "Two effects. (1) 1F1B: the simulator's bubble is the textbook (d-1)/(m+d-1) = 5.5 % plus p2p "
        "latency; the paper's 8.8 % is measured and includes stragglers, non-overlapped p2p and launch gaps. "
        "(2) V-ZB: the project's V-ZB generator, built and timed with the real F/B/W/comm costs of "
        "this row, leaves a smaller bubble than the paper measured (1.5 %); a simulated schedule has no "
        "launch gaps or stragglers. A ratio of two small bubbles amplifies both: the model is optimistic "
        "on both sides, more so for the smaller one."),
    ("activation memory GB", "1f1b", "v-min", "38.5B"): (
        "The simulated V-Min peak at d=32 is the building block's bound ((d+4)//3 = 12 stage-microbatches, "
        "0.375 of 1F1B's 32, minus one layer on the first/last stage); the paper measured 14 GB = 0.40 of "
        "1F1B. The measurement sits about 1 GB above the schedule's bound (allocator granularity, "
        "embedding/head buffers on device 0, temporary tensors), which the model does not include. At "
        "d=16 (the 9.6B row) the same model is within 4 %."),
    ("MFU %", "1f1b-r", "v-half", "9.6B"): (
        "Both schedules run the same layout (TP1 x PP16, 16 microbatches), so the ratio is set by the two "
        "bubbles. The project's V-Half generator now matches the authors' published generator cell for "
        "cell, and its bubble at d=16, m=16 under this row's costs is lower than what the paper's run "
        "achieved (predicted 41.0 % MFU vs the measured 38.3 %, while 1F1B-R is predicted within 1 %). "
        "The model charges no launch gaps, stragglers or the V placement's doubled p2p traffic, which weigh "
        "most when the pipeline holds as few microbatches as stages."),
}

WHY_ORDER = {
    ("1f1b vs v-zb", "seq 3072"): (
        "The paper's gap between the two is 0.6 % (62.95 vs 62.56 % MFU), below the model's resolution. In "
        "the model V-ZB and 1F1B pick the same layout and differ only in bubble (0.07 % vs 1.74 %), so the "
        "model ranks V-ZB first; the paper's V-ZB plausibly lost to what the model leaves out: twice 1F1B's "
        "p2p traffic on the V placement and the embedding and head (and their memory) both on device 0."),
}


def _why_order(ordering: dict, default: str = "No analysis recorded for this ordering yet.") -> str:
    for (pair, where), text in WHY_ORDER.items():
        if ordering["pair"] == pair and where in ordering["setting"]:
            return text
    return default


def _context(record: dict, predictions: dict) -> str:
    """The row's live numbers: each schedule's layout, bubble and peak memory in the model."""
    source = next(r.source for r in ROWS if r.setting == record["setting"] and r.metric == record["metric"])
    parts = []
    for name in (record["schedule_before"], record["schedule_after"]):
        p = predictions[source][name]
        if "mfu" in p:
            parts.append(f"{name}: {p['layout']}, bubble {100 * p['bubble_rate']:.2f} %, "
                         f"peak activations {p['peak_activation_gb']:.1f} GB")
    return "Model: " + "; ".join(parts) + ". " if parts else ""


def _why(record: dict) -> str:
    for (metric, before, after, where), text in WHY.items():
        if (record["metric"], record["schedule_before"], record["schedule_after"]) == (metric, before, after) \
                and where in record["setting"]:
            return text
    return "No analysis recorded for this row yet."


def _part3(path: Path) -> str:
    if path.exists():
        text = path.read_text()
        if PART3_BEGIN in text and PART3_END in text:
            return text[text.index(PART3_BEGIN): text.index(PART3_END) + len(PART3_END)]
    return f"{PART3_BEGIN}\n{PART3_PLACEHOLDER}\n{PART3_END}"


def _ratio_cell(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def write_results_md(path: Path, recs: list[dict], orderings: list[dict], predictions: dict) -> Path:
    efficiency = cost_model().efficiency
    lines = [
        "# Results: the paper's numbers predicted by `vshape plan`'s cost model",
        "",
        "Everything on this page (tables, analysis, pictures) is regenerated by one command:",
        "",
        "    python scripts/reproduce_paper.py --json out.json",
        "",
        "It takes about 45 s of CPU, run in 2 processes (40-90 s wall on the shared 2-core machine). The numbers come from",
        "`megatron_vshape.planner` (FLOPs, bandwidths, memory) driving the project's schedule simulator.",
        "",
        "## How the predictions are made",
        "",
        f"- **Calibration: one published number.** The 9.6B model's F pass (one layer, microbatch 4, seq 1024, "
        f"A100) of {PAPER_F_MS} ms sets the achievable fraction of peak bf16 FLOP/s to {efficiency:.1%}, used for "
        "every F, B and W pass. One V chunk of that model is one layer (30 layers + embedding + head over 32 "
        "stages), so 12.96 ms is per layer; per two layers it would exceed the A100's peak.",
        "- **FLOPs** per layer and microbatch of b sequences: F = 24bsh^2 + 4bs^2h, B = 24bsh^2 + 8bs^2h (input "
        "gradients and the attention backward), W = 24bsh^2 (weight gradients). MFU uses Megatron's "
        "`num_floating_point_operations` (72BsLh^2(1 + s/6h + V/12hL)); recomputation is not counted as useful.",
        "- **Stages**: layers + 2 must divide by the stage count; the embedding and the head each take one "
        "layer's slot (the paper's model sizes follow this rule), so the first and last stage have one layer less.",
        "- **Communication** (datasheet bandwidths x 0.7): TP with sequence parallelism = 4 ring collectives of "
        "the b*s*h bf16 activation in F and in B, 2 in W (re-gathering the GEMM inputs); PP p2p = b*s*h/TP bf16 "
        "per message, NVLink within a node and 25 GB/s per GPU across nodes (mean over the pipeline's hops) "
        "plus 20 us; DP = fp32 gradient reduce-scatter + bf16 parameter all-gather, not overlapped (as in the "
        "authors' fork). The optimizer step reads and writes 30 bytes per local parameter at 80 % of HBM bandwidth.",
        "- **Memory**: weights + grads + optimizer = 6 + 12/DP bytes per parameter (distributed optimizer); "
        "embedding and head (untied) on the first and last stage, so both on device 0 for V schedules. "
        "Activations per layer and microbatch: sb(34h + 5as)/TP bytes (paper.md's per-token model with "
        "sequence parallelism); B frees all but the 32h of W's GEMM inputs, W frees the rest; the last stage "
        "also keeps fp32 logits. 1F1B-R keeps only each layer's input (2sbh/TP) plus one layer rebuilt at a time. "
        "The per-device peak is read off the simulated timeline. 4 GiB per GPU is reserved for CUDA context, "
        "NCCL and fragmentation; a configuration above the rest is OOM.",
        "- **Hybrid rows (98.5B, 40 GPUs)** use flash attention's memory (no 5as term): at seq 16384 that term "
        "alone is 107 GB per layer and microbatch, so the paper's runs cannot have stored the scores. "
        "The pure-pipeline rows keep the 5as term, which reproduces the 9.6B 1F1B's 46 GB. Memory in GB = 10^9 bytes.",
        "- **Pure-pipeline rows**: 9.6B on 16 GPUs at microbatch 4 (16 and 256 microbatches, as the paper "
        "states); 38.5B on 32 GPUs at microbatch 1 and 32 microbatches (assumed: the paper pairs its "
        "pure-pipeline models with microbatch sizes 4, 2, 1 without saying which; peak memory does not "
        "change for 32 microbatches or more).",
        "- **Large microbatch counts**: hand-ordered and building-block schedules (1F1B, V-Min, V-Half) are "
        "simulated at about 1.5 d and 1.5 d + 6k microbatches and extrapolated linearly (within 0.1 % of an "
        "exact run, tested); greedy ones (V-ZB) are simulated exactly up to d x m = 4096 and extrapolated "
        "beyond. Generation is cached for nearby cost ratios, and every schedule is timed with the real costs.",
        "- **V-ZB numbers follow the project's V-ZB generator** (schedules/zero_bubble.py), built with each "
        "row's real F/B/W/comm costs; they move when the generator changes.",
        "",
        "## The paper's (seed) rows",
        "",
        "| setting | metric | before -> after | paper | predicted | paper ratio | predicted ratio | error | within +-5 % |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in recs:
        error = "-" if r["ratio_error"] is None else f"{r['ratio_error']:+.1%}"
        lines.append(
            f"| {r['setting']} | {r['metric']} | {r['schedule_before']} -> {r['schedule_after']} | "
            f"{r['paper_before']:g} -> {r['paper_after']:g} | {_fmt(r['predicted_before'])} -> "
            f"{_fmt(r['predicted_after'])} | {r['paper_ratio']:.3f} | {_ratio_cell(r['predicted_ratio'])} | "
            f"{error} | {'yes' if r['within_tolerance'] else '**no**'} |")
    hits = sum(r["within_tolerance"] for r in recs)
    matching = sum(o["matches"] for o in orderings)
    lines += ["", f"{hits} of {len(recs)} ratios are within +-5 % of the paper's; "
              f"{matching} of {len(orderings)} orderings match (next table).", "",
              "## Orderings between schedules in one setting", "",
              "| setting | metric | pair | paper: higher | predicted: higher | match |", "|---|---|---|---|---|---|"]
    for o in orderings:
        lines.append(f"| {o['setting']} | {o['metric']} | {o['pair']} | {o['paper_higher']} | "
                     f"{o['predicted_higher'] or 'OOM'} | {'yes' if o['matches'] else '**no**'} |")
    lines += ["", "## 98.5B on 40 A100s: best configuration per schedule", "",
              "Each is the planner's search over DP x TP x PP x microbatch size (1, 2, 4, 8), TP <= 8, "
              "PP in 2..20 (PP = 40 is left out here for time; `vshape plan` includes it). One search, e.g.:", "",
              "    python -m megatron_vshape.planner.cli --model 98.5b --seq 3072 --gpus 40 --global-batch 640 \\",
              "        --flash-attention --pp 2,4,5,8,10,20", "",
              "(`vshape plan ...` once the planner is wired into the `vshape` command.)", "",
              "| setting | schedule | best layout | MFU | bubble | peak memory (GiB) | paper MFU |", "|---|---|---|---|---|---|---|"]
    paper_mfu = {(r.source, r.schedule_before): r.paper_before for r in ROWS if r.metric == "MFU %"}
    paper_mfu.update({(r.source, r.schedule_after): r.paper_after for r in ROWS if r.metric == "MFU %"})
    for key in HYBRID:
        for name, p in sorted(predictions[key].items(), key=lambda kv: -kv[1].get("mfu", -1)):
            paper = paper_mfu.get((key, name))
            paper_cell = f"{paper:g} %" if paper else ""
            if "mfu" not in p:
                lines.append(f"| {key} | {name} | {p['reason']} | | | | {paper_cell} |")
                continue
            lines.append(f"| {key} | {name} | {p['layout']} | {100 * p['mfu']:.2f} % | {100 * p['bubble_rate']:.2f} % | "
                         f"{p['peak_memory_gib']:.1f} | {paper_cell} |")
    lines += ["", "## Where the model misses, and why", ""]
    misses = [r for r in recs if not r["within_tolerance"]]
    missed_pairs = [o for o in orderings if not o["matches"]]
    if not misses and not missed_pairs:
        lines.append("Every row is within tolerance and every ordering matches.")
    for r in misses:
        lines += [f"- **{r['setting']}, {r['metric']}, {r['schedule_before']} -> {r['schedule_after']}** "
                  f"(ratio {_ratio_cell(r['predicted_ratio'])} vs the paper's {r['paper_ratio']:.3f}): "
                  f"{_context(r, predictions)}{_why(r)}"]
    for o in missed_pairs:
        lines += [f"- **Ordering {o['pair']}, {o['setting']}**: the paper has {o['paper_higher']} higher, the model "
                  f"{o['predicted_higher']}. " + _why_order(o)]
    fragile = [o for o in orderings if o["matches"] and o.get("margin") is not None and o["margin"] < 0.02]
    if fragile:
        lines += ["", "Orderings that match by less than 2 % in the model (fragile: a small change in the model or "
                  "the generators can flip them):", ""]
        for o in fragile:
            note = _why_order(o, default="")
            lines.append(f"- {o['pair']}, {o['setting']} ({o['metric']}): margin {o['margin']:.1%}. {note}".rstrip())
    lines += ["", "## Pictures", "",
              "Regenerate them alone with `python scripts/plot_schedules.py --out docs` (F = B = W = 1, no "
              "communication cost; `--costs f=1,b=1.1,w=0.9,comm=0.05` for others).", "",
              "Peak activation memory versus bubble rate for every schedule at d = 8 and d = 16 (m = 3d):", "",
              "![memory vs bubble](memory-vs-bubble.png)", "", "Timelines, d = 4 and m = 8:", ""]
    from plot_schedules import fixed_schedules

    for name in fixed_schedules():
        lines += [f"**{name}**", "", f"![{name}](timeline-{name}.png)", ""]
    lines += [_part3(path), ""]
    path.write_text("\n".join(lines))
    return path


JSON_KEYS = ("setting", "metric", "schedule_before", "schedule_after", "paper_before", "paper_after",
             "predicted_before", "predicted_after")

if __name__ == "__main__":
    sys.exit(main())
