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

The module also holds the pieces the runtime tests share: the timeout-guarded spawn harness
(:func:`spawn`) and the per-rank worker (:func:`pipeline_worker`), so that one spawned process
group can check many schedules.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field, replace

# --- spawn harness ---------------------------------------------------------------------------


class SpawnError(RuntimeError):
    """A rank failed, died or timed out (the message carries its traceback)."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_entry(fn, rank, world_size, port, args, queue, backend="gloo"):
    os.environ.update(OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    if backend == "nccl":
        # Megatron's setting (and the one that makes NCCL p2p ordering matter); set before CUDA starts.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    try:
        import torch

        torch.set_num_threads(1)
        if backend == "nccl":
            # One GPU per rank, as torchrun + megatron.training set it; no device_id, as megatron.training
            # initialises, so NCCL creates its pair communicators lazily, as in a real run.
            torch.cuda.set_device(rank % torch.cuda.device_count())
        torch.distributed.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: B036 - report anything to the parent, then exit
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import torch

            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        except Exception:
            pass


_PORT_CLASH = ("Address already in use", "EADDRINUSE")


def spawn(fn, world_size: int, args: tuple = (), timeout: float = 300.0, attempts: int = 3,
          backend: str = "gloo") -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes with ``backend`` initialised
    (``nccl``: rank r on GPU r).

    Returns the per-rank results. Raises :class:`SpawnError` if any rank raises, dies, or the whole
    group exceeds ``timeout`` seconds; every spawned process is killed before returning or raising,
    so a deadlock fails instead of hanging. A rendezvous port taken by another process between
    picking and binding it (parallel test runs) is retried on a new port.
    """
    for attempt in range(attempts):
        try:
            return _spawn_once(fn, world_size, args, timeout, backend)
        except SpawnError as err:
            if attempt + 1 == attempts or not any(text in str(err) for text in _PORT_CLASH):
                raise
    raise AssertionError("unreachable")


def _spawn_once(fn, world_size: int, args: tuple, timeout: float, backend: str = "gloo") -> list:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    saved_env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "TORCHDYNAMO_DISABLE")}
    os.environ.update(OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")  # children inherit at import
    procs = [ctx.Process(target=_rank_entry, args=(fn, r, world_size, port, args, queue, backend), daemon=True)
             for r in range(world_size)]
    try:
        for proc in procs:
            proc.start()
        return _collect(procs, queue, world_size, timeout)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            if proc.pid is not None:
                proc.join(timeout=10)
        queue.close()
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _collect(procs, queue, world_size: int, timeout: float) -> list:
    import queue as queue_mod

    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    while len(results) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise SpawnError(f"timed out after {timeout:.0f}s; ranks done: {sorted(results)}")
        try:
            rank, status, payload = queue.get(timeout=min(remaining, 1.0))
        except queue_mod.Empty:
            dead = [i for i, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)
                    and i not in results]
            if dead:
                raise SpawnError(f"rank(s) {dead} died (exit codes {[procs[i].exitcode for i in dead]})") from None
            continue
        if status == "error":
            raise SpawnError(f"rank {rank} failed:\n{payload}")
        results[rank] = payload
    return [results[r] for r in range(world_size)]


# --- the small GPT ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSettings:
    """A tiny GPT whose every parameter gets a gradient (dropout off; fp32 and the local spec by default)."""

    num_layers: int = 8
    hidden_size: int = 32
    num_heads: int = 4
    seq_length: int = 16
    vocab_size: int = 64
    micro_batch_size: int = 2
    tied_embeddings: bool = False
    seed: int = 1234
    ffn_hidden_size: int | None = None
    dtype: str = "fp32"  # or "bf16": parameters, activations and p2p in bf16, gradients accumulated in fp32
    spec: str = "local"  # or "te": the GPU layer spec (see layer_spec)


