"""Iteration time of the vshape executor against PyTorch's own pipeline schedules, on the same GPT chunks.

    python scripts/bench_peers.py [--microbatches 8] [--iters 10] [--json FILE]

Two CPU ranks (gloo, one thread each), a megatron-core GPT (local spec, fp32, dropout off) cut into
4 stages placed as a V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2. Rows, timed round-robin
in one process group (median over ``--iters`` after ``--warmup``; each iteration's time is the
slowest rank's):

* ``torch-zbv`` / ``torch-dualpipev``: ``torch.distributed.pipelining``'s ``ScheduleZBVZeroBubble``
  and ``ScheduleDualPipeV`` driving ``PipelineStage``\\ s whose modules are the same megatron GPT
  chunks (a thin adapter turns a chunk into ``forward(tensor) -> tensor``; loss = mean token
  cross entropy over fp32 logits).
* ``torch-1f1b``: its ``Schedule1F1B`` on the stages of our 1F1B (one per rank), the control row:
  beside ``vshape-1f1b`` (same schedule, same placement) it shows what the two sides' layers and
  runtimes cost apart from the schedule.
* ``vshape-<schedule>`` (default v-zb, v-half, 1f1b): the vshape executor on the same chunks,
  built and timed as in ``scripts/bench_runtime.py`` (DDP-wrapped).

Both sides compute the same loss: mean token cross entropy over fp32 logits (``_token_loss``); the
vshape rows' ``forward_step`` takes the chunk's logits and applies it, instead of megatron's
vocab-parallel cross entropy, so the comparison is of the runtimes, not of two loss kernels.

Besides the times, a per-rank table splits each row's median iteration into forward compute (the
loss included), backward compute (B, W and fused backwards) and the rest (waits, p2p, bookkeeping):
torch's ``PipelineStage`` passes are timed by wrapping the stages' pass methods, ours come from the
executor's timeline (``runtime/timeline.py``).

What differs, on purpose: PyTorch splits the backward generically (autograd from saved
intermediates to the weights), which re-runs a custom autograd Function's whole backward in W. So
the PyTorch-side chunks compute their linear layers with ``torch.nn.functional.linear`` (native
autograd: B computes only input gradients, W only weight gradients) instead of megatron's
``LinearWithGradAccumulationAndAsyncCommunication``, which the vshape executor splits with its own
weight-gradient store. Same weights shapes, same FLOPs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/ itself: reuse bench_runtime

import bench_runtime  # noqa: E402

from megatron_vshape.schedules.core.schedule import Costs  # noqa: E402
from megatron_vshape.testing import spawn  # noqa: E402
from megatron_vshape.testing.tiny_gpt import ModelSettings, microbatch  # noqa: E402

# row -> (torch.distributed.pipelining class, the vshape schedule whose placement its stages take)
TORCH_SCHEDULES = {"torch-zbv": ("ScheduleZBVZeroBubble", "v-zb"), "torch-dualpipev": ("ScheduleDualPipeV", "v-zb"),
                   "torch-1f1b": ("Schedule1F1B", "1f1b")}
DEFAULT_OURS = ("v-zb", "v-half", "1f1b")
REFERENCE_ROW = "torch-zbv"


def _native_linear(input, weight, bias=None, **_unused):
    import torch

    return torch.nn.functional.linear(input, weight, bias)


def _use_native_linears(module) -> int:
    """Route every megatron parallel linear of ``module`` through F.linear (see module docstring)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    count = 0
    for sub in module.modules():
        if isinstance(sub, (ColumnParallelLinear, RowParallelLinear)):
            sub._forward_impl = _native_linear  # instance attribute shadows the method
            count += 1
    return count


def _stage_adapter(chunk, model: ModelSettings):
    """A chunk as ``forward(x) -> y`` for PipelineStage: tokens or hidden [s, b, h] in, hidden or logits out."""
    import torch

    class ChunkStage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.chunk = chunk
            seq = model.seq_length
            self.register_buffer("mask", torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None],
                                 persistent=False)

        def forward(self, x):
            if chunk.pre_process:
                batch, seq = x.shape
                positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)
                return self.chunk(x, positions, self.mask)
            self.chunk.set_input_tensor(x)
            return self.chunk(None, None, self.mask)

    return ChunkStage()


