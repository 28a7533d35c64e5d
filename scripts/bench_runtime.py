"""Iteration time per schedule on CPU ranks (gloo), next to Megatron's own 1F1B.

    python scripts/bench_runtime.py [--pp 2] [--microbatches 8] [--iters 5] [--json FILE] [--trace FILE]

Spawns ``--pp`` ranks with one thread each, builds a GPT big enough that compute dominates
(megatron-core GPTModel, local spec, fp32, dropout off), and times full forward-backward
iterations (median over ``--iters`` after warm-up; each iteration's time is the slowest rank's).
Rows: ``megatron-1f1b`` (megatron-core's forward_backward_pipelining_without_interleaving) and
each requested vshape schedule run by the vshape executor. Unless ``--unit-costs``, the schedules
are built with the costs ``--pipeline-costs auto`` measures (``runtime/replan.py``'s rule, run on a
V-ZB warm-up: one rule for the benchmarks, the executor and the planner).

Every vshape row records its per-rank timeline (``runtime/timeline.py``); the table after the
times splits the median iteration of each row per rank into F/B/W, waits for receives and sends,
bookkeeping and the gradient reduction, with the measured idle (waits + bookkeeping) next to the
idle predicted by replaying the measured passes (pred) and by the simulator: under the measured
costs of a typical chunk (sim: the costs the schedules are built for) and under each stage's measured
costs (stg: the embedding's and the LM head's stages are heavier, which no schedule built for equal
stages can hide). ``--trace FILE`` writes those iterations as one Chrome trace (chrome://tracing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace

from megatron_vshape.runtime.replan import fold_stages, with_measured_stages
from megatron_vshape.runtime.timeline import HEADER, chrome_trace, format_rows, simulated_idle, summarize
from megatron_vshape.schedules.core.schedule import Costs
from megatron_vshape.testing import spawn
from megatron_vshape.testing.tiny_gpt import ModelSettings, build_gpt, forward_step, make_config, microbatch

DEFAULT_SCHEDULES = ("1f1b", "zb-h1", "v-min", "v-half", "v-zb")
# NAME:VARIANT rows: the executor with one of its old policies, timed beside the current one.
VARIANTS = {
    "eager": "the old p2p waits (each batch waited for at once)",
    "fused": "a B and its directly following W run as one backward even when B's gradient goes to another rank",
}


def _worker(rank, world_size, model: ModelSettings, schedules, microbatches, warmup, iters, measure_costs):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_vshape.megatron.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    parallel_state.initialize_model_parallel(1, world_size)
    model_parallel_cuda_manual_seed(model.seed)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    data = [dict(microbatch(model, i), index=i) for i in range(microbatches)]
    measured, seconds = _measure_costs(model, world_size, pp_rank, microbatches, data)  # also for the sim column
    costs = measured if measure_costs else Costs()
    comm = _measure_comm(model)
    runs = {name: _build_row(name, model, world_size, pp_rank, microbatches, costs, record_timeline=True)
            for name in ("megatron-1f1b", *schedules)}
    rows = {name: {"wall_s": [], "cpu_s": []} for name in runs}
    spans = {name: [] for name in runs}  # this rank's timeline of each measured iteration
    # Round-robin over the rows each iteration, so that load changing over time hits all rows alike.
    for step in range(warmup + iters):
        for name, (func, ddp) in runs.items():
            wall, cpu = _time_iteration(func, ddp, data, model, microbatches)
            if step >= warmup:
                rows[name]["wall_s"].append(wall)
                rows[name]["cpu_s"].append(cpu)
                spans[name].append(getattr(func, "last_spans", None))
    ran = {name: func.schedule(world_size, microbatches) for name, (func, _) in runs.items() if name in schedules}
    parallel_state.destroy_model_parallel()
    return {"rows": rows, "costs": vars(costs), "measured_costs": vars(measured), "comm_s": comm, "spans": spans,
            "measured_seconds": seconds,
            "schedules": ran}


def _measure_costs(model, world_size, pp_rank, microbatches, data, iterations: int = 2,
                   forward_step_func=forward_step) -> Costs:
    """The costs ``--pipeline-costs auto`` measures (runtime/replan.py: per-rank medians of F, of B
    whose W was deferred, and of W, per V chunk; max over ranks; one message), on a V-ZB run."""
    from megatron_vshape.runtime.replan import ReplanPolicy

    func, ddp = _build_row("v-zb", model, world_size, pp_rank, microbatches, Costs(),
                           replan=ReplanPolicy(iterations=iterations))
    for _ in range(iterations + 1):  # one warm-up call, then the measured ones; re-plans after the last
        _time_iteration(func, ddp, data, model, microbatches, forward_step_func)
    replan = func.last_replan
    return replan.costs, {**replan.measured_seconds, "stages": [list(row) for row in replan.stage_seconds]}


def _measure_comm(model) -> float:
    """Seconds for one activation message (runtime/replan.py's ring exchange), for the idle prediction."""
    import torch
    from megatron.core import parallel_state

    from megatron_vshape.runtime.replan import measure_comm

    shape = (model.seq_length, model.micro_batch_size, model.hidden_size)
    return measure_comm(parallel_state.get_pipeline_model_parallel_group(), shape, torch.float32,
                        torch.device("cpu"))


def _build_row(name, model, world_size, pp_rank, microbatches, costs, record_timeline=False, replan=None):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    from megatron_vshape.runtime import build_forward_backward_func

    name, _, variant = name.partition(":")  # "v-zb:eager": an old executor policy (VARIANTS), side by side
    ours = build_forward_backward_func("1f1b" if name == "megatron-1f1b" else name, costs=costs,
                                       record_timeline=record_timeline, replan=replan)
    ours.eager_waits = variant == "eager"
    ours.fuse_remote_pairs = variant == "fused"
    func = forward_backward_pipelining_without_interleaving if name == "megatron-1f1b" else ours
    config, chunks = gpt_chunks(model, world_size, pp_rank, ours.schedule(world_size, microbatches).placement)
    config.finalize_model_grads_func = finalize_model_grads
    return func, [DistributedDataParallel(config, DistributedDataParallelConfig(), c) for c in chunks]


def gpt_chunks(model, world_size, pp_rank, placement):
    """(config, this rank's GPT chunks) for ``placement``: the stages it places on ``pp_rank``."""
    from megatron_vshape.runtime import build_model_chunks

    vp = None if placement.chunks_per_device == 1 else placement.chunks_per_device
    config = make_config(model, world_size, 1, vp, False)
    chunks = build_model_chunks(placement, pp_rank, lambda cs, pgs: build_gpt(
        config, model, cs.pre_process, cs.post_process, cs.vp_stage, pgs, placement.num_stages))
    return config, chunks


def _time_iteration(func, ddp, data, model, microbatches, forward_step_func=forward_step) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one iteration, each the slowest rank's."""
    import time

    import torch

    for m in ddp:
        m.zero_grad_buffer()
    iterators = [iter(data) for _ in ddp]
    torch.distributed.barrier()
    start, cpu_start = _now(), time.process_time()
    func(forward_step_func=forward_step_func, data_iterator=iterators if len(ddp) > 1 else iterators[0],
         model=ddp if len(ddp) > 1 else ddp[0], num_microbatches=microbatches,
         seq_length=model.seq_length, micro_batch_size=model.micro_batch_size)
    elapsed = torch.tensor([_now() - start, time.process_time() - cpu_start], dtype=torch.float64)
    torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
    return elapsed[0].item(), elapsed[1].item()


def _now() -> float:
    import time

    return time.perf_counter()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedules", default=",".join(DEFAULT_SCHEDULES),
                        help="comma-separated; NAME:VARIANT runs NAME with an old executor policy: "
                             + "; ".join(f"{k}: {v}" for k, v in VARIANTS.items()))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--unit-costs", action="store_true",
                        help="build schedules with F=B=W instead of the costs --pipeline-costs auto measures")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--trace", metavar="FILE", help="write each row's median iteration as a Chrome trace")
    args = parser.parse_args(argv)
    if args.pp < 2:
        parser.error("--pp must be >= 2 (this benchmarks pipeline schedules)")
    if args.layers % (2 * args.pp):
        parser.error(f"--layers must be a multiple of 2*pp = {2 * args.pp} (V schedules use 2 chunks per rank)")
    model = replace(ModelSettings(), num_layers=args.layers, hidden_size=args.hidden, num_heads=8,
                    seq_length=args.seq, vocab_size=1024, micro_batch_size=1)
    schedules = tuple(s for s in args.schedules.split(",") if s)
    if unknown := [s for s in schedules if s.partition(":")[2] not in ("", *VARIANTS)]:
        parser.error(f"--schedules: unknown variant in {unknown}; NAME or NAME:VARIANT with VARIANT one of "
                     f"{', '.join(VARIANTS)}")
    results = spawn(_worker, args.pp, (model, schedules, args.microbatches, args.warmup, args.iters,
                                       not args.unit_costs), timeout=args.timeout)
    rows, costs = results[0]["rows"], Costs(**results[0]["costs"])
    measured = Costs(**results[0]["measured_costs"])
    base = statistics.median(rows["1f1b"]["wall_s"]) if "1f1b" in rows else None
    report = []
    print(f"pp={args.pp} m={args.microbatches} layers={args.layers} hidden={args.hidden} seq={args.seq} "
          f"(median of {args.iters}, slowest rank; cpu = busy CPU time of the busiest rank)")
    print(f"  schedule costs: {_text(costs)}; measured (runtime/replan.py's rule): {_text(measured)}; "
          f"one message {1000 * results[0]['comm_s']:.2f} ms; per V chunk f={1000 * results[0]['measured_seconds']['f']:.1f} ms, "
          f"batch loading {1000 * results[0]['measured_seconds']['load']:.3f} ms per loading F (not in f)")
    for name, times in rows.items():
        wall, cpu = statistics.median(times["wall_s"]), statistics.median(times["cpu_s"])
        vs = f"{base / wall - 1:+6.1%} speed vs 1f1b" if base else ""
        print(f"  {name:14s} wall {wall * 1000:8.1f} ms  cpu {cpu * 1000:8.1f} ms  {vs}")
        report.append({"schedule": name, "median_wall_s": wall, "median_cpu_s": cpu, **times})
    seconds = results[0]["measured_seconds"]
    staged = with_measured_stages(measured, seconds, [tuple(row) for row in seconds["stages"]], Costs())
    print("  each stage's measured work (stg% column), x the typical chunk: "
          + "  ".join(f"stage {i}: f{w.f:.2f} b{w.b:.2f} w{w.w:.2f}" for i, w in enumerate(staged.stages)))
    idle = idle_table(results, measured, staged, schedules)
    print("\n".join(idle["lines"]))
    if args.trace:
        with open(args.trace, "w") as handle:
            json.dump(chrome_trace(idle["timelines"]), handle)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"config": vars(args), "costs": results[0]["costs"], "comm_s": results[0]["comm_s"],
                       "measured_costs": results[0]["measured_costs"],
                       "rows": report, "idle": idle["records"]}, handle, indent=2)
    return 0


