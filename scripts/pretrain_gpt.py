#!/usr/bin/env python
"""GPT pretraining on megatron.training (megatron-core 0.19.x) with megatron-vshape's pipeline schedules.

Megatron's conventions throughout: its flags, its mock (``--mock-data``) and indexed (``--data-path``)
GPT datasets, its iteration log lines, ``--save``/``--load``. Our flags (``--pipeline-schedule``,
``--pipeline-memory-limit``, ``--cpu``, ``--[no-]schedule-invariant-dropout``) come from
:func:`megatron_vshape.add_arguments`; :func:`megatron_vshape.install` wires the schedule in during
argument validation. Each training iteration also logs a ``[vshape]`` line: the schedule, the
simulator's predicted bubble, the peak activation memory of every pipeline rank, and on GPU the
TFLOP/s per GPU and MFU.

CPU example (4 ranks, gloo, about a minute on 2 cores)::

    torchrun --nproc-per-node 4 scripts/pretrain_gpt.py --cpu --pipeline-schedule v-half \\
        --pipeline-model-parallel-size 4 --num-layers 8 --hidden-size 64 --num-attention-heads 4 \\
        --seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 16 \\
        --train-iters 5 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --log-interval 1
"""

import time

_PROGRAM_START = time.time()

import sys  # noqa: E402
from functools import partial  # noqa: E402


def _is_v(args) -> bool:
    from megatron_vshape.megatron.flags import V_SCHEDULE_NAMES

    return args.pipeline_schedule in V_SCHEDULE_NAMES


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """Megatron's GPTModel, with Megatron's --spec, or the local (torch) or Transformer Engine layer spec."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    if config is None:
        config = core_transformer_config_from_args(args)
    if args.spec is not None:  # Megatron's --spec; split schedules on TE set it (megatron_vshape.megatron.layer_spec)
        from megatron.core.transformer.spec_utils import import_module

        layer_spec = import_module(args.spec)
    elif args.transformer_impl == "local":
        layer_spec = get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm,
                                              normalization=args.normalization)
    else:
        layer_spec = get_gpt_layer_with_transformer_engine_spec(args.num_experts, args.moe_grouped_gemm,
                                                                args.qk_layernorm)
    return GPTModel(
        config=config, transformer_layer_spec=layer_spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, vp_stage=vp_stage, pg_collection=pg_collection,
    )


def get_batch(data_iterator, is_first: bool, is_last: bool):
    """This chunk's part of the next batch: tokens on the first stage, labels on the last.

    First/last come from the model chunk itself, not from the pipeline rank: on a V, rank 0 holds
    both the first stage (chunk 0) and the last (chunk 1).
    """
    import torch
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_tp_rank
    from megatron.training import get_args

    if not (is_first or is_last):
        return None, None, None, None, None
    args = get_args()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    batch = None
    if tp_rank == 0:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        batch = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                 for k, v in next(data_iterator).items()}
    batch = get_batch_on_this_tp_rank(
        batch, False, False, args.create_attention_mask_in_dataloader,
        parallel_state.get_tensor_model_parallel_src_rank(), parallel_state.get_tensor_model_parallel_group(),
        args.context_parallel_size, tp_rank, args.micro_batch_size, args.seq_length, False,
        args.pipeline_model_parallel_size, is_first, is_last,
    )
    return (batch.get("tokens"), batch.get("labels"), batch.get("loss_mask"), batch.get("attention_mask"),
            batch.get("position_ids"))


def loss_func(loss_mask, output_tensor):
    """Sum of token losses and the token count: megatron averages over the global batch's tokens."""
    import torch

    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    from megatron.training import get_timers

    timers = get_timers()
    inner = _unwrap(model)
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
        data_iterator, inner.pre_process, inner.post_process)
    timers("batch-generator").stop()
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def is_dataset_built_on_rank(vp_stage=None):
    """Data is read where a chunk is the first or the last stage (on a V: both chunks of rank 0)."""
    from megatron.core import parallel_state
    from megatron.training import get_args

    if parallel_state.get_tensor_model_parallel_rank() != 0:
        return False
    args = get_args()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    if _is_v(args):
        return pp_rank == 0
    if args.pipeline_model_parallel_size == 1:
        return True
    vp_size = args.virtual_pipeline_model_parallel_size
    first = pp_rank == 0 and (vp_stage in (None, 0))
    last = pp_rank == args.pipeline_model_parallel_size - 1 and (vp_size is None or vp_stage in (None, vp_size - 1))
    return first or last


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer, print_rank_0
    from megatron.training.utils import get_blend_and_blend_per_split

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, path_to_cache=args.data_cache_path, tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, partial(is_dataset_built_on_rank, vp_stage=vp_stage), config,
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


def get_embedding_ranks(pp_ranks):
    """Ranks holding a copy of the word embeddings: first and last, or only rank 0 on a V."""
    from megatron.training import get_args

    if _is_v(get_args()) or len(pp_ranks) == 1:
        return [pp_ranks[0]]
    return [pp_ranks[0], pp_ranks[-1]]


def main() -> None:
    from megatron_vshape.megatron.training_cpu import require_megatron_training

    require_megatron_training()
    from megatron_vshape.megatron.install import hook_arguments

    hook_arguments()  # our flags; our checks before Megatron's; install() right after them
    from megatron.core.enums import ModelType
    from megatron.training import pretrain, set_startup_timestamps
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    set_startup_timestamps(program_start=_PROGRAM_START, main_entry=time.time())
    # Megatron 0.19 leaves --eval-interval unset and then divides by it; 1000 was its classic default.
    args = parse_and_validate_args(args_defaults={"eval_interval": 1000})
    train_valid_test_datasets_provider.is_distributed = True
    pretrain(
        pretrain_cfg_container_from_args(args), train_valid_test_datasets_provider, ModelType.encoder_or_decoder,
        forward_step, model_provider=model_provider, get_embedding_ranks=get_embedding_ranks,
    )
    from megatron_vshape.run import shutdown_distributed

    shutdown_distributed()


if __name__ == "__main__":
    sys.exit(main())
