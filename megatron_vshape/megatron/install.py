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

:func:`hook_arguments` lets an *unmodified* entry script get all of this: it chains our flags into
``parse_args`` and runs our checks before Megatron's ``validate_args`` and ``install`` after it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import layout
from .arguments import (
    AUTO_SCHEDULE,
    MEGATRON_OWN_SCHEDULES,
    V_SCHEDULE_NAMES,
    ConfigError,
    add_arguments,
    exit_on_error,
    validate,
)
from .checks import parse_pipeline_costs, watchdog_seconds
from .patches import Group as PatchGroup
from .patches import check as check_patches

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
    if args.cpu:
        from .training_cpu import enable_training_cpu_mode

        enable_training_cpu_mode()
    check_patches(PatchGroup.GPU, PatchGroup.WGRAD)  # before replacing anything: one line, not a silent mismatch
    if args.pipeline_schedule in V_SCHEDULE_NAMES and getattr(args, "virtual_pipeline_model_parallel_size", 0) is None:
        # Called after Megatron's validate_args without hook_arguments(): it derived no virtual
        # pipeline, because validate() set --num-virtual-stages-per-pipeline-rank 2 only now.
        args.virtual_pipeline_model_parallel_size = 2
    runner = ScheduleRunner(args)
    _replace_forward_backward_func(runner)
    _wrap_model_construction(args)
    if args.pipeline_schedule in V_SCHEDULE_NAMES:
        _v_stage_predicates()
    if layout.counts(args) is not None and os.environ.get("RANK", "0") == "0":
        print(f" [vshape] {layout.describe(args)}", flush=True)
    setattr(args, _INSTALLED, True)


# ---------------------------------------------------------------------------------------------
# Arguments hook (for unmodified entry scripts)
# ---------------------------------------------------------------------------------------------


def hook_arguments() -> None:
    """Make megatron.training parse our flags and call :func:`install` during argument validation."""
    from .training_cpu import require_megatron_training

    require_megatron_training()
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
    if name in MEGATRON_OWN_SCHEDULES:
        return None  # resolved per call: Megatron's own function for the current groups
    from megatron_vshape.runtime import build_forward_backward_func
    from megatron_vshape.runtime.replan import ReplanPolicy
    from megatron_vshape.schedules import Costs

    limit = args.pipeline_memory_limit if name == AUTO_SCHEDULE else None
    spec = getattr(args, "pipeline_costs", None)
    if spec is not None and spec.strip().lower() == "auto":
        output = Path(args.pipeline_costs_out) if args.pipeline_costs_out else None
        policy = ReplanPolicy(iterations=args.pipeline_costs_iters, output=output)
        return build_forward_backward_func(name, costs=layout.schedule_costs(args, Costs()), memory_limit=limit,
                                           replan=policy, watchdog=_watchdog(args))
    costs = layout.schedule_costs(args, parse_pipeline_costs(spec) if spec is not None else Costs())
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
        mine = [meter.peak_bytes if meter is not None else 0] + ([counts.deferred, counts.run] if counts else [])
        rows = _gather_ints(mine, pp_group)
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
    from megatron_vshape.schedules import Costs, ScheduleError, get_schedule, simulate

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


# ---------------------------------------------------------------------------------------------
# V placement in megatron.training's model construction
# ---------------------------------------------------------------------------------------------


