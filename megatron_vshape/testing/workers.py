"""The single-process reference and the per-rank pipeline worker, and the check that runs both.

The reference builds the whole model in one process and runs the ordinary fused backward; every
pipeline rank builds its chunks with the reference's weights (matched by global parameter name),
runs one iteration with the vshape executor, and reports gradient and loss errors and memory.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field, replace

from .spawn import spawn
from .tiny_gpt import ModelSettings, _data, build_gpt, forward_step, make_config, torch_dtype


@dataclass(frozen=True)
class RunSpec:
    """One parallel configuration; ``schedules`` all run inside one process group."""

    schedules: tuple[str, ...]
    pp: int
    tp: int = 1
    dp: int = 1
    cp: int = 1  # context parallel (needs attention that supports it: the TE stand-in's, or TE's on GPU)
    microbatches: int = 8
    sequence_parallel: bool = False
    model: ModelSettings = field(default_factory=ModelSettings)
    measure_layers_only: bool = True
    overlap_grad_reduce: bool = False
    # With it: Megatron's bucket size (None: its default), and every bucket's reduction completing at its launch,
    # so that a bucket launched before a pass adds to it misses that part deterministically (not when gloo's
    # thread happens to read it); ``launches_in_loop`` counts the launches before the vocabulary epilogue.
    bucket_size: int | None = None
    sync_bucket_launch: bool = False
    # The executor class each rank builds (a test subclass may rewrite the lowered plans on purpose).
    executor_type: type | None = None
    also_tied: bool = False  # also run every schedule with tied embeddings (results "<name>+tied")
    distributed_optimizer: bool = False  # check one Adam step of megatron's distributed optimizer
    memory_limit: float | None = None  # for schedules that take one (v-auto)
    device: str = "cpu"  # "cuda": one GPU per rank, NCCL (the reference runs on GPU 0)
    # Uneven layers per stage (--pipeline-layout): one tuple of counts per stage count; a schedule
    # uses the one with as many entries as it has stages (2*pp on a V, pp for one chunk per rank)
    # and runs the uniform split when none matches.
    layouts: tuple[tuple[int, ...], ...] = ()
    # --pipeline-vocab-parallel: the vocabulary layers sharded over the pipeline ranks, run as the
    # schedule's H and G passes (runtime/vocab_model.py, runtime/vocab_iteration.py)
    vocab_parallel: bool = False

    def layout_for(self, num_stages: int) -> tuple[int, ...] | None:
        """The layer counts a schedule with ``num_stages`` stages runs with (None: uniform)."""
        return next((tuple(c) for c in self.layouts if len(c) == num_stages), None)

    def variants(self) -> list[tuple[str, ModelSettings]]:
        """(result-name suffix, model) pairs this run checks."""
        out = [("", self.model)]
        if self.also_tied and not self.model.tied_embeddings:
            out.append(("+tied", replace(self.model, tied_embeddings=True)))
        return out

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"


# --- single-process reference ----------------------------------------------------------------


def reference_worker(rank, world_size, jobs: list, num_microbatches: int, device: str = "cpu", split: bool = False):
    """Full model in one process for each (model, output path) job: weights, losses, gradients by name.

    ``split`` builds the layers a split schedule gets (same spec, hence same parameter names); the
    backward here is always the ordinary fused one."""
    return [_reference_run(model, num_microbatches, path, device, split) for model, path in jobs]


def _reference_run(model: ModelSettings, num_microbatches: int, out_path: str, device: str = "cpu",
                   split: bool = False):
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_vshape.runtime.te_wgrad import run_te_wgrads_now

    if device == "cpu":
        from megatron_vshape.megatron.cpu_mode import enable_cpu_mode

        enable_cpu_mode()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(model.seed, force_reset_rng=True)
    torch.manual_seed(model.seed)
    # .to(dtype) as megatron's Float16Module does for --bf16 (the torch fallback norms are built in fp32).
    gpt = build_gpt(make_config(model, 1, 1, None, False), model, split=split).to(device, torch_dtype(model.dtype))
    weights = {n: p.detach().cpu().clone() for n, p in gpt.named_parameters()}
    # Each microbatch's gradient is added into an fp32 sum, as megatron DDP's main_grad does (for
    # fp32 this is exactly autograd's own accumulation into .grad).
    grads = {n: torch.zeros(p.shape, dtype=torch.float32, device=device) for n, p in gpt.named_parameters()}
    losses = []
    for batch in _data(model, range(num_microbatches), device):
        output = gpt(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        loss = output.float().mean()
        losses.append(loss.item())
        (loss / num_microbatches).backward()
        run_te_wgrads_now(gpt)  # TE linears that defer W (the TE split spec): their W right after B
        for n, p in gpt.named_parameters():
            grads[n] += p.grad.float()
            p.grad = None
    torch.save({"weights": weights, "grads": {n: g.cpu() for n, g in grads.items()}, "losses": losses}, out_path)
    return len(weights)


# --- per-rank pipeline worker ----------------------------------------------------------------


def global_param_names(chunk) -> dict[str, str]:
    """Local parameter name -> name in the single-process model (layer numbers made global)."""
    names = {}
    layers = chunk.decoder.layers if hasattr(chunk, "decoder") else []
    for name, _param in chunk.named_parameters():
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            parts[2] = str(layers[int(parts[2])].layer_number - 1)
        elif parts[0] == "output_layer" and getattr(chunk, "share_embeddings_and_output_weights", False):
            parts = ["embedding", "word_embeddings", "weight"]  # the tied copy
        elif parts[0] == "vocab_parallel":  # this rank's rows of the vocabulary layers (see _shard)
            parts = ["embedding", "word_embeddings", "weight"] if parts[1] == "embedding_weight" else ["output_layer",
                                                                                                       "weight"]
        names[name] = ".".join(parts)
    return names


def _shard(full, param, tp_rank: int, tp_size: int):
    rows = getattr(param, "vocab_rows", None)  # a vocabulary shard: its rows of the padded vocabulary
    if rows is not None:
        return full[rows[0]:rows[1]]
    if tp_size > 1 and getattr(param, "tensor_model_parallel", False):
        return full.chunk(tp_size, dim=param.partition_dim)[tp_rank]
    return full


def _rel_err(got, want) -> float:
    """Relative error of one gradient tensor: ||got - want||_2 / ||want||_2 (absolute if want is 0)."""
    scale = want.double().norm().item()
    diff = (got.double() - want.double()).norm().item()
    return diff / scale if scale > 0 else diff


def pipeline_worker(rank, world_size, spec: RunSpec, ref_paths: list):
    """Run every schedule of ``spec`` on this rank; return per-schedule errors and memory."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if spec.device == "cpu":
        from megatron_vshape.megatron.cpu_mode import enable_cpu_mode

        enable_cpu_mode()
    parallel_state.initialize_model_parallel(spec.tp, spec.pp, context_parallel_size=spec.cp)
    model_parallel_cuda_manual_seed(spec.model.seed)
    results = {}
    launches = _record_launches(spec.sync_bucket_launch) if spec.overlap_grad_reduce else None
    for (suffix, model), ref_path in zip(spec.variants(), ref_paths):
        reference = torch.load(ref_path, map_location=_device())
        for name in spec.schedules:
            results[name + suffix] = run_schedule(name, spec, model, reference, launches)
    parallel_state.destroy_model_parallel()
    return {"pp_rank": parallel_state_rank(spec, rank), "results": results}


