"""Gradient-exact check of HybridModel chunks on a schedule's placement against one process (CPU, gloo).

The reference builds the whole HybridModel (megatron-core's torch layers, :mod:`megatron_vshape.megatron.
hybrid_spec`) in one process and runs the ordinary backward; each pipeline rank builds its chunks for the
schedule's placement (on a V, chunk 1 of rank i is stage 2d-1-i: the pattern's segment 2d-1-i, with its
global layer numbers) with the reference's weights (matched by global parameter name), runs one iteration
with the vshape executor and reports its largest gradient and loss errors. Needs megatron-core >= 0.19
(HybridModel) and its megatron.training (the hybrid patches are checked against it).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from .spawn import spawn
from .tiny_gpt import ModelSettings, _data, forward_step, make_config
from .workers import _loss_err, _rel_err, global_param_names


@dataclass(frozen=True)
class HybridSettings:
    """A tiny HybridModel: ``pattern`` without ``|`` (the check cuts it into the schedule's stages)."""

    pattern: str = "*-*E*-*E"
    num_experts: int = 4
    topk: int = 2
    model: ModelSettings = ModelSettings()
    spec: str = "local"  # or "split": the GPU spec of split schedules (TE attention and norms, megatron linears)
    device: str = "cpu"  # or "cuda": one GPU per rank, NCCL

    def gpt_settings(self) -> ModelSettings:
        from dataclasses import replace

        return replace(self.model, num_layers=len(self.pattern))


def _setup(pp: int, device: str):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_vshape.megatron.hybrid_spec import install
    from megatron_vshape.megatron.training_cpu import require_megatron_training

    if device == "cpu":
        from megatron_vshape.megatron.cpu_mode import enable_cpu_mode

        enable_cpu_mode()
    require_megatron_training()  # the patch table's hybrid entries include megatron.training's builder
    install(cpu=device == "cpu")
    parallel_state.initialize_model_parallel(1, pp)
    return model_parallel_cuda_manual_seed


def _config(settings: HybridSettings, pp: int, vp: int | None):
    from dataclasses import replace

    config = make_config(settings.gpt_settings(), pp, 1, vp, False)
    # Mamba-2 at a tiny width: 16 heads (Mamba's in_proj width must divide by 16), one group, state 16;
    # the head dim (2 x hidden / 16) must be >= 16 for its Triton kernels, so --hidden-size >= 128 with 'M'.
    mamba = dict(mamba_num_heads=16, mamba_head_dim=2 * config.hidden_size // 16, mamba_num_groups=1,
                 mamba_state_dim=16)
    return replace(config, num_moe_experts=settings.num_experts, moe_router_topk=settings.topk,
                   moe_ffn_hidden_size=config.ffn_hidden_size, add_bias_linear=False, **mamba)


def _build(settings: HybridSettings, config, pattern: str, pre_process=True, post_process=True, vp_stage=None,
           pg_collection=None):
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from megatron_vshape.megatron.hybrid_spec import hybrid_local_spec, hybrid_split_spec

    model = settings.model
    spec = {"local": hybrid_local_spec, "split": hybrid_split_spec}[settings.spec](num_experts=settings.num_experts)
    return HybridModel(config=config, hybrid_stack_spec=spec,
                       vocab_size=model.vocab_size, max_sequence_length=model.seq_length,
                       hybrid_layer_pattern=pattern, pre_process=pre_process, post_process=post_process,
                       position_embedding_type="learned_absolute", vp_stage=vp_stage, pg_collection=pg_collection)


def reference_worker(rank, world_size, settings: HybridSettings, microbatches: int, out_path: str):
    import torch

    seed = _setup(1, settings.device)
    seed(settings.model.seed, force_reset_rng=True)
    torch.manual_seed(settings.model.seed)
    model = _build(settings, _config(settings, 1, None), settings.pattern).to(settings.device)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    losses = []
    for batch in _data(settings.model, range(microbatches), settings.device):
        loss = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]).float().mean()
        losses.append(loss.item())
        (loss / microbatches).backward()
        for n, p in model.named_parameters():
            grads[n] += p.grad
            p.grad = None
    torch.save({"weights": weights, "grads": grads, "losses": losses}, out_path)
    return len(weights)