class ChunkBuilder:
    """Builds megatron model chunks for the chosen schedule, whichever way megatron.training builds them.

    * V placement: chunk ``vp_stage`` of pipeline rank i is built as V stage i (chunk 0) or 2d-1-i
      (chunk 1): its pre/post-process flags and a process-group collection whose pipeline view gives
      megatron's layer offsets for that stage (:mod:`megatron_vshape.runtime.placement`); once both chunks
      exist, a tied output layer gets the embedding's weights (both live on rank 0).
    * ``--schedule-invariant-init``: each chunk is built under :func:`dropout_seed.invariant_init`.
    """

    def __init__(self, args):
        self.args = args
        self.is_v = args.pipeline_schedule in V_SCHEDULE_NAMES
        self._chunks: list = []

    def build(self, make, pre_process, post_process, vp_stage, pg_collection, config=None):
        """``make(pre_process, post_process, vp_stage, pg_collection)`` builds one megatron module;
        ``config``: the TransformerConfig it builds from, when built beforehand (config containers)."""
        import contextlib

        from megatron.core import parallel_state

        if self.is_v:
            pre_process, post_process, vp_stage, pg_collection = self._v_chunk(vp_stage, pg_collection)
        context = contextlib.nullcontext()
        if self.args.schedule_invariant_init:
            from .dropout_seed import invariant_init

            context = invariant_init(self.args.seed, parallel_state.get_tensor_model_parallel_rank())
        with context, self._layout_for_build(config):
            model = make(pre_process, post_process, vp_stage, pg_collection)
        self._check_layers(model, vp_stage)
        if self.is_v:
            self._chunks.append(model)
            if len(self._chunks) == 2:
                from megatron_vshape.runtime.placement import tie_output_to_embedding

                tie_output_to_embedding(self._chunks)
                self._chunks = []
        return model

    @contextlib.contextmanager
    def _layout_for_build(self, config=None):
        """On a V with an uneven --pipeline-layout, the model gets megatron's layout class that answers
        for V chunks (runtime.layer_layout): a ``config`` built beforehand (config containers) keeps it
        for good (its sharded_state_dict asks later); a config the provider builds from args gets it
        because args carry it while the provider runs. Args keep the text otherwise: checkpoints
        store args and reload them with only safe classes."""
        layers = layout.counts(self.args)
        if not self.is_v or layers is None:
            yield
            return
        from megatron.core import parallel_state

        from megatron_vshape.runtime.layer_layout import megatron_layout
        from megatron_vshape.schedules import Placement

        placement = Placement.v_shape(parallel_state.get_pipeline_model_parallel_world_size())
        if config is not None and getattr(config, "pipeline_model_parallel_layout", None) is not None:
            config.pipeline_model_parallel_layout = megatron_layout(layers, placement)
        text = self.args.pipeline_model_parallel_layout
        self.args.pipeline_model_parallel_layout = megatron_layout(layers, placement)
        try:
            yield
        finally:
            self.args.pipeline_model_parallel_layout = text

    def _check_layers(self, model, vp_stage) -> None:
        """The chunk holds its stage's layers, numbered globally (a model path that bypassed the
        layout would silently train another split, with wrong checkpoint keys)."""
        layers = layout.counts(self.args)
        if layers is None:
            return
        from megatron.core import parallel_state

        from megatron_vshape.runtime.placement import chunk_specs
        from megatron_vshape.schedules import Placement

        d, rank = parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_rank()
        placement = Placement.v_shape(d) if self.is_v else Placement.looped(d, len(layers) // d)
        stage = chunk_specs(placement, rank)[vp_stage or 0].stage
        want = list(range(sum(layers[:stage]) + 1, sum(layers[:stage + 1]) + 1))
        decoder = getattr(_unwrap(model), "decoder", None)
        got = [int(layer.layer_number) for layer in getattr(decoder, "layers", [])]
        if got != want:
            raise ConfigError(f"--pipeline-layout: stage {stage} was built with layers {got}, not {want}; the model "
                              "provider must build GPTModel from the config megatron.training gives it")

    def _v_chunk(self, vp_stage, pg_collection):
        from megatron.core import parallel_state
        from megatron.core.process_groups_config import ProcessGroupCollection

        from megatron_vshape.runtime.placement import chunk_pg_collection, chunk_specs
        from megatron_vshape.schedules import Placement

        if vp_stage is None:
            raise ConfigError("--pipeline-schedule: a V schedule needs two model chunks per rank but megatron "
                              "built one; do not override --num-virtual-stages-per-pipeline-rank")
        placement = Placement.v_shape(parallel_state.get_pipeline_model_parallel_world_size())
        spec = chunk_specs(placement, parallel_state.get_pipeline_model_parallel_rank())[vp_stage]
        base = pg_collection if pg_collection is not None else ProcessGroupCollection.use_mpu_process_groups()
        return spec.pre_process, spec.post_process, spec.vp_stage, chunk_pg_collection(spec, placement, base)


def _unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def _wrap_model_construction(args) -> None:
    """Route both of megatron.training's model paths through one :class:`ChunkBuilder`.

    ``get_model(model_provider_func)`` (entry scripts with a model provider) and the config-container
    path (``pretrain_cfg_container_from_args(args, model_cfg)``: ``GPTModelBuilder.build_model``).
    """
    import megatron.training.training as training

    builder = ChunkBuilder(args)
    original_get_model = training.get_model
    if not getattr(original_get_model, "_vshape", False):

        @functools.wraps(original_get_model)
        def get_model(model_provider_func, *a, **kw):
            return original_get_model(_provider_through(builder, model_provider_func), *a, **kw)

        get_model._vshape = True
        training.get_model = get_model
    try:
        from megatron.training.models.gpt import GPTModelBuilder
    except ImportError:  # older megatron.training: no config-container builders
        return
    original_build = GPTModelBuilder.build_model
    if getattr(original_build, "_vshape", False):
        return

    @functools.wraps(original_build)
    def build_model(self, pg_collection, pre_process=None, post_process=None, vp_stage=None):
        return builder.build(lambda pre, post, vp, pgs: original_build(self, pgs, pre, post, vp),
                             pre_process, post_process, vp_stage, pg_collection,
                             config=getattr(getattr(self, "_model_config", None), "transformer", None))

    build_model._vshape = True
    GPTModelBuilder.build_model = build_model


def _provider_through(builder: ChunkBuilder, model_provider_func):
    @functools.wraps(model_provider_func)
    def provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None, **kw):
        def make(pre, post, vp, pgs):
            return model_provider_func(pre_process=pre, post_process=post, vp_stage=vp, config=config,
                                       pg_collection=pgs, **kw)

        return builder.build(make, pre_process, post_process, vp_stage, pg_collection)

    return provider