def _token_loss(logits, labels):
    import torch

    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def forward_step(data_iterator, model):
    """megatron forward_step_func for the vshape rows: the chunk's logits, then the torch rows' loss."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])  # no labels: logits

    def loss_func(logits):
        loss = _token_loss(logits, batch["labels"])
        return loss, {"lm loss": loss.detach().clone(), "mb": batch["index"]}

    return output, loss_func


class PassClock:
    """Seconds of forward and backward compute in the current iteration (the torch rows' stages)."""

    def __init__(self):
        self.seconds = {"forward": 0.0, "backward": 0.0}

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)

    def timed(self, func, kind: str):
        import time

        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                self.seconds[kind] += time.perf_counter() - start

        return call

    def attach(self, stage) -> None:
        """Time ``stage``'s passes; its instance attributes shadow the class's methods."""
        stage.forward_one_chunk = self.timed(stage.forward_one_chunk, "forward")
        stage.backward_one_chunk = self.timed(stage.backward_one_chunk, "backward")
        stage.backward_weight_one_chunk = self.timed(stage.backward_weight_one_chunk, "backward")


def _build_torch_row(name, model, world_size, pp_rank, microbatches, clock: PassClock | None = None):
    import torch
    from torch.distributed import pipelining

    from megatron_vshape.runtime import build_forward_backward_func

    class_name, placed_as = TORCH_SCHEDULES[name]
    placement = build_forward_backward_func(placed_as).schedule(world_size, microbatches).placement
    _config, chunks = bench_runtime.gpt_chunks(model, world_size, pp_rank, placement)
    modules = []
    stages = []
    for chunk, stage_index in zip(chunks, placement.stages_per_device[pp_rank]):
        _use_native_linears(chunk)
        module = _stage_adapter(chunk, model)
        modules.append(module)
        stages.append(pipelining.PipelineStage(module, stage_index, placement.num_stages, torch.device("cpu")))
        if clock is not None:
            clock.attach(stages[-1])
    # The loss runs in the schedule, outside the stage's forward: counted as forward, as on our side.
    loss_fn = _token_loss if clock is None else clock.timed(_token_loss, "forward")
    single_stage = len(stages) == 1  # Schedule1F1B takes one stage, the V schedules a list
    schedule = getattr(pipelining, class_name)(stages[0] if single_stage else stages, n_microbatches=microbatches,
                                               loss_fn=loss_fn)
    return schedule, modules, placement


def _time_torch_iteration(schedule, modules, placement, pp_rank, batch) -> tuple[float, float]:
    import time

    import torch

    for module in modules:
        module.zero_grad(set_to_none=True)
    args, kwargs = [], {}
    if placement.device_of(0) == pp_rank:
        args = [batch["tokens"]]
    if placement.device_of(placement.num_stages - 1) == pp_rank:
        kwargs["target"] = batch["labels"]
    torch.distributed.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    schedule.step(*args, **kwargs)
    elapsed = torch.tensor([time.perf_counter() - start, time.process_time() - cpu_start], dtype=torch.float64)
    torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
    return elapsed[0].item(), elapsed[1].item()