def _device():
    """This rank's device: its GPU under NCCL (spawn set it), else the CPU."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.distributed.get_backend() == "nccl" else "cpu"


def uses_split_spec(spec: RunSpec) -> bool:
    """Whether the run's models are built for split schedules (matters for ``--spec te`` only)."""
    from megatron_vshape.schedules.generators.registry import fuses_backward

    splits = {not fuses_backward(name) for name in spec.schedules}
    if len(splits) > 1 and spec.model.spec == "te":
        raise ValueError("--spec te: split and fused schedules build different layers; check them in separate runs")
    return splits == {True}


def parallel_state_rank(spec: RunSpec, rank: int) -> int:
    from megatron.core import parallel_state

    try:
        return parallel_state.get_pipeline_model_parallel_rank()
    except Exception:  # already destroyed: recompute from megatron's default order tp-cp-ep-dp-pp
        return rank // (spec.tp * spec.cp * spec.dp)


class _Launches:
    """Bucket-group launches of the training call running now, before its vocabulary epilogue (in the pass loop)."""

    def __init__(self):
        self.in_loop = 0
        self.looping = True


def _record_launches(sync: bool) -> _Launches:
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    from megatron_vshape.runtime.vocab_iteration import VocabPasses

    launches = _Launches()
    start, epilogue = _ParamAndGradBucketGroup.start_grad_sync, VocabPasses.epilogue

    def start_grad_sync(self, *args, **kwargs):
        launched = self.grad_reduce_handle is None
        start(self, *args, **kwargs)
        if launched and self.grad_reduce_handle is not None:
            launches.in_loop += launches.looping
            if sync:
                self.grad_reduce_handle.wait()  # the reduction reads the bucket now, not later

    def vocab_epilogue(self):
        launches.looping = False
        return epilogue(self)

    _ParamAndGradBucketGroup.start_grad_sync = start_grad_sync
    VocabPasses.epilogue = vocab_epilogue
    return launches