def _v_stage_predicates() -> None:
    """parallel_state's first/last-stage questions answer for the V placement's chunks.

    On a V, chunk 0 of pipeline rank 0 is the first stage and chunk 1 of rank 0 the last.

    * About a chunk (``vp_stage`` given, ``ignore_virtual=False``): the answer for that chunk.
    * Any other form *during a pass* (a forward, backward or W of one chunk; the executor names it in
      :mod:`megatron_vshape.runtime.active_stage`): the answer for the stage being run, as Megatron's
      interleaved schedule gives with its current virtual rank. Megatron-LM's ``get_batch`` asks
      ``mpu.is_pipeline_last_stage()`` without ``vp_stage`` to decide whether to load labels and the
      loss mask; on rank 0 that must be True while the loss chunk runs.
    * Between passes: Megatron's rank-level answers. The training loop reads the losses on the last
      pipeline rank, where :func:`relay_losses` puts them.
    """
    from megatron.core import parallel_state

    from megatron_vshape.runtime.active_stage import active_stage

    if getattr(parallel_state.is_pipeline_first_stage, "_vshape", False):
        return
    first, last = parallel_state.is_pipeline_first_stage, parallel_state.is_pipeline_last_stage

    def v_answer(megatron_answer, ignore_virtual, vp_stage, chunk: int, of_active) -> bool:
        if not ignore_virtual and vp_stage is not None:
            return parallel_state.get_pipeline_model_parallel_rank() == 0 and vp_stage == chunk
        running = active_stage()
        if running is not None:
            return of_active(running)
        return megatron_answer(ignore_virtual=ignore_virtual, vp_stage=vp_stage)

    @functools.wraps(first)
    def is_pipeline_first_stage(ignore_virtual=True, vp_stage=None):
        return v_answer(first, ignore_virtual, vp_stage, 0, lambda running: running.is_first)

    @functools.wraps(last)
    def is_pipeline_last_stage(ignore_virtual=True, vp_stage=None):
        return v_answer(last, ignore_virtual, vp_stage, 1, lambda running: running.is_last)

    is_pipeline_first_stage._vshape = is_pipeline_last_stage._vshape = True
    parallel_state.is_pipeline_first_stage = is_pipeline_first_stage
    parallel_state.is_pipeline_last_stage = is_pipeline_last_stage