@dataclass(frozen=True)
class RunSpec:
    """One parallel configuration; ``schedules`` all run inside one process group."""

    schedules: tuple[str, ...]
    pp: int
    tp: int = 1
    dp: int = 1
    microbatches: int = 8
    sequence_parallel: bool = False
    model: ModelSettings = field(default_factory=ModelSettings)
    measure_layers_only: bool = True
    overlap_grad_reduce: bool = False
    corrupt_plan: bool = False  # test only: swap two received messages on one rank
    also_tied: bool = False  # also run every schedule with tied embeddings (results "<name>+tied")
    distributed_optimizer: bool = False  # check one Adam step of megatron's distributed optimizer
    memory_limit: float | None = None  # for schedules that take one (v-auto)
    device: str = "cpu"  # "cuda": one GPU per rank, NCCL (the reference runs on GPU 0)
    # Uneven layers per stage (--pipeline-layout): one tuple of counts per stage count; a schedule
    # uses the one with as many entries as it has stages (2*pp on a V, pp for one chunk per rank)
    # and runs the uniform split when none matches.
    layouts: tuple[tuple[int, ...], ...] = ()

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
        return self.tp * self.pp * self.dp

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"


def make_config(model: ModelSettings, pp: int, tp: int, vp: int | None, sequence_parallel: bool, layout=None):
    """``layout``: megatron's PipelineParallelLayerLayout for uneven stages (``runtime.layer_layout``)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch_dtype(model.dtype)
    return TransformerConfig(
        pipeline_model_parallel_layout=layout,
        num_layers=model.num_layers, hidden_size=model.hidden_size, num_attention_heads=model.num_heads,
        ffn_hidden_size=model.ffn_hidden_size,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=model.dtype == "bf16",
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp, sequence_parallel=sequence_parallel,
        gradient_accumulation_fusion=False, deallocate_pipeline_outputs=True,
    )


DTYPES = ("fp32", "bf16")
SPECS = ("local", "te")


def torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def _sequence_parallel_norm():
    import torch

    class SequenceParallelLayerNorm(torch.nn.LayerNorm):
        """torch LayerNorm whose parameters megatron all-reduces over tensor parallel under SP.

        megatron-core's CPU fallback norm (WrappedTorchNorm) refuses sequence parallel, and apex /
        Transformer Engine norms do not install here; numerically this is the same LayerNorm.
        """

        def __init__(self, config, hidden_size, eps=1e-5):
            super().__init__(hidden_size, eps=eps)
            for param in self.parameters():
                param.sequence_parallel = config.sequence_parallel

    return SequenceParallelLayerNorm


def layer_spec(config, num_layers_in_chunk: int, spec_name: str = "local", split: bool = False):
    """megatron's local GPT layer spec (under sequence parallel with a norm that supports it), or the
    GPU spec (``spec_name="te"``): the split layer spec for a split schedule (megatron's splittable
    linears with TE attention and norms, as the training glue picks it), else megatron's TE spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if spec_name == "te":
        if split:
            from megatron_vshape.megatron.layer_spec import split_layer_spec

            return split_layer_spec()
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec()
    spec = get_gpt_layer_local_spec()
    if not config.sequence_parallel:
        return spec
    norm = _sequence_parallel_norm()
    spec.submodules.input_layernorm = norm
    spec.submodules.pre_mlp_layernorm = norm
    return TransformerBlockSubmodules(layer_specs=[spec] * num_layers_in_chunk, layer_norm=norm)