def run_schedule(name: str, spec: RunSpec, model_settings: ModelSettings, reference: dict,
                 launches: _Launches | None = None) -> dict:
    from megatron.core import parallel_state

    from megatron_vshape.megatron.pipeline_layout import layout_costs
    from megatron_vshape.runtime import ActivationMeter, build_forward_backward_func
    from megatron_vshape.schedules.core.schedule import Costs, VocabWork
    from megatron_vshape.schedules.core.simulator import simulate
    from megatron_vshape.schedules.generators.registry import SCHEDULES

    limit = spec.memory_limit if getattr(SCHEDULES[name], "takes_memory_limit", False) else None
    counts = spec.layout_for(SCHEDULES[name].num_stages(spec.pp))
    costs = Costs() if counts is None else layout_costs(Costs(), counts)
    if spec.vocab_parallel:
        costs = replace(costs, vocab=VocabWork.parse("time=1"))
    extra = {} if spec.executor_type is None else {"executor_type": spec.executor_type}
    fb = build_forward_backward_func(name, costs=costs, memory_limit=limit, **extra)
    schedule = fb.schedule(spec.pp, spec.microbatches)
    chunks, model = _build_pipeline_model(schedule, spec, model_settings, reference)
    optimizer = _distributed_adam(model) if spec.distributed_optimizer else None
    dp_rank = parallel_state.get_data_parallel_rank()
    indices = [dp_rank * spec.microbatches + i for i in range(spec.microbatches)]

    def run(forward_only: bool):
        return fb(forward_step_func=forward_step,
                  data_iterator=[iter(_data(model_settings, indices, _device())) for _ in model],
                  model=model, num_microbatches=spec.microbatches, seq_length=model_settings.seq_length,
                  micro_batch_size=model_settings.micro_batch_size, forward_only=forward_only)

    in_loop = 0
    with ActivationMeter.for_models(chunks, layers_only=spec.measure_layers_only) as meter:
        if launches is not None:
            launches.in_loop, launches.looping = 0, True
        store = run(forward_only=False)
        if launches is not None:
            in_loop = launches.in_loop
    if optimizer is None:
        # Each replica divides by its own microbatch count and DDP averages over replicas, so the
        # gradients equal the reference's average over all microbatches.
        grad_err, worst = _max_error(chunks, reference, lambda param, want_w, want_g: _rel_err(param.main_grad, want_g))
    else:
        # The distributed optimizer reduce-scatters gradients (each replica keeps its shard), so
        # check the first Adam step it applies instead: w1 - w0 == -lr * g / (|g| + eps).
        optimizer.step()
        grad_err, worst = _max_error(chunks, reference, lambda param, want_w, want_g: _rel_err(
            param.detach() - want_w, -_ADAM_LR * want_g / (want_g.abs() + _ADAM_EPS)))
    counts = getattr(fb, "last_wgrad_counts", None)  # weight gradients B deferred / W ran (split schedules)
    eval_store = run(forward_only=True)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    return {
        "wgrad_deferred": getattr(counts, "deferred", 0), "wgrad_run": getattr(counts, "run", 0),
        "splits_backward": not schedule.fused_backward,
        "split_b_passes": split_b_passes(schedule.programs[pp_rank]),
        "max_grad_rel_err": grad_err, "worst_param": worst,
        "max_loss_abs_err": _loss_err(store, reference), "num_losses": len(store),
        "eval_loss_abs_err": _loss_err(eval_store, reference) if optimizer is None else 0.0,
        "num_eval_losses": len(eval_store), "launches_in_loop": in_loop,
        "buckets": sum(len(getattr(m, "bucket_groups", ())) for m in model),
        "peak_activation_bytes": meter.peak_bytes,
        "predicted_peak_units": simulate(schedule, costs).peak_memory[pp_rank],  # per-stage work with a layout
    }


