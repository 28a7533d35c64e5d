"""Gradient-exact checks of Megatron's recipe features under every schedule (CPU, gloo, spawned ranks).

The features of NVIDIA's example recipes that change how a backward runs: recomputation (selective,
full uniform / block), MoE with expert parallelism (alltoall dispatcher, auxiliary loss), and DP
overlap (``--overlap-grad-reduce``: buckets launch during the pass loop, at their last W under a
split backward). The reference is the same GPT in one process (all experts local, no recomputation,
the ordinary fused backward); each pipeline run does ``iterations`` iterations on the same weights
and data and compares the gradients of every one with the reference.

``overlap_moe`` runs every training pass through Megatron's combined 1F1B step and the schedule's overlapped
F&B pairs as one call of it (``--overlap-moe-expert-parallel-comm``, ``runtime/combined_step.py``; the
schedule built at an all-to-all cost of 1 x F, so that it pairs). Megatron's config wants bf16 for the flag
(a rule about its GPU kernels); here the flag is set on an fp32 config after its checks, so the combined
path's maths is compared with the one-process fp32 reference at the same tolerance as every other run.

``backward_on_new_threads`` runs every backward of the pipeline ranks on a new, bare thread, as CUDA's autograd
runs it on its device thread (:mod:`.autograd_threads`): the B/W split's capture and the combined step's
backward must work from a thread that sees none of the executor's thread-locals.

``sync_bucket_launch`` makes every bucket reduction complete at its launch: a bucket launched before
the last W of one of its weights then ends up with that W's contribution un-reduced, which the
gradient check sees deterministically. Without it the launch is asynchronous, as in a real run (gloo's
work runs on its own thread and reads the bucket while later passes run). Every bucket must also be
launched before ``finalize_model_grads`` in every iteration (counted in ``late_launches``), or the
reduction did not overlap anything.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass

from .autograd_threads import backward_on_new_threads
from .spawn import spawn
from .tiny_gpt import ModelSettings, _data, forward_step
from .workers import _rel_err, global_param_names

RECOMPUTE = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full-uniform": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "full-block": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
}


@dataclass(frozen=True)
class RecipeSpec:
    """One parallel configuration of recipe features; ``schedules`` all run inside one process group."""

    schedules: tuple[str, ...]
    pp: int
    dp: int = 1
    ep: int = 1  # expert parallel, inside the data-parallel group
    microbatches: int = 4
    iterations: int = 2
    recompute: tuple[str, ...] = ("none",)  # every schedule runs under each mode ("name/mode" when several)
    num_experts: int | None = None
    overlap_grad_reduce: bool = False
    distributed_optimizer: bool = False
    sync_bucket_launch: bool = False
    bucket_size: int | None = 2000  # small buckets: several per chunk, so launches are per bucket
    model: ModelSettings = ModelSettings(num_layers=8)
    overlap_moe: bool = False  # every pass through Megatron's combined 1F1B step, pairs as one call of it
    backward_on_new_threads: bool = False  # every backward on a new thread, as on a GPU (module docstring)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp


def make_config(spec: RecipeSpec, pp: int, vp: int | None, ep: int, recompute: str = "none"):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    m = spec.model
    moe = {} if spec.num_experts is None else dict(
        num_moe_experts=spec.num_experts, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=1e-2, expert_model_parallel_size=ep, moe_grouped_gemm=False)
    config = TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_heads,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, add_bias_linear=False,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp, gradient_accumulation_fusion=False,
        deallocate_pipeline_outputs=True, **RECOMPUTE[recompute], **moe)
    if spec.overlap_moe:  # after __post_init__: its bf16 rule is about Megatron's GPU kernels (module docstring)
        config.overlap_moe_expert_parallel_comm = True
    return config


def plan_forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """tiny_gpt.forward_step, and with ``return_schedule_plan`` the GPT model's schedule plan instead of its
    output (what Megatron-LM's pretrain_gpt.forward_step returns to the combined 1F1B step)."""
    if not return_schedule_plan:
        return forward_step(data_iterator, model)
    batch = next(data_iterator)
    plan = model.build_schedule_plan(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                                     labels=batch["labels"])

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach().clone(), "mb": batch["index"]}

    return plan, loss_func