def build_gpt(config, model: ModelSettings, pre_process=True, post_process=True, vp_stage=None,
              pg_collection=None, num_stages: int = 1, split: bool = False):
    """``split``: the model is for a split schedule (with ``model.spec == "te"``: the split layer spec).
    The fused reference of a split run passes it too, so both build the same layers."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    layout = config.pipeline_model_parallel_layout
    chunk_layers = model.num_layers // num_stages if layout is None else layout.get_num_layers_to_build(vp_stage=vp_stage)
    return GPTModel(
        config=config, transformer_layer_spec=layer_spec(config, chunk_layers, model.spec, split),
        vocab_size=model.vocab_size, max_sequence_length=model.seq_length,
        pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=model.tied_embeddings,
        vp_stage=vp_stage, pg_collection=pg_collection,
    )


def microbatch(model: ModelSettings, index: int) -> dict:
    """Deterministic data of global microbatch ``index``."""
    import torch

    gen = torch.Generator().manual_seed(model.seed * 7919 + index)
    b, s = model.micro_batch_size, model.seq_length
    tokens = torch.randint(0, model.vocab_size, (b, s + 1), generator=gen)
    return {
        "tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(s).unsqueeze(0).expand(b, s).contiguous(),
        "attention_mask": torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None],
    }


def forward_step(data_iterator, model):
    """megatron forward_step_func: mean token loss per microbatch, reported as 'lm loss'."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach().clone(), "mb": batch["index"]}

    return output, loss_func


def _data(model: ModelSettings, indices, device: str = "cpu") -> list[dict]:
    return [dict({k: v.to(device) for k, v in microbatch(model, i).items()}, index=i) for i in indices]


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
        names[name] = ".".join(parts)
    return names


def _shard(full, param, tp_rank: int, tp_size: int):
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
    parallel_state.initialize_model_parallel(spec.tp, spec.pp)
    model_parallel_cuda_manual_seed(spec.model.seed)
    results = {}
    for (suffix, model), ref_path in zip(spec.variants(), ref_paths):
        reference = torch.load(ref_path, map_location=_device())
        for name in spec.schedules:
            results[name + suffix] = _run_schedule(name, spec, model, reference)
    parallel_state.destroy_model_parallel()
    return {"pp_rank": parallel_state_rank(spec, rank), "results": results}


def _device():
    """This rank's device: its GPU under NCCL (spawn set it), else the CPU."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.distributed.get_backend() == "nccl" else "cpu"


def uses_split_spec(spec: RunSpec) -> bool:
    """Whether the run's models are built for split schedules (matters for ``--spec te`` only)."""
    from megatron_vshape.schedules import fuses_backward

    splits = {not fuses_backward(name) for name in spec.schedules}
    if len(splits) > 1 and spec.model.spec == "te":
        raise ValueError("--spec te: split and fused schedules build different layers; check them in separate runs")
    return splits == {True}


def parallel_state_rank(spec: RunSpec, rank: int) -> int:
    from megatron.core import parallel_state

    try:
        return parallel_state.get_pipeline_model_parallel_rank()
    except Exception:  # already destroyed: recompute from megatron's default order tp-cp-ep-dp-pp
        return rank // (spec.tp * spec.dp)


def _run_schedule(name: str, spec: RunSpec, model_settings: ModelSettings, reference: dict) -> dict:
    from megatron.core import parallel_state

    from megatron_vshape.megatron.layout import layout_costs
    from megatron_vshape.runtime import ActivationMeter, build_forward_backward_func
    from megatron_vshape.schedules import SCHEDULES, Costs, simulate

    limit = spec.memory_limit if getattr(SCHEDULES[name], "takes_memory_limit", False) else None
    counts = spec.layout_for(num_stages(name, spec.pp))
    costs = Costs() if counts is None else layout_costs(Costs(), counts)
    fb = build_forward_backward_func(name, costs=costs, memory_limit=limit,
                                     plan_transform=_swap_two_messages if spec.corrupt_plan else None)
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

    with ActivationMeter.for_models(chunks, layers_only=spec.measure_layers_only) as meter:
        store = run(forward_only=False)
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
        "num_eval_losses": len(eval_store),
        "peak_activation_bytes": meter.peak_bytes,
        "predicted_peak_units": simulate(schedule, costs).peak_memory[pp_rank],  # per-stage work with a layout
    }


def num_stages(name: str, pp: int) -> int:
    """Global stages of schedule ``name`` at ``pp`` devices (2 chunks per rank on a V and interleaved)."""
    from megatron_vshape.schedules import SCHEDULES

    return pp * SCHEDULES[name].chunks_per_device()