def split_b_passes(program) -> int:
    """B passes of a device program whose W does not come right after (the executor runs a B that
    its W follows directly as one fused backward): each of these must defer weight gradients."""
    from megatron_vshape.schedules.core.actions import Action, Kind

    actions = list(program)
    return sum(1 for i, a in enumerate(actions) if a.kind is Kind.B
               and actions[i + 1: i + 2] != [Action(Kind.W, a.stage, a.microbatch)])


# A large eps keeps the first Adam step smooth in the gradient (about -lr * g for small g) and a large
# lr makes the step comparable to the weights (no cancellation in w1 - w0), so the
# check stays as sensitive to gradient errors as a plain gradient comparison.
_ADAM_LR, _ADAM_EPS = 1000.0, 1.0


def _build_pipeline_model(schedule, spec: RunSpec, model_settings: ModelSettings, reference: dict):
    """This rank's chunks (reference weights loaded by global name) and their DDP wrappers."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from megatron_vshape.runtime import build_model_chunks

    placement = schedule.placement
    vp = None if placement.chunks_per_device == 1 else placement.chunks_per_device
    one_device_chunks = spec.pp == 1 and vp is not None
    if one_device_chunks and spec.layout_for(placement.num_stages) is not None:
        raise ValueError("--pipeline-layout: uneven stages need --pp >= 2 (one-device chunks are built uniformly)")
    if one_device_chunks:
        # megatron-core ignores the virtual pipeline when PP is 1 (every chunk would build all the
        # layers, numbered from 1): build each chunk as a one-stage model of its own layers instead.
        chunk_settings = replace(model_settings, num_layers=model_settings.num_layers // placement.num_stages)
        config = make_config(chunk_settings, 1, spec.tp, None, spec.sequence_parallel, cp=spec.cp)
    else:
        from megatron_vshape.runtime.layer_layout import megatron_layout

        chunk_settings = model_settings
        counts = spec.layout_for(placement.num_stages)
        layout = None if counts is None else megatron_layout(counts, placement)
        config = make_config(model_settings, spec.pp, spec.tp, vp, spec.sequence_parallel, layout, cp=spec.cp)
    config.finalize_model_grads_func = finalize_model_grads
    chunks = build_model_chunks(
        placement, parallel_state.get_pipeline_model_parallel_rank(),
        lambda cs, pgs: build_gpt(config, chunk_settings, cs.pre_process, cs.post_process,
                                  None if one_device_chunks else cs.vp_stage, pgs,
                                  1 if one_device_chunks else placement.num_stages, split=uses_split_spec(spec)))
    if one_device_chunks:
        _number_one_device_layers(chunks, placement.stages_per_device[0], chunk_settings.num_layers)
    chunks = [chunk.to(_device(), torch_dtype(model_settings.dtype)) for chunk in chunks]
    if spec.vocab_parallel:
        from megatron_vshape.megatron.vocab_surgery import install_vocab_parallel

        layers = install_vocab_parallel(chunks, placement)
        for param in layers.parameters():  # which rows of the reference's weights and gradients it holds
            param.vocab_rows = (layers.shard.start, layers.shard.end)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for chunk in chunks:
            for local, param in chunk.named_parameters():
                full = reference["weights"][global_param_names(chunk)[local]]
                param.copy_(_shard(full, param, tp_rank, spec.tp))
    # bf16 accumulates and reduces gradients in fp32, as megatron.training forces for --bf16.
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=spec.overlap_grad_reduce, use_distributed_optimizer=spec.distributed_optimizer,
        grad_reduce_in_fp32=model_settings.dtype == "bf16", bucket_size=spec.bucket_size)
    model = [DistributedDataParallel(config, ddp_config, c) for c in chunks]
    for m in model:
        m.zero_grad_buffer()
    return chunks, model


def _number_one_device_layers(chunks, stages, layers_per_stage: int) -> None:
    """Give the layers of one-device chunks (``--pp 1``) their global numbers: chunk ``i`` holds
    stage ``stages[i]``. The number names the parameters (global_param_names); megatron reads it
    otherwise only for fp16 query-key scaling and inference caches, neither used here."""
    for stage, chunk in zip(stages, chunks):
        for layer in chunk.decoder.layers:
            for module in layer.modules():
                if isinstance(getattr(module, "layer_number", None), int):
                    module.layer_number += stage * layers_per_stage


def _distributed_adam(model):
    import torch
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(optimizer="adam", lr=_ADAM_LR, adam_eps=_ADAM_EPS, weight_decay=0.0, clip_grad=0.0,
                             use_distributed_optimizer=True, params_dtype=torch.float32)
    return get_megatron_optimizer(config, model)


def _max_error(chunks, reference: dict, error) -> tuple[float, str | None]:
    """Largest ``error(param, reference weight shard, reference grad shard)`` over this rank's params."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    worst, worst_name = 0.0, None
    for chunk in chunks:
        names = global_param_names(chunk)
        for local, param in chunk.named_parameters():
            want_w = _shard(reference["weights"][names[local]], param, tp_rank, tp_size)
            want_g = _shard(reference["grads"][names[local]], param, tp_rank, tp_size)
            err = error(param, want_w, want_g)
            if err > worst:
                worst, worst_name = err, names[local]
    return worst, worst_name