def _worker(rank, world_size, model: ModelSettings, ours, torch_rows, microbatches, warmup, iters, measure_costs):
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_vshape.megatron.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    parallel_state.initialize_model_parallel(1, world_size)
    model_parallel_cuda_manual_seed(model.seed)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    data = [dict(microbatch(model, i), index=i) for i in range(microbatches)]
    batch = {key: torch.cat([d[key] for d in data]) for key in ("tokens", "labels")}
    costs = (bench_runtime._measure_costs(model, world_size, pp_rank, microbatches, data,
                                          forward_step_func=forward_step)[0]
             if measure_costs else Costs())
    runners, built = _build_runners(model, ours, torch_rows, world_size, pp_rank, microbatches, costs, data, batch)
    check = _compare_with_torch(built, data, batch, model, microbatches, pp_rank) if (
        "v-zb" in built and REFERENCE_ROW in built) else None
    rows = {name: {"wall_s": [], "cpu_s": []} for name in runners}
    compute = {name: [] for name in runners}  # this rank's (forward, backward) seconds per measured iteration
    # Round-robin each iteration, so that load changing over time (shared machine) hits all rows alike.
    for step in range(warmup + iters):
        for name, run in runners.items():
            wall, cpu, seconds = run()
            if step >= warmup:
                rows[name]["wall_s"].append(wall)
                rows[name]["cpu_s"].append(cpu)
                compute[name].append(seconds)
    every_rank: list = [None] * world_size
    torch.distributed.all_gather_object(every_rank, compute)
    parallel_state.destroy_model_parallel()
    return {"rows": rows, "costs": vars(costs), "check": check, "compute": every_rank}


def _build_runners(model, ours, torch_rows, world_size, pp_rank, microbatches, costs, data, batch):
    """{row name: callable timing one iteration} in table order, and the built objects by schedule.

    A runner returns (wall s, CPU s), each the slowest rank's, and this rank's (forward, backward)
    compute seconds."""
    runners, built = {}, {}
    for name in ours:
        func, ddp = built[name] = bench_runtime._build_row(name, model, world_size, pp_rank, microbatches, costs,
                                                           record_timeline=True)
        runners[f"vshape-{name}"] = lambda f=func, d=ddp: (
            *bench_runtime._time_iteration(f, d, data, model, microbatches, forward_step), _our_compute(f))
    for name in torch_rows:
        clock = PassClock()
        schedule, modules, placement = built[name] = _build_torch_row(name, model, world_size, pp_rank, microbatches,
                                                                      clock)
        placed_as = TORCH_SCHEDULES[name][1]
        if placed_as in built:  # same weights as our row with the same stages (the check compares V-ZB's)
            for module, ddp_chunk in zip(modules, built[placed_as][1]):
                module.chunk.load_state_dict(ddp_chunk.module.state_dict())
        runners[name] = lambda s=schedule, m=modules, p=placement, c=clock: _run_torch(s, m, p, pp_rank, batch, c)
    order = (*torch_rows, *(f"vshape-{n}" for n in ours))
    return {name: runners[name] for name in order}, built


def _our_compute(func) -> tuple[float, float]:
    """(forward, backward) seconds of the executor's last call on this rank, from its timeline."""
    from megatron_vshape.runtime.timeline import Category

    totals = func.last_spans.totals()
    return totals[Category.F], totals[Category.B] + totals[Category.W]


def _run_torch(schedule, modules, placement, pp_rank, batch, clock: PassClock):
    clock.reset()
    wall, cpu = _time_torch_iteration(schedule, modules, placement, pp_rank, batch)
    return wall, cpu, (clock.seconds["forward"], clock.seconds["backward"])


def _compare_with_torch(built, data, batch, model, microbatches, pp_rank) -> dict:
    """One iteration of torch-zbv and vshape-v-zb on equal weights: largest loss and gradient differences.

    Evidence that the two sides run the same layers: per-microbatch losses and every parameter
    gradient (PyTorch's ``.grad`` vs megatron DDP's ``main_grad``) must agree up to fp32 rounding.
    """
    import torch

    schedule, modules, placement = built[REFERENCE_ROW]
    func, ddp = built["v-zb"]
    for module in modules:
        module.zero_grad(set_to_none=True)
    for m in ddp:
        m.zero_grad_buffer()
    torch_losses: list = []
    args = [batch["tokens"]] if placement.device_of(0) == pp_rank else []
    last = placement.device_of(placement.num_stages - 1) == pp_rank
    schedule.step(*args, **({"target": batch["labels"], "losses": torch_losses} if last else {}))
    store = func(forward_step_func=forward_step, data_iterator=[iter(data) for _ in ddp], model=ddp,
                 num_microbatches=microbatches, seq_length=model.seq_length, micro_batch_size=model.micro_batch_size)
    loss_err = max((abs(t.item() - item["lm loss"].item()) for t, item in zip(torch_losses, store)), default=0.0)
    grad_err = 0.0
    for module, ddp_chunk in zip(modules, ddp):
        ours = dict(ddp_chunk.module.named_parameters())
        for name, param in module.chunk.named_parameters():
            want = ours[name].main_grad.double()
            diff = (param.grad.double() - want).norm().item()
            grad_err = max(grad_err, diff / max(want.norm().item(), 1e-30))
    errs = torch.tensor([loss_err, grad_err], dtype=torch.float64)
    torch.distributed.all_reduce(errs, op=torch.distributed.ReduceOp.MAX)
    return {"max_loss_abs_diff": errs[0].item(), "max_grad_rel_diff": errs[1].item(),
            "num_losses_compared": len(store) if last else 0}


