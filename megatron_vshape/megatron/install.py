"""``install(args)``: plug megatron-vshape's schedules into megatron.training (megatron-core 0.19.x).

What it does, in order (idempotent; every step is a documented replacement of a module attribute):

1. ``validate(args)``: our one-line checks (see :mod:`.arguments`); ``--cpu`` turns on CPU mode.
2. ``get_forward_backward_func`` is replaced where megatron looks it up: ``megatron.core.pipeline_parallel``,
   its ``schedules`` module, and ``megatron.training.training`` (which imported the name). It returns a
   :class:`ScheduleRunner` around either the vshape executor or, for ``1f1b``/``interleaved-1f1b``,
   Megatron's own function. The runner adds, for every schedule: schedule-invariant dropout, the
   per-iteration log line (peak activation memory of every pipeline rank, the simulator's predicted
   bubble, and on GPU TFLOP/s and MFU), and on a V placement it relays the losses from pipeline rank 0
   (where the V's last stage lives) to the last pipeline rank, where megatron's training loop reads them.
3. Model construction: ``get_model``'s model provider and the config-container ``GPTModelBuilder`` both
   go through :class:`ChunkBuilder`. With ``--schedule-invariant-init`` every layer is initialised from
   a stream of (seed, global layer). On a V placement megatron builds two chunks per rank
   (``validate`` sets ``--num-virtual-stages-per-pipeline-rank 2``) and chunk 1 of rank i becomes V stage
   2d-1-i: layer offsets, pre/post-process, tied embeddings on rank 0
   (:mod:`megatron_vshape.runtime.placement`). A model provider must pass the ``pg_collection`` it gets
   on to GPTModel (megatron.training 0.19's ``get_model`` hands one to every provider call).
   Chunk-level first/last-stage questions to ``parallel_state`` (``vp_stage`` given) answer for the V.
4. The B/W split of the linear layers is switched on by the executor itself (``runtime.wgrad``).
5. Megatron's C++ dataset helpers are built for the running Python (:mod:`.dataset_helpers`).

Rank 0 first prints which megatron runs, and from where (:mod:`.which_megatron`).

:func:`hook_arguments` lets an *unmodified* entry script get all of this: it chains our flags into
``parse_args`` and runs our checks before Megatron's ``validate_args`` and ``install`` after it.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import dataset_helpers, hybrid_pattern, pipeline_layout
from .arguments import add_arguments, exit_on_error, validate, validate_after_megatron
from .checks import watchdog_seconds
from .flags import AUTO_SCHEDULE, MEGATRON_OWN_SCHEDULES, V_SCHEDULE_NAMES
from .model_chunks import v_stage_predicates, wrap_model_construction
from .patches import Group as PatchGroup
from .patches import check as check_patches
from .which_megatron import print_startup_line

_INSTALLED = "_vshape_installed"


def effective_schedule(args) -> str:
    """The schedule that runs: the flag, or Megatron's own default for the given virtual pipeline."""
    if args.pipeline_schedule:
        return args.pipeline_schedule
    return "interleaved-1f1b" if getattr(args, "virtual_pipeline_model_parallel_size", None) else "1f1b"


def install(args: argparse.Namespace) -> None:
    """Validate ``args`` and wire the schedule into megatron (see the module docstring)."""
    if getattr(args, _INSTALLED, False):
        return
    validate(args)
    validate_after_megatron(args)  # install runs after Megatron's validate_args: what it derived is there now
    if args.cpu:
        from .training_cpu import enable_training_cpu_mode

        enable_training_cpu_mode()
    print_startup_line()  # which megatron runs, and from where (rank 0)
    check_patches(PatchGroup.GPU, PatchGroup.WGRAD)  # before replacing anything: one line, not a silent mismatch
    dataset_helpers.install()  # built for this Python, or one line naming what the build lacks (every rank)
    if args.pipeline_schedule in V_SCHEDULE_NAMES and getattr(args, "virtual_pipeline_model_parallel_size", 0) is None:
        # Called after Megatron's validate_args without hook_arguments(): it derived no virtual
        # pipeline, because validate() set --num-virtual-stages-per-pipeline-rank 2 only now.
        args.virtual_pipeline_model_parallel_size = 2
    if hybrid_pattern.is_hybrid(args):  # HybridModel: V-chunk segments, and its final norm on CPU
        from .hybrid_spec import install as install_hybrid

        install_hybrid(cpu=args.cpu)
    runner = ScheduleRunner(args)
    _replace_forward_backward_func(runner)
    wrap_model_construction(args)
    if args.pipeline_schedule in V_SCHEDULE_NAMES:
        v_stage_predicates()
    if pipeline_layout.counts(args) is not None and os.environ.get("RANK", "0") == "0":
        print(f" [vshape] {pipeline_layout.describe(args)}", flush=True)
    if hybrid_pattern.describe(args) is not None and os.environ.get("RANK", "0") == "0":
        print(f" [vshape] {hybrid_pattern.describe(args)}", flush=True)
    setattr(args, _INSTALLED, True)