def _loss_err(store: list, reference: dict) -> float:
    return max((abs(item["lm loss"].item() - reference["losses"][item["mb"]]) for item in store), default=0.0)


# --- orchestration ---------------------------------------------------------------------------


def run_check(spec: RunSpec, timeout: float = 300.0) -> dict:
    """Reference run + pipeline run; returns {schedule: {error and memory figures}} (all ranks merged)."""
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [(model, os.path.join(tmp, f"reference{i}.pt")) for i, (_, model) in enumerate(spec.variants())]
        spawn(reference_worker, 1, (jobs, spec.microbatches * spec.dp, spec.device, uses_split_spec(spec)),
              timeout=timeout, backend=spec.backend)
        per_rank = spawn(pipeline_worker, spec.world_size, (spec, [path for _, path in jobs]), timeout=timeout,
                         backend=spec.backend)
    return merge_results(per_rank, spec)


def merge_results(per_rank: list, spec: RunSpec) -> dict:
    merged = {}
    for name in per_rank[0]["results"]:
        rows = [(r["pp_rank"], r["results"][name]) for r in per_rank]
        peak = [0] * spec.pp
        predicted = [0.0] * spec.pp
        for pp_rank, row in rows:
            peak[pp_rank] = max(peak[pp_rank], row["peak_activation_bytes"])
            predicted[pp_rank] = row["predicted_peak_units"]
        merged[name] = {
            "max_grad_rel_err": max(row["max_grad_rel_err"] for _, row in rows),
            "worst_param": max(rows, key=lambda r: r[1]["max_grad_rel_err"])[1]["worst_param"],
            "max_loss_abs_err": max(row["max_loss_abs_err"] for _, row in rows),
            "eval_loss_abs_err": max(row["eval_loss_abs_err"] for _, row in rows),
            "num_losses": sum(row["num_losses"] for _, row in rows),
            "num_eval_losses": sum(row["num_eval_losses"] for _, row in rows),
            "peak_activation_bytes": peak,
            "predicted_peak_units": predicted,
            "wgrad_deferred": sum(row.get("wgrad_deferred", 0) for _, row in rows),
            "wgrad_run": sum(row.get("wgrad_run", 0) for _, row in rows),
            "splits_backward": rows[0][1].get("splits_backward", False),
            "split_b_passes": sum(row.get("split_b_passes", 0) for _, row in rows),
            "launches_in_loop": sum(row.get("launches_in_loop", 0) for _, row in rows),
            "buckets": sum(row.get("buckets", 0) for _, row in rows),
        }
    return merged
