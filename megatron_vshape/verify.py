"""``vshape verify``: run one iteration of a small GPT under a schedule on CPU ranks and compare.

    python -m megatron_vshape.verify --schedule v-half --pp 4 [--tp T] [--dp D]
        [--microbatches M] [--tied-embeddings] [--json]
    python -m megatron_vshape.verify --schedule v-zb --pp 1 --device cuda --dtype bf16 --spec te

Spawns ``tp*pp*dp`` ranks -- CPU ranks over gloo (default), or one GPU per rank over NCCL with
``--device cuda`` -- builds megatron-core's GPTModel (local layer spec and fp32 by default; ``--spec te``
is the GPU spec: megatron's TE spec, or for a split schedule the split layer spec with TE attention
and norms; ``--dtype bf16``) in the schedule's placement, runs one forward-backward with the vshape
executor, and compares against the same model (same initial weights, matched by global parameter
name, same layer spec and dtype) and the same data run in a single process with the ordinary fused
backward. ``--pp 1`` puts every stage (both V chunks) on one device, so a single GPU checks the B/W
split, TE and bf16. A split schedule must also have deferred weight gradients (reported as W). Prints the largest relative error (||g - g_ref|| / ||g_ref||) of any parameter gradient, the largest
per-microbatch loss difference, and each pipeline rank's measured peak activation bytes next to
the simulator's predicted peak (memory units).

The harness, the tiny GPT and the workers live in :mod:`megatron_vshape.testing`, which the tests share.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, replace

from megatron_vshape.testing import ModelSettings, RunSpec, run_check
from megatron_vshape.testing.tiny_gpt import DTYPES, SPECS


def _parse(argv):
    from megatron_vshape.cli_parser import OneLineParser  # a usage error is one line, not argparse's usage dump
    from megatron_vshape.schedules.generators.registry import schedule_names

    parser = OneLineParser(prog="vshape verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", required=True, help=f"one of: {', '.join(schedule_names())}")
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--tied-embeddings", action="store_true")
    parser.add_argument("--sequence-parallel", action="store_true", help="with --tp > 1")
    parser.add_argument("--distributed-optimizer", action="store_true",
                        help="check one Adam step of megatron's distributed optimizer instead of raw gradients")
    parser.add_argument("--overlap-grad-reduce", action="store_true", help="DDP overlapped gradient reduction")
    parser.add_argument("--memory-limit", type=float, help="v-auto: activation memory limit, x 1F1B's peak")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--pipeline-layout", default="uniform", metavar="uniform|N0,N1,...",
                        help="transformer layers per stage in global stage order (2 x --pp numbers for a V "
                             "schedule, --pp for 1F1B/ZB): checks an uneven split, as training's --pipeline-layout")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: CPU ranks (default); cuda: one GPU per rank, the reference on GPU 0")
    parser.add_argument("--backend", choices=BACKENDS, default=None,
                        help="process group backend (default: gloo on cpu, nccl on cuda; no other pairing works)")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32",
                        help="bf16: parameters, activations and messages in bf16, gradients summed in fp32")
    parser.add_argument("--spec", choices=SPECS, default="local",
                        help="te: the GPU layer spec (split schedules: the split layer spec with TE attention and "
                             "norms; others: megatron's TE spec); needs --device cuda")
    parser.add_argument("--grad-tol", type=float, default=None,
                        help="pass bar for the gradient relative error (default: fp32 1e-6 on cpu, 1e-5 on cuda; bf16 2e-2)")
    parser.add_argument("--loss-tol", type=float, default=None,
                        help="pass bar for the loss difference (default: fp32 1e-6 on cpu, 1e-5 on cuda; bf16 1e-2)")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


BACKENDS = ("gloo", "nccl")
_DEVICE_BACKEND = {"cpu": "gloo", "cuda": "nccl"}


def tolerances(device: str, dtype: str) -> tuple[float, float]:
    """(gradient, loss) pass bars. bf16 has 8 bits of mantissa (relative step 7.8e-3); on CUDA fp32
    kernels (embedding backward, attention) may sum in a different order from run to run."""
    if dtype == "bf16":
        return 2e-2, 1e-2
    return (1e-6, 1e-6) if device == "cpu" else (1e-5, 1e-5)


def _check_numbers(args) -> None:
    """Sizes, limits and tolerances finite and in range (InputError names the flag)."""
    from megatron_vshape.schedules.core import inputs

    for flag in ("pp", "tp", "dp"):
        inputs.count(f"--{flag}", getattr(args, flag), 1, 64)
    if args.pp * args.tp * args.dp > 64:  # one process per rank, on this machine
        raise inputs.InputError(f"--pp x --tp x --dp = {args.pp * args.tp * args.dp} ranks; at most 64")
    inputs.count("--microbatches", args.microbatches, 1, 4096)
    inputs.count("--layers", args.layers, 1, 1024)
    inputs.real("--timeout", args.timeout, 0.0, 1e6, low_open=True)
    for flag, value in (("--memory-limit", args.memory_limit), ("--grad-tol", args.grad_tol),
                        ("--loss-tol", args.loss_tol)):
        if value is not None:
            inputs.real(flag, value, 0.0, 1.0, low_open=True)


def _check_args(args) -> None:
    from megatron_vshape.schedules.generators.registry import SCHEDULES, get_schedule

    _check_numbers(args)
    if args.schedule not in SCHEDULES:
        raise SystemExit(f"--schedule: unknown {args.schedule!r}; choose one of: {', '.join(SCHEDULES)}")
    for flag in ("pp", "tp", "dp", "microbatches"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag} must be >= 1")
    stages = SCHEDULES[args.schedule].num_stages(args.pp)
    args.layout_counts = _layout_counts(args, stages)
    if args.layers % stages and args.layout_counts is None:
        raise SystemExit(f"--layers {args.layers} must divide into {stages} stages for {args.schedule} at --pp {args.pp}")
    if args.sequence_parallel and args.tp == 1:
        raise SystemExit("--sequence-parallel needs --tp > 1")
    backend = args.backend or _DEVICE_BACKEND[args.device]
    if backend != _DEVICE_BACKEND[args.device]:
        raise SystemExit(f"--backend {backend} cannot run --device {args.device}; use --backend "
                         f"{_DEVICE_BACKEND[args.device]} (or drop --backend)")
    if args.spec == "te" and args.device != "cuda":
        raise SystemExit("--spec te needs Transformer Engine's CUDA kernels; add --device cuda or use --spec local")
    if args.distributed_optimizer and args.dtype != "fp32":
        raise SystemExit("--distributed-optimizer checks an fp32 Adam step; drop it or use --dtype fp32")
    try:
        extra = {} if args.memory_limit is None else {"memory_limit": args.memory_limit}
        get_schedule(args.schedule, args.pp, args.microbatches, **extra)
    except ValueError as err:
        raise SystemExit(f"--schedule/--pp/--microbatches: {err}") from None
    if args.device == "cuda":
        _check_gpus(args.tp * args.pp * args.dp)


def _layout_counts(args, stages: int) -> tuple[int, ...] | None:
    """``--pipeline-layout`` as counts (None: uniform), or SystemExit with one line."""
    from megatron_vshape.layout_flag import BALANCED, UNIFORM, parse_layout

    if args.pipeline_layout.strip().lower() == UNIFORM:
        return None
    if args.pipeline_layout.strip().lower() == BALANCED:
        raise SystemExit("--pipeline-layout balanced is chosen by training's cost model; give the counts it "
                         "printed (N0,N1,...) to check them here")
    try:
        counts = parse_layout(args.pipeline_layout, args.layers, stages)
    except ValueError as err:  # one line naming the flag; here the layer count is --layers
        raise SystemExit(str(err).replace("--num-layers", "--layers")) from None
    if args.pp == 1:
        raise SystemExit("--pipeline-layout needs --pp >= 2 (at --pp 1 every chunk is built uniformly)")
    return counts


def _check_gpus(needed: int) -> None:
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < needed:
        raise SystemExit(f"--device cuda: TP x PP x DP = {needed} ranks need {needed} GPUs, {have} visible; "
                         "lower --pp/--tp/--dp or use --device cpu")


def verdict(result: dict, grad_tol: float, loss_tol: float) -> list[str]:
    """Why the check failed (empty: it passed)."""
    problems = []
    if not result["max_grad_rel_err"] <= grad_tol:  # also catches NaN
        problems.append(f"gradient relative error {result['max_grad_rel_err']:.3e} > {grad_tol:g}")
    if not result["max_loss_abs_err"] <= loss_tol:
        problems.append(f"loss difference {result['max_loss_abs_err']:.3e} > {loss_tol:g}")
    if result.get("split_b_passes", 0) > 0 and result.get("wgrad_deferred", 0) == 0:
        problems.append(f"{result['split_b_passes']} split B passes deferred no weight gradient "
                        "(B ran the full backward)")
    if result.get("wgrad_run", 0) != result.get("wgrad_deferred", 0):
        problems.append(f"W ran {result['wgrad_run']} of {result['wgrad_deferred']} deferred weight gradients")
    return problems


def main(argv=None) -> int:
    from megatron_vshape.cli_parser import UsageError, usage_error

    try:  # bad arguments: one `vshape: error:` line and exit 2, like every vshape subcommand
        args = _parse(argv)
        _check_args(args)
    except (UsageError, ValueError) as err:
        return usage_error(err)
    except SystemExit as stop:
        if stop.code in (None, 0):  # --help
            return 0
        return usage_error(stop.code)
    model = replace(ModelSettings(), tied_embeddings=args.tied_embeddings, num_layers=args.layers,
                    dtype=args.dtype, spec=args.spec)
    spec = RunSpec(schedules=(args.schedule,), pp=args.pp, tp=args.tp, dp=args.dp,
                   microbatches=args.microbatches, sequence_parallel=args.sequence_parallel, model=model,
                   distributed_optimizer=args.distributed_optimizer, overlap_grad_reduce=args.overlap_grad_reduce,
                   memory_limit=args.memory_limit, device=args.device,
                   layouts=() if args.layout_counts is None else (args.layout_counts,))
    default_grad, default_loss = tolerances(args.device, args.dtype)
    grad_tol = default_grad if args.grad_tol is None else args.grad_tol
    loss_tol = default_loss if args.loss_tol is None else args.loss_tol
    result = run_check(spec, timeout=args.timeout)[args.schedule]
    problems = verdict(result, grad_tol, loss_tol)
    report = {key: result[key] for key in ("max_grad_rel_err", "max_loss_abs_err", "peak_activation_bytes",
                                           "predicted_peak_units", "wgrad_deferred", "wgrad_run")}
    if args.json:
        print(json.dumps(dict(report, schedule=args.schedule, grad_tol=grad_tol, loss_tol=loss_tol,
                              passed=not problems, problems=problems, config=asdict(spec)), default=str))
    else:
        print(f"schedule {args.schedule}: pp={args.pp} tp={args.tp} dp={args.dp} m={args.microbatches} "
              f"device={args.device} dtype={args.dtype} spec={args.spec}")
        if args.layout_counts is not None:
            print(f"  layers per stage {','.join(map(str, args.layout_counts))}")
        print(f"  max gradient relative error  {report['max_grad_rel_err']:.3e}  ({result['worst_param']})")
        print(f"  max per-microbatch loss diff {report['max_loss_abs_err']:.3e}")
        print(f"  weight gradients deferred by B {report['wgrad_deferred']}, run by W {report['wgrad_run']}")
        for rank, (got, want) in enumerate(zip(report["peak_activation_bytes"], report["predicted_peak_units"])):
            print(f"  pp rank {rank}: peak activations {got:>10d} B   predicted {want:.2f} units")
        print("  PASS" if not problems else "  FAIL: " + "; ".join(problems))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