def pipeline_worker(rank, world_size, settings: HybridSettings, schedule_name: str, microbatches: int, ref_path: str):
    import torch
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from megatron_vshape.megatron.hybrid_pattern import HybridPattern
    from megatron_vshape.runtime import build_forward_backward_func, build_model_chunks

    seed = _setup(world_size, settings.device)
    seed(settings.model.seed)
    device = torch.device("cuda", torch.cuda.current_device()) if settings.device == "cuda" else "cpu"
    reference = torch.load(ref_path, map_location=device)
    fb = build_forward_backward_func(schedule_name)
    placement = fb.schedule(world_size, microbatches).placement
    per_stage = len(settings.pattern) // placement.num_stages
    pattern = HybridPattern.parse(settings.pattern).split((per_stage,) * placement.num_stages).text()
    # PP 1 (both V chunks on one device): megatron-core takes no virtual pipeline there; the chunks'
    # segments come from their pipeline views (hybrid_spec), not from the config.
    vp = None if placement.chunks_per_device == 1 or world_size == 1 else placement.chunks_per_device
    config = _config(settings, world_size, vp)
    config.finalize_model_grads_func = finalize_model_grads
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks = build_model_chunks(placement, pp_rank, lambda cs, pgs: _build(
        settings, config, pattern, cs.pre_process, cs.post_process, cs.vp_stage, pgs).to(device))
    layers = [[int(layer.layer_number) for layer in chunk.decoder.layers] for chunk in chunks]
    with torch.no_grad():
        for chunk in chunks:
            for local, param in chunk.named_parameters():
                param.copy_(reference["weights"][global_param_names(chunk)[local]])
    model = [DistributedDataParallel(config, DistributedDataParallelConfig(), c) for c in chunks]
    for m in model:
        m.zero_grad_buffer()
    store = fb(forward_step_func=forward_step,
               data_iterator=[iter(_data(settings.model, range(microbatches), device)) for _ in model],
               model=model, num_microbatches=microbatches, seq_length=settings.model.seq_length,
               micro_batch_size=settings.model.micro_batch_size, forward_only=False)
    worst, worst_name = 0.0, None
    for chunk in chunks:
        names = global_param_names(chunk)
        for local, param in chunk.named_parameters():
            err = _rel_err(param.main_grad, reference["grads"][names[local]])
            if err > worst:
                worst, worst_name = err, names[local]
    counts = getattr(fb, "last_wgrad_counts", None)
    return {"pp_rank": pp_rank, "layers": layers, "max_grad_rel_err": worst, "worst_param": worst_name,
            "max_loss_abs_err": _loss_err(store, reference), "num_losses": len(store),
            "wgrad_deferred": getattr(counts, "deferred", 0), "wgrad_run": getattr(counts, "run", 0)}


def run_hybrid_check(schedules, pp: int = 2, microbatches: int = 4, settings: HybridSettings = HybridSettings(),
                     timeout: float = 300.0) -> dict:
    """{schedule: [per-rank result]} for each schedule against one single-process reference."""
    with tempfile.TemporaryDirectory() as tmp:
        ref_path = os.path.join(tmp, "reference.pt")
        backend = "nccl" if settings.device == "cuda" else "gloo"
        spawn(reference_worker, 1, (settings, microbatches, ref_path), timeout=timeout, backend=backend)
        return {name: spawn(pipeline_worker, pp, (settings, name, microbatches, ref_path), timeout=timeout,
                            backend=backend)
                for name in schedules}


def main(argv=None) -> int:
    """One JSON line per the GPU check's verify steps; exit 1 when a gradient, loss or W count is off."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description="HybridModel chunks on a schedule vs one process")
    parser.add_argument("--pattern", default=HybridSettings.pattern)
    parser.add_argument("--schedule", default="v-half")
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--spec", choices=("local", "split"), default="local")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=ModelSettings.hidden_size)
    parser.add_argument("--grad-tol", type=float, default=1e-6)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    settings = HybridSettings(pattern=args.pattern, spec=args.spec, device=args.device,
                              model=ModelSettings(hidden_size=args.hidden_size))
    ranks = run_hybrid_check((args.schedule,), args.pp, args.microbatches, settings, args.timeout)[args.schedule]
    out = {key: max(r[key] for r in ranks) for key in ("max_grad_rel_err", "max_loss_abs_err")}
    out.update(grad_tol=args.grad_tol, wgrad_deferred=sum(r["wgrad_deferred"] for r in ranks),
               wgrad_run=sum(r["wgrad_run"] for r in ranks), layers=[r["layers"] for r in ranks])
    problems = [f"{key} {out[key]:.2e} > {args.grad_tol:g}" for key in ("max_grad_rel_err", "max_loss_abs_err")
                if out[key] > args.grad_tol]
    if not out["wgrad_deferred"] or out["wgrad_deferred"] != out["wgrad_run"]:
        problems.append(f"W deferred/run {out['wgrad_deferred']}/{out['wgrad_run']}: B did not defer to W")
    out["problems"] = problems
    print(json.dumps(out), flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