# ---------------------------------------------------------------------------------------------
# Arguments hook (for unmodified entry scripts)
# ---------------------------------------------------------------------------------------------


def hook_arguments() -> None:
    """Make megatron.training parse our flags and call :func:`install` during argument validation."""
    from .training_cpu import require_megatron_training

    require_megatron_training()
    print_startup_line()  # as soon as megatron is imported: which one runs, and from where (rank 0)
    from megatron.training import arguments

    if getattr(arguments.parse_args, "_vshape", False):
        return
    original_parse, original_validate = arguments.parse_args, arguments.validate_args

    @functools.wraps(original_parse)
    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        def provider(parser):
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            return _repair_help(add_arguments(parser))

        return original_parse(provider, ignore_unknown_args)

    @functools.wraps(original_validate)
    def validate_args(args, defaults={}):  # noqa: B006 (megatron's signature)
        exit_on_error(validate, args)
        if args.cpu:  # before megatron's checks: they may query the device
            from .training_cpu import enable_training_cpu_mode

            enable_training_cpu_mode()
        result = original_validate(args, defaults)
        exit_on_error(install, args)
        return result

    parse_args._vshape = True
    arguments.parse_args, arguments.validate_args = parse_args, validate_args
    for module_name in ("megatron.training.initialize", "megatron.training.training"):
        module = sys.modules.get(module_name)
        for name, new in (("parse_args", parse_args), ("validate_args", validate_args)):
            if module is not None and hasattr(module, name):
                setattr(module, name, new)