def build(spec: RecipeSpec, config, pre=True, post=True, vp_stage=None, pg_collection=None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    m = spec.model
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=spec.num_experts),
                    vocab_size=m.vocab_size, max_sequence_length=m.seq_length, pre_process=pre, post_process=post,
                    vp_stage=vp_stage, pg_collection=pg_collection)


def _global_names(chunk, ep_rank: int, local_experts: int) -> dict[str, str]:
    """Local parameter name -> the reference's (global layer numbers and expert indices)."""
    names = {}
    for local, name in global_param_names(chunk).items():
        parts = name.split(".")
        if "local_experts" in parts:
            i = parts.index("local_experts") + 1
            parts[i] = str(int(parts[i]) + ep_rank * local_experts)
        names[local] = ".".join(parts)
    return names


def _aux_loss_scale(num_microbatches: int) -> None:
    """The MoE auxiliary loss's backward scale, as Megatron's forward_step sets it (loss / microbatches)."""
    import torch
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / num_microbatches))


def reference_worker(rank, world_size, spec: RecipeSpec, out_path: str):
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_vshape.megatron.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(spec.model.seed)
    torch.manual_seed(spec.model.seed)
    reference = RecipeSpec(spec.schedules, 1, num_experts=spec.num_experts, model=spec.model)  # no recomputation
    gpt = build(reference, make_config(reference, 1, None, 1))
    weights = {n: p.detach().clone() for n, p in gpt.named_parameters()}
    total = spec.microbatches * spec.dp
    if spec.num_experts is not None:
        _aux_loss_scale(total)
    losses = []
    for batch in _data(spec.model, range(total)):
        output = gpt(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        loss = output.float().mean()
        losses.append(loss.item())
        (loss / total).backward()
    grads = {n: p.grad.clone() for n, p in gpt.named_parameters()}
    torch.save({"weights": weights, "grads": grads, "losses": losses}, out_path)
    parallel_state.destroy_model_parallel()


def pipeline_worker(rank, world_size, spec: RecipeSpec, ref_path: str):
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_vshape.megatron.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    parallel_state.initialize_model_parallel(1, spec.pp, expert_model_parallel_size=spec.ep)
    model_parallel_cuda_manual_seed(spec.model.seed)
    reference = torch.load(ref_path)
    launches = _record_launches(spec.sync_bucket_launch)
    results = {}
    for name in spec.schedules:
        for mode in spec.recompute:
            with backward_on_new_threads() if spec.backward_on_new_threads else contextlib.nullcontext() as engine:
                row = _run_schedule(name, mode, spec, reference, launches)
            row["backward_threads"] = engine.threads_used if engine is not None else 0
            results[result_name(spec, name, mode)] = row
    parallel_state.destroy_model_parallel()
    return results


class _Launches:
    """Bucket-group launches: how many happened outside finalize_model_grads (early) and inside."""

    def __init__(self):
        self.early = self.late = 0
        self.finalizing = False


def _record_launches(sync: bool) -> _Launches:
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    launches = _Launches()
    original = _ParamAndGradBucketGroup.start_grad_sync

    def start_grad_sync(self, *args, **kwargs):
        launched = self.grad_reduce_handle is None
        original(self, *args, **kwargs)
        if launched and self.grad_reduce_handle is not None:
            if launches.finalizing:
                launches.late += 1
            else:
                launches.early += 1
            if sync:
                self.grad_reduce_handle.wait()  # the reduction reads the bucket now, not later

    _ParamAndGradBucketGroup.start_grad_sync = start_grad_sync
    return launches


def result_name(spec: RecipeSpec, schedule: str, recompute: str) -> str:
    return schedule if len(spec.recompute) == 1 else f"{schedule}/{recompute}"


def _run_schedule(name: str, recompute: str, spec: RecipeSpec, reference: dict, launches: _Launches) -> dict:
    import torch
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from megatron_vshape.runtime import ActivationMeter, build_forward_backward_func, build_model_chunks
    from megatron_vshape.schedules.core.schedule import Costs

    fb = build_forward_backward_func(name, costs=Costs(a2a=1.0) if spec.overlap_moe else Costs())
    placement = fb.schedule(spec.pp, spec.microbatches).placement
    vp = None if placement.chunks_per_device == 1 else placement.chunks_per_device
    config = make_config(spec, spec.pp, vp, spec.ep, recompute)

    def finalize(*args, **kwargs):
        launches.finalizing = True
        try:
            return finalize_model_grads(*args, **kwargs)
        finally:
            launches.finalizing = False

    config.finalize_model_grads_func = finalize
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks = build_model_chunks(placement, pp_rank, lambda cs, pgs: build(
        spec, config, cs.pre_process, cs.post_process, cs.vp_stage, pgs))
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    local_experts = (spec.num_experts or 0) // spec.ep
    names = [_global_names(c, ep_rank, local_experts) for c in chunks]
    with torch.no_grad():
        for chunk, chunk_names in zip(chunks, names):
            for local, param in chunk.named_parameters():
                param.copy_(reference["weights"][chunk_names[local]])
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=spec.overlap_grad_reduce, use_distributed_optimizer=spec.distributed_optimizer,
        bucket_size=spec.bucket_size if spec.overlap_grad_reduce else None)
    model = [DistributedDataParallel(config, ddp_config, c) for c in chunks]
    dp_rank = parallel_state.get_data_parallel_rank()
    indices = [dp_rank * spec.microbatches + i for i in range(spec.microbatches)]
    early, late, losses = [], [], []
    worst, worst_name = 0.0, None
    with ActivationMeter.for_models(chunks, layers_only=True) as meter:
        for iteration in range(spec.iterations):
            for m in model:
                m.zero_grad_buffer()
            before = (launches.early, launches.late)
            losses = fb(forward_step_func=plan_forward_step if spec.overlap_moe else forward_step,
                        data_iterator=[iter(_data(spec.model, indices)) for _ in model], model=model,
                        num_microbatches=spec.microbatches, seq_length=spec.model.seq_length,
                        micro_batch_size=spec.model.micro_batch_size, forward_only=False)
            early.append(launches.early - before[0])
            late.append(launches.late - before[1])
            # Every iteration's gradients (same weights and data each time): the executor's first call is
            # the one that creates its weight-gradient store, and a launch decided before that differs.
            for chunk, chunk_names in zip(chunks, names):
                for local, param in chunk.named_parameters():
                    err = _rel_err(param.main_grad, reference["grads"][chunk_names[local]])
                    if err > worst:
                        worst, worst_name = err, f"{chunk_names[local]} (iteration {iteration + 1})"
    loss_err = max((abs(item["lm loss"].item() - reference["losses"][item["mb"]]) for item in losses), default=0.0)
    counts = getattr(fb, "last_wgrad_counts", None)
    return {"max_grad_rel_err": worst, "worst_param": worst_name, "max_loss_abs_err": loss_err,
            "num_losses": len(losses), "early_launches": early, "late_launches": late,
            "buckets": sum(len(m.bucket_groups) + len(m.expert_parallel_bucket_groups) for m in model),
            "wgrad_deferred": getattr(counts, "deferred", 0), "peak_activation_bytes": meter.peak_bytes,
            "pp_rank": pp_rank, "pairs": len(fb.schedule(spec.pp, spec.microbatches).pairs)}


