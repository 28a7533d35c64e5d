"""Exposed data-parallel time with and without --overlap-grad-reduce under split schedules (CPU, gloo).

DP 2 x PP 2 ranks on this machine. Each rank builds the model twice (megatron DDP with and without
overlapped reduction, small buckets) and runs them in alternation, iteration by iteration, so both
see the same machine load. Exposed DP time = the wall time of ``finalize_model_grads`` (waiting for
the reductions, or doing them, after the last pass of the iteration) up to the optimizer step.
Prints a table (worst rank, median over the timed iterations) and, with ``--json``, the numbers.

    python scripts/bench_dp_overlap.py --schedules v-half zb-1p --hidden 512 --iters 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

from megatron_vshape.testing.recipe_workers import RecipeSpec, build, make_config
from megatron_vshape.testing.spawn import spawn
from megatron_vshape.testing.tiny_gpt import ModelSettings, _data, forward_step


def worker(rank, world_size, spec: RecipeSpec, iters: int):
    import torch
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_vshape.megatron.cpu_mode import enable_cpu_mode
    from megatron_vshape.runtime import build_forward_backward_func, build_model_chunks

    enable_cpu_mode()
    parallel_state.initialize_model_parallel(1, spec.pp)
    model_parallel_cuda_manual_seed(spec.model.seed)
    out = {}
    for name in spec.schedules:
        fb = build_forward_backward_func(name)
        placement = fb.schedule(spec.pp, spec.microbatches).placement
        vp = None if placement.chunks_per_device == 1 else placement.chunks_per_device
        runs = {}
        for overlap in (True, False):
            config = make_config(spec, spec.pp, vp, 1)
            spent = []

            def finalize(*args, _spent=spent, **kwargs):
                start = time.perf_counter()
                finalize_model_grads(*args, **kwargs)
                _spent.append(time.perf_counter() - start)

            config.finalize_model_grads_func = finalize
            chunks = build_model_chunks(placement, parallel_state.get_pipeline_model_parallel_rank(),
                                        lambda cs, pgs, config=config: build(spec, config, cs.pre_process,
                                                                             cs.post_process, cs.vp_stage, pgs))
            ddp = DistributedDataParallelConfig(overlap_grad_reduce=overlap, bucket_size=spec.bucket_size)
            runs[overlap] = ([DistributedDataParallel(config, ddp, c) for c in chunks], spent, [])
        dp_rank = parallel_state.get_data_parallel_rank()
        data = _data(spec.model, [dp_rank * spec.microbatches + i for i in range(spec.microbatches)])
        for _ in range(iters):
            for overlap in (True, False):  # alternate: both see the same load
                model, _spent, total = runs[overlap]
                for m in model:
                    m.zero_grad_buffer()
                torch.distributed.barrier()
                start = time.perf_counter()
                fb(forward_step_func=forward_step, data_iterator=[iter(data) for _ in model], model=model,
                   num_microbatches=spec.microbatches, seq_length=spec.model.seq_length,
                   micro_batch_size=spec.model.micro_batch_size, forward_only=False)
                total.append(time.perf_counter() - start)
        out[name] = {str(overlap): {"exposed": spent[2:], "iteration": total[2:]}
                     for overlap, (_m, spent, total) in runs.items()}
    parallel_state.destroy_model_parallel()
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=["zb-1p", "v-half", "v-zb"])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--iters", type=int, default=6, help="per setting; the first 2 are not timed")
    parser.add_argument("--bucket-size", type=int, default=1_000_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    model = replace(ModelSettings(), num_layers=args.layers, hidden_size=args.hidden, seq_length=64)
    spec = RecipeSpec(schedules=tuple(args.schedules), pp=2, dp=2, microbatches=args.microbatches,
                      bucket_size=args.bucket_size, model=model)
    per_rank = spawn(worker, 4, (spec, args.iters), timeout=1200)
    rows = {}
    for name in args.schedules:
        row = {}
        for overlap in ("True", "False"):
            row[overlap] = {k: max(statistics.median(r[name][overlap][k]) for r in per_rank)
                            for k in ("exposed", "iteration")}
        rows[name] = row
    print(f"DP 2 x PP 2, gloo, hidden {args.hidden}, {args.layers} layers, {args.microbatches} microbatches; "
          "median of worst rank (ms)")
    print("| schedule | exposed DP, overlap | exposed DP, no overlap | ratio | iteration, overlap | iteration, no overlap |")
    print("|---|---|---|---|---|---|")
    for name, row in rows.items():
        on, off = row["True"], row["False"]
        print(f"| {name} | {on['exposed'] * 1e3:.1f} | {off['exposed'] * 1e3:.1f} | "
              f"{on['exposed'] / off['exposed']:.2f} | {on['iteration'] * 1e3:.0f} | {off['iteration'] * 1e3:.0f} |")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
