"""A tiny megatron-core GPT (dropout off, every parameter gets a gradient) and its deterministic data."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass


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


def make_config(model: ModelSettings, pp: int, tp: int, vp: int | None, sequence_parallel: bool, layout=None,
                cp: int = 1):
    """``layout``: megatron's PipelineParallelLayerLayout for uneven stages (``runtime.layer_layout``)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch_dtype(model.dtype)
    return TransformerConfig(
        pipeline_model_parallel_layout=layout,
        num_layers=model.num_layers, hidden_size=model.hidden_size, num_attention_heads=model.num_heads,
        ffn_hidden_size=model.ffn_hidden_size,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=model.dtype == "bf16",
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
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
        if split:  # as the training glue picks it: TE's own deferral from TE 2.3 on, else the split spec
            from megatron_vshape.megatron.layer_spec import split_layer_spec, te_deferral_available, te_split_layer_spec

            return te_split_layer_spec() if te_deferral_available() else split_layer_spec()
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
    """megatron forward_step_func: mean token loss per microbatch, reported as 'lm loss'.

    Under context parallelism each rank takes its share of the sequence (megatron's
    ``get_batch_on_this_cp_rank``) and returns (loss sum, token count) as Megatron-LM's pretrain_gpt
    does, so Megatron's forward_step averages over the CP group's tokens; the reported loss is the
    microbatch's mean over all of them."""
    from megatron.core import parallel_state

    batch = next(data_iterator)
    if parallel_state.model_parallel_is_initialized() and parallel_state.get_context_parallel_world_size() > 1:
        return _cp_forward_step(batch, model, parallel_state.get_context_parallel_group())
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach().clone(), "mb": batch["index"]}

    return output, loss_func


def _data(model: ModelSettings, indices, device: str = "cpu") -> list[dict]:
    return [dict({k: v.to(device) for k, v in microbatch(model, i).items()}, index=i) for i in indices]


def _on_this_cp_rank(batch: dict, cp_group) -> dict:
    """megatron's CP slicing of a batch's sequence tensors (its 0.19 and 0.16 signatures)."""
    import inspect

    from megatron.core.utils import get_batch_on_this_cp_rank

    tensors = {k: batch[k] for k in ("tokens", "labels", "position_ids", "attention_mask")}
    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(tensors, is_hybrid_cp=False, cp_group=cp_group)
    return get_batch_on_this_cp_rank(tensors)


def _cp_forward_step(batch, model, cp_group):
    import torch

    local = _on_this_cp_rank(batch, cp_group)
    output = model(local["tokens"], local["position_ids"], None, labels=local["labels"])

    def loss_func(output_tensor):
        total = output_tensor.float().sum()
        count = torch.tensor(output_tensor.numel(), dtype=torch.int)
        report = torch.stack([total.detach(), count.float()])
        torch.distributed.all_reduce(report, group=cp_group)
        return total, count, {"lm loss": report[0] / report[1], "mb": batch["index"]}

    return output, loss_func


def vocab_pipeline(schedule: str, world_size: int, num_microbatches: int, model: ModelSettings, executor_type=None):
    """(forward-backward function, this rank's DDP chunks) of ``schedule`` with ``--pipeline-vocab-parallel`` on
    the tiny GPT (megatron's parallel state initialised), for tests that count what a call issues."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_vshape.megatron.vocab_surgery import install_vocab_parallel
    from megatron_vshape.runtime import build_forward_backward_func, build_model_chunks
    from megatron_vshape.schedules.core.schedule import Costs, VocabWork

    func = build_forward_backward_func(schedule, costs=Costs(vocab=VocabWork(1.0, 1.0, 1.0, 0.5)),
                                       executor_type=executor_type)
    placement = func.schedule(world_size, num_microbatches).placement
    vp = None if placement.chunks_per_device == 1 else placement.chunks_per_device
    config = make_config(model, world_size, 1, vp, False)
    chunks = build_model_chunks(placement, parallel_state.get_pipeline_model_parallel_rank(), lambda cs, pgs: build_gpt(
        config, model, cs.pre_process, cs.post_process, cs.vp_stage, pgs, placement.num_stages))
    install_vocab_parallel(chunks, placement)
    return func, [DistributedDataParallel(config, DistributedDataParallelConfig(), c) for c in chunks]


def train_call(func, ddp: list, iterators: list, step, num_microbatches: int, model: ModelSettings):
    """One training call of ``func`` on ``ddp`` (a list of one chunk's DDP goes as the chunk, as Megatron's)."""
    return func(forward_step_func=step, data_iterator=iterators if len(ddp) > 1 else iterators[0],
                model=ddp if len(ddp) > 1 else ddp[0], num_microbatches=num_microbatches,
                seq_length=model.seq_length, micro_batch_size=model.micro_batch_size)


@contextlib.contextmanager
def recorded_vocab_rank(world_size: int):
    """One spawned rank of a pipeline of ``world_size`` (CPU mode, gloo) with the tiny model the vocabulary
    tests train; yields (its ``ModelSettings``, the posts): every ``CommQueue.post`` of the block appends the
    tensors it was given, so a test counts what the vocabulary queue moved. Restores the queue and the model
    parallel state after."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from ..megatron.cpu_mode import enable_cpu_mode
    from ..runtime import comm_queue

    torch.set_num_threads(1)
    enable_cpu_mode()
    parallel_state.initialize_model_parallel(1, world_size)
    model = ModelSettings(num_layers=4, hidden_size=32, seq_length=16, vocab_size=64)
    model_parallel_cuda_manual_seed(model.seed)
    posts: list[tuple] = []
    post = comm_queue.CommQueue.post

    def recording_post(self, issue, tensors=()):
        posts.append(tuple(tensors))
        return post(self, issue, tensors)

    comm_queue.CommQueue.post = recording_post
    try:
        yield model, posts
    finally:
        comm_queue.CommQueue.post = post
        parallel_state.destroy_model_parallel()