def run_recipe_check(spec: RecipeSpec, timeout: float = 300.0) -> dict:
    """Reference + pipeline run; {schedule: merged figures} (worst over ranks; per-rank peaks and launches)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "reference.pt")
        spawn(reference_worker, 1, (spec, path), timeout=timeout)
        per_rank = spawn(pipeline_worker, spec.world_size, (spec, path), timeout=timeout)
    merged = {}
    for name in per_rank[0]:
        rows = [r[name] for r in per_rank]
        peaks = [0] * spec.pp
        for row in rows:
            peaks[row["pp_rank"]] = max(peaks[row["pp_rank"]], row["peak_activation_bytes"])
        worst = max(rows, key=lambda r: r["max_grad_rel_err"])
        merged[name] = {
            "max_grad_rel_err": worst["max_grad_rel_err"], "worst_param": worst["worst_param"],
            "max_loss_abs_err": max(r["max_loss_abs_err"] for r in rows),
            "num_losses": sum(r["num_losses"] for r in rows),
            "early_launches": [sum(r["early_launches"][i] for r in rows) for i in range(spec.iterations)],
            "late_launches": [sum(r["late_launches"][i] for r in rows) for i in range(spec.iterations)],
            "buckets": sum(r["buckets"] for r in rows),
            "wgrad_deferred": sum(r["wgrad_deferred"] for r in rows), "peak_activation_bytes": peaks,
            "pairs": rows[0]["pairs"], "backward_threads": sum(r["backward_threads"] for r in rows),
        }
    return merged