def summarize(rows: dict) -> list[dict]:
    """One record per row: median wall/cpu seconds and the wall-time ratio to PyTorch's ZBV."""
    medians = {name: statistics.median(t["wall_s"]) for name, t in rows.items()}
    ref = medians.get(REFERENCE_ROW)
    return [{"system": name, "median_ms": medians[name] * 1000,
             "median_cpu_ms": statistics.median(times["cpu_s"]) * 1000,
             "ratio_to_torch_zbv": medians[name] / ref if ref else None,
             "paired_ratio_to_torch_zbv": _paired_ratio(times["wall_s"], rows[REFERENCE_ROW]["wall_s"]) if ref else None,
             **times}
            for name, times in rows.items()]


CONTROL_ROWS = ("vshape-1f1b", "torch-1f1b")


def layers_control(rows: dict) -> float | None:
    """Our 1F1B's time / torch's 1F1B's (paired median): the same schedule and stages, so what the two
    sides' layers and runtimes cost apart from any schedule; None without both rows."""
    ours, theirs = CONTROL_ROWS
    if ours not in rows or theirs not in rows:
        return None
    return _paired_ratio(rows[ours]["wall_s"], rows[theirs]["wall_s"])


def format_control(records: list[dict], control: float) -> str:
    """The control, and each vshape row's ratio to torch ZBV divided by it: an estimate of the ratio with
    equal layers on both sides (derived, not measured)."""
    parts = [f"{r['system']} {r['paired_ratio_to_torch_zbv'] / control:.3f}" for r in records
             if r["system"].startswith("vshape-") and r["paired_ratio_to_torch_zbv"] is not None]
    return (f"control: {CONTROL_ROWS[0]} / {CONTROL_ROWS[1]} (paired) = {control:.3f}; time / torch-zbv over it "
            f"(estimate with equal layers): {', '.join(parts)}")


def compute_split(rows: dict, compute: list[dict]) -> list[dict]:
    """Per row and rank: median forward and backward compute, and the rest of the iteration (the
    slowest rank's wall time less this rank's compute: waits, p2p and bookkeeping), in ms."""
    records = []
    for name, times in rows.items():
        wall = statistics.median(times["wall_s"])
        for rank, per_rank in enumerate(compute):
            forward = [f for f, _ in per_rank[name]]
            backward = [b for _, b in per_rank[name]]
            rest = [total - f - b for total, f, b in zip(times["wall_s"], forward, backward)]
            records.append({"system": name, "rank": rank, "forward_ms": statistics.median(forward) * 1000,
                            "backward_ms": statistics.median(backward) * 1000,
                            "rest_ms": statistics.median(rest) * 1000,
                            "rest_share": statistics.median(rest) / wall if wall > 0 else 0.0})
    return records


def format_compute(records: list[dict]) -> str:
    lines = ["| system | rank | forward ms (+ loss) | backward ms (B, W, fused) | rest ms | rest % |",
             "|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['system']} | {r['rank']} | {r['forward_ms']:.1f} | {r['backward_ms']:.1f} "
                     f"| {r['rest_ms']:.1f} | {100 * r['rest_share']:.1f} |")
    return "\n".join(lines)


