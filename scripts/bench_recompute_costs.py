"""F, B and W pass times under each recomputation mode with a split backward (CPU, gloo, PP 2).

The executor's timeline (``record_timeline``) gives each pass's wall time; the modes run in
alternation, iteration by iteration, on the same rank, so they see the same machine load. A
recomputed layer runs its forward again inside B, so B grows and F and W do not; the ratio
``B(mode) / B(none)`` is the recomputation cost a planner charges. Prints a table (median over the
timed iterations, pipeline rank 0) and, with ``--json``, the numbers.

    python scripts/bench_recompute_costs.py --schedule v-half --hidden 256 --seq 128 --iters 5
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace

from megatron_vshape.testing.recipe_workers import RECOMPUTE, RecipeSpec, build, make_config
from megatron_vshape.testing.spawn import spawn
from megatron_vshape.testing.tiny_gpt import ModelSettings, _data, forward_step


def worker(rank, world_size, spec: RecipeSpec, schedule: str, iters: int):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_vshape.megatron.cpu_mode import enable_cpu_mode
    from megatron_vshape.runtime import build_forward_backward_func, build_model_chunks

    enable_cpu_mode()
    parallel_state.initialize_model_parallel(1, spec.pp)
    model_parallel_cuda_manual_seed(spec.model.seed)
    fb = build_forward_backward_func(schedule, record_timeline=True)
    placement = fb.schedule(spec.pp, spec.microbatches).placement
    vp = None if placement.chunks_per_device == 1 else placement.chunks_per_device
    models = {}
    for mode in spec.recompute:
        config = make_config(spec, spec.pp, vp, 1, mode)
        config.finalize_model_grads_func = finalize_model_grads
        chunks = build_model_chunks(placement, parallel_state.get_pipeline_model_parallel_rank(),
                                    lambda cs, pgs, config=config: build(spec, config, cs.pre_process,
                                                                         cs.post_process, cs.vp_stage, pgs))
        models[mode] = [DistributedDataParallel(config, DistributedDataParallelConfig(), c) for c in chunks]
    data = _data(spec.model, range(spec.microbatches))
    times = {mode: {"F": [], "B": [], "W": []} for mode in spec.recompute}
    for i in range(iters):
        for mode, model in models.items():
            for m in model:
                m.zero_grad_buffer()
            fb(forward_step_func=forward_step, data_iterator=[iter(data) for _ in model], model=model,
               num_microbatches=spec.microbatches, seq_length=spec.model.seq_length,
               micro_batch_size=spec.model.micro_batch_size, forward_only=False)
            if i == 0:
                continue  # warm-up
            for action, start, end in fb.last_timeline:
                times[mode][action.kind.value].append(end - start)
    parallel_state.destroy_model_parallel()
    return {mode: {k: statistics.median(v) for k, v in kinds.items() if v} for mode, kinds in times.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="v-half")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    model = replace(ModelSettings(), num_layers=args.layers, hidden_size=args.hidden, seq_length=args.seq)
    spec = RecipeSpec(schedules=(args.schedule,), pp=2, microbatches=4, recompute=tuple(RECOMPUTE), model=model)
    rows = spawn(worker, 2, (spec, args.schedule, args.iters), timeout=1200)[0]
    print(f"{args.schedule}, PP 2, hidden {args.hidden}, seq {args.seq}, {args.layers} layers; median pass time "
          "on pipeline rank 0 (ms)")
    print("| recompute | F | B | W | B / B(none) |")
    print("|---|---|---|---|---|")
    for mode, row in rows.items():
        print(f"| {mode} | {row['F'] * 1e3:.1f} | {row['B'] * 1e3:.1f} | {row['W'] * 1e3:.1f} | "
              f"{row['B'] / rows['none']['B']:.2f} |")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