def split_b_passes(program) -> int:
    """B passes of a device program whose W does not come right after (the executor runs a B that
    its W follows directly as one fused backward): each of these must defer weight gradients."""
    from megatron_vshape.schedules import Action, Kind

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
        config = make_config(chunk_settings, 1, spec.tp, None, spec.sequence_parallel)
    else:
        from megatron_vshape.runtime.layer_layout import megatron_layout

        chunk_settings = model_settings
        counts = spec.layout_for(placement.num_stages)
        layout = None if counts is None else megatron_layout(counts, placement)
        config = make_config(model_settings, spec.pp, spec.tp, vp, spec.sequence_parallel, layout)
    config.finalize_model_grads_func = finalize_model_grads
    chunks = build_model_chunks(
        placement, parallel_state.get_pipeline_model_parallel_rank(),
        lambda cs, pgs: build_gpt(config, chunk_settings, cs.pre_process, cs.post_process,
                                  None if one_device_chunks else cs.vp_stage, pgs,
                                  1 if one_device_chunks else placement.num_stages, split=uses_split_spec(spec)))
    if one_device_chunks:
        _number_one_device_layers(chunks, placement.stages_per_device[0], chunk_settings.num_layers)
    chunks = [chunk.to(_device(), torch_dtype(model_settings.dtype)) for chunk in chunks]
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for chunk in chunks:
            for local, param in chunk.named_parameters():
                full = reference["weights"][global_param_names(chunk)[local]]
                param.copy_(_shard(full, param, tp_rank, spec.tp))
    # bf16 accumulates and reduces gradients in fp32, as megatron.training forces for --bf16.
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=spec.overlap_grad_reduce, use_distributed_optimizer=spec.distributed_optimizer,
        grad_reduce_in_fp32=model_settings.dtype == "bf16")
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


def _swap_two_messages(plan):
    """Test only: post two receives from one peer in the wrong order (an activation and a gradient).

    Picks two consecutive messages of different payloads that the peer sends back to back, so the
    corrupted run completes (no deadlock) with the two tensors swapped.
    """
    from megatron_vshape.schedules import DevicePlan

    for peer, order in plan.recv_order.items():
        for i in range(len(order) - 1):
            if order[i].payload is not order[i + 1].payload:
                swapped = list(order)
                swapped[i], swapped[i + 1] = swapped[i + 1], swapped[i]
                recv_order = dict(plan.recv_order)
                recv_order[peer] = tuple(swapped)
                return DevicePlan(plan.steps, recv_order)
    return plan


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
        }
    return merged


def _parse(argv):
    from megatron_vshape.cli import OneLineParser  # a usage error is one line, not argparse's usage dump
    from megatron_vshape.schedules import schedule_names

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
    from megatron_vshape.schedules import inputs

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
    from megatron_vshape.schedules import SCHEDULES, fuses_backward, get_schedule

    _check_numbers(args)
    if args.schedule not in SCHEDULES:
        raise SystemExit(f"--schedule: unknown {args.schedule!r}; choose one of: {', '.join(SCHEDULES)}")
    for flag in ("pp", "tp", "dp", "microbatches"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag} must be >= 1")
    stages = num_stages(args.schedule, args.pp)
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
    if args.overlap_grad_reduce and not fuses_backward(args.schedule):
        raise SystemExit(f"--overlap-grad-reduce is not supported with split-backward schedule {args.schedule}; drop it")
    try:
        extra = {} if args.memory_limit is None else {"memory_limit": args.memory_limit}
        get_schedule(args.schedule, args.pp, args.microbatches, **extra)
    except ValueError as err:
        raise SystemExit(f"--schedule/--pp/--microbatches: {err}") from None
    if args.device == "cuda":
        _check_gpus(args.tp * args.pp * args.dp)


def _layout_counts(args, stages: int) -> tuple[int, ...] | None:
    """``--pipeline-layout`` as counts (None: uniform), or SystemExit with one line."""
    from megatron_vshape.schedules.stage_layout import BALANCED, UNIFORM, parse_layout

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
    from megatron_vshape.cli import UsageError, usage_error

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