def _paired_ratio(times: list[float], reference: list[float]) -> float:
    """Median over iterations of time / torch-zbv's time in the same round: robust to load drifting."""
    return statistics.median(t / r for t, r in zip(times, reference))


def format_table(records: list[dict]) -> str:
    lines = ["| system | median ms / iteration | busiest rank CPU ms | time / torch-zbv (medians) "
             "| time / torch-zbv (paired, median) |", "|---|---|---|---|---|"]
    for r in records:
        ratios = [f"{r[key]:.3f}" if r[key] is not None else "-"
                  for key in ("ratio_to_torch_zbv", "paired_ratio_to_torch_zbv")]
        lines.append(f"| {r['system']} | {r['median_ms']:.1f} | {r['median_cpu_ms']:.1f} | {' | '.join(ratios)} |")
    return "\n".join(lines)


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--ours", default=",".join(DEFAULT_OURS),
                        help="vshape schedules to time; NAME:VARIANT with an old executor policy (bench_runtime.VARIANTS)")
    parser.add_argument("--torch", default=",".join(TORCH_SCHEDULES), help=f"of: {', '.join(TORCH_SCHEDULES)}")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--unit-costs", action="store_true",
                        help="build vshape schedules with F=B=W instead of the costs --pipeline-costs auto measures "
                             "(runtime/replan.py's rule, on a V-ZB run: the same as bench_runtime.py)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    from megatron_vshape.schedules.generators.registry import SCHEDULES

    ours = tuple(s for s in args.ours.split(",") if s)
    torch_rows = tuple(s for s in args.torch.split(",") if s)
    if unknown := [s for s in ours if s.partition(":")[0] not in SCHEDULES or s.partition(":")[2] not in ("", *bench_runtime.VARIANTS)]:
        parser.error(f"--ours: unknown {unknown}; choose from {', '.join(SCHEDULES)}")
    if unknown := [s for s in torch_rows if s not in TORCH_SCHEDULES]:
        parser.error(f"--torch: unknown {unknown}; choose from {', '.join(TORCH_SCHEDULES)}")
    if args.layers % 4:
        parser.error("--layers must be a multiple of 4 (4 stages on 2 ranks)")
    if args.microbatches < 4:
        parser.error("--microbatches must be >= 4 (PyTorch's V schedules need at least one per stage)")
    if args.hidden % args.heads:
        parser.error("--hidden must be a multiple of --heads")
    return args, ours, torch_rows


def main(argv=None) -> int:
    args, ours, torch_rows = _parse(argv)
    model = replace(ModelSettings(), num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                    seq_length=args.seq, vocab_size=args.vocab, micro_batch_size=1)
    (result, *_) = spawn(_worker, 2, (model, ours, torch_rows, args.microbatches, args.warmup, args.iters,
                                      not args.unit_costs), timeout=args.timeout)
    records = summarize(result["rows"])
    split = compute_split(result["rows"], result["compute"])
    print(f"pp=2 (4 stages, V) m={args.microbatches} layers={args.layers} hidden={args.hidden} seq={args.seq} "
          f"vocab={args.vocab}; median of {args.iters} after {args.warmup} warm-up, slowest rank; "
          f"vshape costs {result['costs']}")
    print(format_table(records))
    print(format_compute(split))
    control = layers_control(result["rows"])
    if control is not None and REFERENCE_ROW in result["rows"]:
        print(format_control(records, control))
    if result["check"] is not None:
        print(f"torch-zbv vs vshape-v-zb on equal weights: {result['check']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"config": vars(args), "costs": result["costs"], "check": result["check"], "rows": records,
                       "compute": split, "layers_control": control},
                      handle, indent=2)
    check = result["check"]
    if check is not None and (check["max_loss_abs_diff"] > 1e-4 or check["max_grad_rel_diff"] > 1e-4):
        print("torch-zbv and vshape-v-zb disagree: the two sides do not compute the same thing", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