def _text(costs: Costs) -> str:
    return f"f={costs.f:.3g} b={costs.b:.3g} w={costs.w:.3g} comm={costs.comm:.3g}"


def idle_table(results, measured: Costs, staged: Costs, schedules) -> dict:
    """Per schedule and rank, the median iteration's timeline summary (see the module docstring)."""
    from megatron_vshape.schedules.core.simulator import simulate
    from megatron_vshape.schedules.lowering.program import Level, lower_program

    lines = ["per-rank timeline of the median iteration (ms; outsd = before/after the call while other ranks "
             "run; idle% = waits + bookkeeping + outsd, of the pipeline's span less gsync; "
             "pred% = replay of the measured passes; sim% = simulator under the measured costs of a typical "
             "chunk, the costs the schedules were built for; stg% = simulator under each stage's measured costs)",
             HEADER]
    records, timelines = [], {}
    comm = results[0]["comm_s"]
    for name in schedules:
        walls = results[0]["rows"][name]["wall_s"]
        median = sorted(range(len(walls)), key=walls.__getitem__)[len(walls) // 2]
        per_rank = [r["spans"][name][median] for r in results]
        schedule = results[0]["schedules"][name]  # the one the ranks ran (not rebuilt: the code may have changed)
        sim = simulated_idle(simulate(schedule, measured))
        stg = simulated_idle(simulate(schedule, fold_stages(staged, schedule.num_stages)))
        summaries = summarize(lower_program(schedule, level=Level.MESSAGES).ranks, per_rank, comm)
        for s, sim_idle, stg_idle in zip(summaries, sim, stg):
            lines.extend(format_rows(name, [s], sim_idle, stg_idle))
            records.append({"schedule": name, "rank": s.rank, "wall_s": s.wall, "span_s": s.span,
                            "outside_s": s.outside, "measured_idle": s.measured_idle,
                            "predicted_idle": s.predicted_idle, "simulated_idle": sim_idle,
                            "simulated_idle_per_stage": stg_idle,
                            **{c.value: v for c, v in s.totals.items()}})
        timelines[name] = per_rank
    return {"lines": lines, "records": records, "timelines": timelines}


if __name__ == "__main__":
    sys.exit(main())
