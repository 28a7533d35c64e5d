"""Step time of the balanced layer layout vs the uniform one, side by side on CPU ranks (gloo).

    python scripts/bench_layout.py [--schedule v-half] [--pp 4] [--iters 10] [--json FILE]

A tiny GPT whose vocabulary makes the LM head worth several layers (default: 16 layers, hidden
256, vocabulary 12288, sequence 64, microbatch 2: by FLOPs the head is about 3.8 layers). Both
layouts are built in one process group, the uniform split and the one ``--pipeline-layout
balanced`` picks (the planner's FLOPs model, :func:`megatron_vshape.planner.balance.choose_layout`),
and their iterations alternate (uniform, balanced, uniform, ...), so that load from other
processes on a shared machine hits both alike. Each iteration's time is the slowest rank's; the
table reports medians after ``--warmup`` iterations, and balanced / uniform both as the ratio of
the medians and as the median of each step's pair (the two runs of a step are back to back).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace

from megatron_vshape.verify import ModelSettings, build_gpt, forward_step, make_config, microbatch, spawn

LAYOUTS = ("uniform", "balanced")


def _worker(rank, world_size, model: ModelSettings, schedule: str, counts: dict, microbatches, warmup, iters):
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_vshape.megatron.cpu_mode import enable_cpu_mode

    torch.set_num_threads(1)
    enable_cpu_mode()
    parallel_state.initialize_model_parallel(1, world_size)
    model_parallel_cuda_manual_seed(model.seed)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    data = [dict(microbatch(model, i), index=i) for i in range(microbatches)]
    rows = {name: _build(schedule, model, world_size, pp_rank, counts[name]) for name in LAYOUTS}
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    losses: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for step in range(warmup + iters):
        # Alternate which layout goes first, so neither always follows the other.
        for name in LAYOUTS if step % 2 == 0 else reversed(LAYOUTS):
            wall, loss = _time_iteration(*rows[name], data, model, microbatches)
            if step >= warmup:
                times[name].append(wall)
            losses[name].append(loss)
    parallel_state.destroy_model_parallel()
    return {"times": times, "losses": losses}


def _build(schedule, model, world_size, pp_rank, counts):
    """(forward-backward function, DDP chunks) of ``schedule`` with ``counts`` layers per stage."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from megatron_vshape.megatron.layout import layout_costs
    from megatron_vshape.planner.balance import stage_work
    from megatron_vshape.runtime import build_forward_backward_func, build_model_chunks
    from megatron_vshape.runtime.layer_layout import megatron_layout
    from megatron_vshape.schedules import Costs

    planner = _planner_model(model)
    uneven = len(set(counts)) > 1
    # As training builds it: per-stage work (LM head included) only for an uneven layout.
    costs = layout_costs(Costs(), counts, stage_work(planner, counts)) if uneven else Costs()
    func = build_forward_backward_func(schedule, costs=costs)
    placement = func.schedule(world_size, 1).placement
    vp = None if placement.chunks_per_device == 1 else placement.chunks_per_device
    layout = megatron_layout(counts, placement) if uneven else None
    config = make_config(model, world_size, 1, vp, False, layout)
    config.finalize_model_grads_func = finalize_model_grads
    chunks = build_model_chunks(placement, pp_rank, lambda cs, pgs: build_gpt(
        config, model, cs.pre_process, cs.post_process, cs.vp_stage, pgs, placement.num_stages))
    return func, [DistributedDataParallel(config, DistributedDataParallelConfig(), c) for c in chunks]


def _time_iteration(func, ddp, data, model, microbatches) -> tuple[float, float]:
    """(wall seconds of the slowest rank, mean loss on the last stage's rank or 0) of one iteration."""
    import time

    import torch

    for m in ddp:
        m.zero_grad_buffer()
    iterators = [iter(data) for _ in ddp]
    torch.distributed.barrier()
    start = time.perf_counter()
    out = func(forward_step_func=forward_step, data_iterator=iterators if len(ddp) > 1 else iterators[0],
               model=ddp if len(ddp) > 1 else ddp[0], num_microbatches=microbatches,
               seq_length=model.seq_length, micro_batch_size=model.micro_batch_size)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
    losses = [float(x["lm loss"]) for x in out or []]
    return elapsed.item(), (sum(losses) / len(losses) if losses else 0.0)


def _planner_model(model: ModelSettings):
    from megatron_vshape.planner.model import GPTModel

    return GPTModel("bench", model.num_layers, model.hidden_size, model.num_heads, model.seq_length,
                    model.vocab_size)


def choose(model: ModelSettings, schedule: str, pp: int, microbatches: int):
    """(uniform counts, LayoutChoice) as ``--pipeline-layout uniform`` / ``balanced`` pick them."""
    from megatron_vshape.planner.balance import choose_layout, placement_for
    from megatron_vshape.schedules.stage_layout import uniform_layout

    stages = placement_for(schedule, pp).num_stages
    return uniform_layout(model.num_layers, stages), choose_layout(_planner_model(model), schedule, pp, microbatches)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", default="v-half")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=12288)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    if args.pp < 2:
        parser.error("--pp must be >= 2 (a pipeline)")
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    model = replace(ModelSettings(), num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                    seq_length=args.seq, vocab_size=args.vocab, micro_batch_size=args.micro_batch)
    try:
        uniform, choice = choose(model, args.schedule, args.pp, args.microbatches)
    except ValueError as error:  # bad sizes: one line naming the problem
        parser.error(" ".join(str(error).split()))
    counts = {"uniform": uniform, "balanced": choice.layers_per_stage}
    (result, *_) = spawn(_worker, args.pp, (model, args.schedule, counts, args.microbatches, args.warmup,
                                             args.iters), timeout=args.timeout)
    report = _report(args, counts, choice, result)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    return 0


def _report(args, counts, choice, result) -> dict:
    times = result["times"]
    median = {name: statistics.median(times[name]) for name in LAYOUTS}
    ratio = median["balanced"] / median["uniform"]
    # The two runs of one step ran back to back, under the same outside load: their ratio is the
    # steadier statistic on a shared machine.
    paired = statistics.median(b / u for u, b in zip(times["uniform"], times["balanced"]))
    predicted = choice.iteration_time / choice.reference_time
    print(f"{args.schedule}, pp={args.pp}, m={args.microbatches}: {args.layers} layers, hidden {args.hidden}, "
          f"vocab {args.vocab}, seq {args.seq}, microbatch {args.micro_batch} "
          f"(median of {args.iters} alternating iterations after {args.warmup} warm-up; slowest rank)")
    for name in LAYOUTS:
        layers = ",".join(str(c) for c in counts[name])
        spread = f"{min(times[name]) * 1e3:.0f}..{max(times[name]) * 1e3:.0f}"
        print(f"  {name:9s} {layers:24s} median {median[name] * 1e3:8.1f} ms  (range {spread} ms)")
    print(f"  balanced / uniform: {ratio:.3f} (medians), {paired:.3f} (median of per-step pairs); "
          f"planner predicted {predicted:.3f}")
    return {"config": vars(args), "layouts": {k: list(v) for k, v in counts.items()}, "times_s": times,
            "median_s": median, "ratio": ratio, "paired_ratio": paired, "predicted_ratio": predicted,
            "losses": result["losses"]}


if __name__ == "__main__":
    sys.exit(main())