def _repair_help(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Escape stray ``%`` in help texts: one bad string in megatron 0.19.2 makes ``--help`` crash."""
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.help:
            continue
        try:
            formatter._expand_help(action)
        except (ValueError, TypeError, KeyError):
            action.help = action.help.replace("%", "%%")
    return parser


# ---------------------------------------------------------------------------------------------
# forward_backward replacement
# ---------------------------------------------------------------------------------------------


def _build_inner(args, name: str):
    if name in MEGATRON_OWN_SCHEDULES and not getattr(args, "pipeline_vocab_parallel", False):
        return None  # resolved per call: Megatron's own function for the current groups
    # (with --pipeline-vocab-parallel Megatron's functions cannot run the vocabulary passes: ours runs them)
    from megatron_vshape.runtime import build_forward_backward_func
    from megatron_vshape.runtime.replan import ReplanPolicy

    from .startup_schedule import costs_for_run  # the costs the start-up checks built and validated the schedule from

    limit = args.pipeline_memory_limit if name == AUTO_SCHEDULE else None
    costs = costs_for_run(args)
    spec = getattr(args, "pipeline_costs", None)
    if spec is not None and spec.strip().lower() == "auto":
        output = Path(args.pipeline_costs_out) if args.pipeline_costs_out else None
        policy = ReplanPolicy(iterations=args.pipeline_costs_iters, output=output)
        return build_forward_backward_func(name, costs=costs, memory_limit=limit, replan=policy,
                                           watchdog=_watchdog(args))
    return build_forward_backward_func(name, costs=costs, memory_limit=limit, watchdog=_watchdog(args))


def _watchdog(args):
    from megatron_vshape.runtime.watchdog import ScheduleWatchdog

    seconds = watchdog_seconds(args)
    return ScheduleWatchdog(seconds) if seconds > 0 else None


def _replace_forward_backward_func(runner: ScheduleRunner) -> None:
    import megatron.core.pipeline_parallel as pipeline_parallel
    from megatron.core.pipeline_parallel import schedules

    original = schedules.get_forward_backward_func

    def get_forward_backward_func(*args, **kwargs):
        runner.megatron_func = lambda: original(*args, **kwargs)
        return runner

    get_forward_backward_func._vshape = True
    pipeline_parallel.get_forward_backward_func = get_forward_backward_func
    schedules.get_forward_backward_func = get_forward_backward_func
    training = sys.modules.get("megatron.training.training")
    if training is None:
        import megatron.training.training as training
    training.get_forward_backward_func = get_forward_backward_func


@dataclass
class _Throughput:
    last_call: float | None = None


@dataclass
class ScheduleRunner:
    """The forward_backward function megatron's training loop gets (one per install, no module state)."""

    args: argparse.Namespace
    name: str = ""
    megatron_func: object = None
    _inner: object = None
    _bubbles: dict = field(default_factory=dict)
    _clock: _Throughput = field(default_factory=_Throughput)

    def __post_init__(self):
        self.name = effective_schedule(self.args)
        self._inner = _build_inner(self.args, self.name)

    @property
    def is_v(self) -> bool:
        return self.name in V_SCHEDULE_NAMES

    def __call__(self, **kwargs):
        from megatron.core import parallel_state

        func = self._inner if self._inner is not None else self.megatron_func()
        models = kwargs["model"] if isinstance(kwargs["model"], list) else [kwargs["model"]]
        forward_only = kwargs.get("forward_only", False)
        if self.args.schedule_invariant_dropout and not forward_only:
            kwargs["forward_step_func"] = self._invariant_dropout(models, kwargs)
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        meter = _meter(models) if not forward_only else None
        if meter is not None:
            with meter:
                losses = func(**kwargs)
        else:
            losses = func(**kwargs)
        if self.is_v:
            losses = relay_losses(losses, pp_group)
        self._report_replan()
        if not forward_only:
            self._log(kwargs["num_microbatches"], meter, pp_group)
        return losses

    # --- pieces -------------------------------------------------------------------------------

    def _report_replan(self) -> None:
        """One line per rank when the executor re-planned from measured costs (--pipeline-costs auto)."""
        replan = getattr(self._inner, "last_replan", None)
        if replan is None:
            return
        self._inner.last_replan = None
        self._bubbles.clear()  # predictions from now on use the measured costs
        import torch

        print(f" [vshape] rank {torch.distributed.get_rank()}: {replan.line(self.name)}", flush=True)

    def _invariant_dropout(self, models, kwargs):
        from megatron.core import parallel_state

        from .dropout_seed import InvariantDropout, attach

        attach(models)
        helper = InvariantDropout(
            seed=self.args.seed, iteration=getattr(self.args, "curr_iteration", 0),
            num_microbatches=kwargs["num_microbatches"],
            dp_rank=parallel_state.get_data_parallel_rank(),
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        )
        return helper.wrap_forward_step(kwargs["forward_step_func"])

    def predicted_bubble(self, num_devices: int, num_microbatches: int) -> float | None:
        key = (num_devices, num_microbatches)
        if key not in self._bubbles:
            self._bubbles[key] = _simulate_bubble(self, num_devices, num_microbatches)
        return self._bubbles[key]

    def _log(self, num_microbatches: int, meter, pp_group) -> None:
        import torch

        counts = getattr(self._inner, "last_wgrad_counts", None)  # None: Megatron's own function
        vocab = getattr(self._inner, "last_vocab_bytes", None)  # with --pipeline-vocab-parallel
        mine = ([meter.peak_bytes if meter is not None else 0] + ([counts.deferred, counts.run] if counts else [])
                + (list(vocab) if vocab else []))
        rows = _gather_ints(mine, pp_group)
        vocab_rows = [row[-2:] for row in rows] if vocab else None
        rows = [row[:-2] for row in rows] if vocab else rows
        peaks = [row[0] for row in rows]
        now = time.time()
        elapsed = None if self._clock.last_call is None else now - self._clock.last_call
        self._clock.last_call = now
        if torch.distributed.get_rank() != torch.distributed.get_world_size() - 1:
            return  # Megatron prints its iteration lines from the last rank; so do we
        bubble = self.predicted_bubble(pp_group.size(), num_microbatches)
        parts = [f"schedule {self.name}",
                 f"predicted bubble {bubble * 100:.1f}%" if bubble is not None else "predicted bubble n/a",
                 "peak activation MiB per pipeline rank: " + ", ".join(f"{p / 2**20:.2f}" for p in peaks),
                 wgrad_part([tuple(row[1:]) for row in rows] if counts else None)]
        if vocab_rows is not None:
            parts.append("vocabulary passes MiB per pipeline rank, held from H to G: "
                         + ", ".join(f"{held / 2**20:.2f}" for held, _ in vocab_rows)
                         + "; the embedding's buffers (embeddings and gradients on the first stage, tokens, "
                         + "data read ahead): " + ", ".join(f"{e / 2**20:.2f}" for _, e in vocab_rows))
        parts += _throughput(self.args, elapsed)
        print(" [vshape] " + " | ".join(parts), flush=True)


def _meter(models):
    from megatron_vshape.runtime.memory import ActivationMeter

    try:
        return ActivationMeter.for_models(models)
    except AttributeError:  # a model without megatron's decoder.layers: count every saved tensor
        return ActivationMeter(params=[p for m in models for p in m.parameters()])


def wgrad_part(per_rank: list[tuple[int, int]] | None) -> str:
    """The log's weight-gradient figures: (deferred by B, run by W) per pipeline rank this iteration."""
    if per_rank is None:
        return "W not split (Megatron's own schedule)"
    return "W deferred/run per pipeline rank: " + ", ".join(f"{deferred}/{run}" for deferred, run in per_rank)


def _gather_ints(values: list[int], pp_group) -> list[list[int]]:
    """``values`` of every pipeline rank, in pipeline-rank order (one all_gather)."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    out = [torch.zeros_like(mine) for _ in range(pp_group.size())]
    torch.distributed.all_gather(out, mine, group=pp_group)
    return [[int(v) for v in t.tolist()] for t in out]


def relay_losses(losses, pp_group):
    """On a V the losses come out on pipeline rank 0; megatron reads them on the last pipeline rank."""
    import torch

    ranks = torch.distributed.get_process_group_ranks(pp_group)
    if len(ranks) == 1:
        return losses
    me = torch.distributed.get_rank()
    payload = [_to_cpu(losses) if me == ranks[0] else None]
    torch.distributed.broadcast_object_list(payload, src=ranks[0], group=pp_group)
    if me != ranks[-1]:
        return [] if me != ranks[0] else losses
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return _to_device(payload[0], device)


def _to_cpu(value):
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _to_device(value, device):
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value


def _simulate_bubble(runner: ScheduleRunner, num_devices: int, num_microbatches: int) -> float | None:
    from megatron_vshape.schedules.core.schedule import Costs, ScheduleError
    from megatron_vshape.schedules.core.simulator import simulate
    from megatron_vshape.schedules.generators.registry import get_schedule

    try:
        executor = runner._inner
        if executor is not None and hasattr(executor, "schedule"):
            schedule = executor.schedule(num_devices, num_microbatches)  # cached, shared with the run
            return simulate(schedule, executor.costs).bubble_rate
        chunks = getattr(runner.args, "virtual_pipeline_model_parallel_size", None) or 2
        schedule = get_schedule(runner.name, num_devices, num_microbatches, Costs(), chunks=chunks)
        return simulate(schedule, Costs()).bubble_rate
    except (ScheduleError, ValueError):
        return None


# Dense bf16 peak TFLOP/s per GPU, for MFU.
_PEAK_TFLOPS = {"A100": 312.0, "H100": 989.0, "H200": 989.0, "H800": 989.0, "A800": 312.0, "B200": 2250.0}


def _throughput(args, elapsed: float | None) -> list[str]:
    import torch

    if elapsed is None or not torch.cuda.is_available():
        return []
    from megatron.training.training import num_floating_point_operations

    flops = num_floating_point_operations(args, args.global_batch_size)
    tflops = flops / (elapsed * args.world_size * 1e12)
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in _PEAK_TFLOPS.items() if k in name), None)
    out = [f"TFLOP/s/GPU {tflops:.1f}"]
    if peak:
        out.append(f"MFU {100 * tflops / peak:.2f}%")
    return out
