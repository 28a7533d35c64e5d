"""The surgery of vocabulary parallelism on one rank's Megatron model chunks (``--pipeline-vocab-parallel``).

* :func:`install_vocab_parallel`: the surgery of one rank's chunks, right after Megatron's model provider
  built them and before DDP wraps them (``ChunkBuilder.build`` calls :func:`add_built_chunk` under
  ``args.pipeline_vocab_parallel``). The first stage's word-embedding lookup becomes
  :class:`EmbeddingInput` (it returns the tensor the executor hands it); the last stage keeps the
  decoder's final norm and returns the final hidden state (``post_process`` off, so ``GPTModel`` returns
  ``hidden_states`` from ``_postprocess`` in 0.19.2 and main), its output layer is deleted and the labels
  it is called with are recorded (:class:`FinalOutput`); no chunk shares embeddings any more, so
  ``finalize_model_grads`` finds no word-embedding weight to all-reduce and no tied copy is left. The
  initial shard values are the rows of the weights Megatron initialised: the first stage's embedding and
  the last stage's untied output layer, scattered over the pipeline group (one collective per weight,
  the embedding first), after which the full copies are dropped.
"""

from __future__ import annotations

import inspect
import weakref

import torch

from ..runtime.placement import PipelineRankView, _unwrap, chunk_specs
from ..runtime.vocab_iteration import LAYERS_NAME
from ..schedules.core.schedule import Placement
from .flags import V_SCHEDULE_NAMES, ConfigError
from .vocab_checks import FLAG, check_vocab_sizes
from .vocab_hooks import EmbeddingInput, FinalOutput
from .vocab_layers import VocabShardLayers


def placement_for(args, pp_size: int) -> Placement:
    """The stage placement of the run: the V for V schedules, else looped with Megatron's virtual stages."""
    if getattr(args, "pipeline_schedule", None) in V_SCHEDULE_NAMES:
        return Placement.v_shape(pp_size)
    return Placement.looped(pp_size, getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)


_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ChunkBuilder -> chunks built so far


def add_built_chunk(builder, model) -> None:
    """``ChunkBuilder.build``'s hook: once the rank's last chunk is built, :func:`install_vocab_parallel`."""
    from megatron.core import parallel_state

    from ..runtime.compat import megatron_core_version
    from .vocab_checks import check_vocab_parallel

    check_vocab_parallel(builder.args, megatron_core_version())  # the version, where the start-up could not read it
    built = _BUILT.setdefault(builder, [])
    built.append(model)
    placement = placement_for(builder.args, parallel_state.get_pipeline_model_parallel_world_size())
    if len(built) == placement.chunks_per_device:
        chunks = list(built)
        built.clear()
        install_vocab_parallel(chunks, placement)


def install_vocab_parallel(chunks, placement: Placement, *, tp_group=None, pp_group=None,
                           dp_cp_group=None) -> VocabShardLayers:
    """Strip this rank's model chunks (all of them, in local order, before DDP wraps them) and give the
    first a :class:`VocabShardLayers` holding its rows of Megatron's initial weights.

    Every pipeline rank calls it at the same point (it scatters the rows over the pipeline group). Groups
    default to the first chunk's ``pg_collection`` (TP, pipeline, DP x CP).
    """
    models = [_unwrap(c) for c in chunks]
    pgs = getattr(models[0], "pg_collection", None)
    tp_group = tp_group if tp_group is not None else pgs.tp
    pp_group = pp_group if pp_group is not None else pgs.pp
    dp_cp_group = dp_cp_group if dp_cp_group is not None else getattr(pgs, "dp_cp", None)
    if isinstance(pp_group, PipelineRankView):
        raise ConfigError(f"{FLAG}: the first chunk's pipeline group is a rank view; pass the real pipeline group")
    pp_rank = pp_group.rank()
    if placement.num_devices != pp_group.size():
        raise ConfigError(f"{FLAG}: a placement over {placement.num_devices} devices for a pipeline of {pp_group.size()}")
    specs = chunk_specs(placement, pp_rank)
    if len(specs) != len(models):
        raise ConfigError(f"{FLAG}: pipeline rank {pp_rank} built {len(models)} model chunks, its placement has "
                          f"{len(specs)}")
    config = models[0].config
    padded_vocab = int(models[0].vocab_size)
    tied = bool(getattr(models[0], "share_embeddings_and_output_weights", False))
    for model, spec in zip(models, specs):
        _check_chunk(model, spec, config, padded_vocab, tied)
    check_vocab_sizes(padded_vocab, tp_group.size(), pp_group.size())
    embedding_source = output_source = embedding_input = final_output = None
    for model, spec in zip(models, specs):
        if spec.pre_process:
            embedding_source, embedding_input = _strip_embedding(model, config)
        if spec.post_process:
            output_source, final_output = _strip_output_layer(model, config, tied)
        model.share_embeddings_and_output_weights = False  # no weight left to tie or all-reduce
    layers = VocabShardLayers(padded_vocab, config.hidden_size, tied=tied, tp_group=tp_group, pp_group=pp_group,
                              dp_cp_group=dp_cp_group, dtype=config.params_dtype, device=_device_of(models))
    _scatter_rows(layers.embedding_weight, embedding_source, placement.device_of(0), pp_group)
    if not tied:
        _scatter_rows(layers.output_weight, output_source, placement.device_of(placement.num_stages - 1), pp_group)
    del embedding_source, output_source  # the full copies go with the last reference
    layers.output_extra_state = final_output is not None and not _drops_output_extra_state(models[0])
    object.__setattr__(layers, "embedding_input", embedding_input)
    object.__setattr__(layers, "final_output", final_output)
    models[0].add_module(LAYERS_NAME, layers)
    return layers


def _drops_output_extra_state(model) -> bool:
    """Whether ``model``'s checkpoints leave out the output layer's (empty) ``_extra_state``: GPTModel's
    ``sharded_state_dict`` pops it, HybridModel's keeps it."""
    from megatron.core.models.gpt import GPTModel

    return isinstance(model, GPTModel)


def _check_chunk(model, spec, config, padded_vocab: int, tied: bool) -> None:
    if not all(hasattr(model, name) for name in ("pre_process", "post_process", "decoder", "vocab_size")):
        raise ConfigError(f"{FLAG}: model chunks must be megatron-core GPTModels or HybridModels, not {type(model).__name__}")
    if (bool(model.pre_process), bool(model.post_process)) != (spec.pre_process, spec.post_process):
        raise ConfigError(f"{FLAG}: the chunk of stage {spec.stage} was built with pre_process={model.pre_process}, "
                          f"post_process={model.post_process}; its placement says {spec.pre_process}, {spec.post_process}")
    if int(model.vocab_size) != padded_vocab or bool(getattr(model, "share_embeddings_and_output_weights", False)) != tied:
        raise ConfigError(f"{FLAG}: the chunks of one rank disagree on the vocabulary size or on tied embeddings")
    if getattr(config, "mtp_num_layers", None) or getattr(model, "mtp_process", False):
        raise ConfigError(f"{FLAG}: multi-token prediction (--mtp-num-layers) is not supported; drop --mtp-num-layers")
    if getattr(config, "init_model_with_meta_device", False):
        raise ConfigError(f"{FLAG}: --init-model-with-meta-device leaves no initial weights to shard; drop it")


def _strip_embedding(model, config):
    """Replace the first stage's word-embedding lookup by :class:`EmbeddingInput`; return (its TP shard of
    the weight, the input hook). Position embeddings, dropout and the SP scatter stay."""
    embedding = model.embedding
    weight = embedding.word_embeddings.weight
    hook = EmbeddingInput(config.hidden_size, weight.dtype, weight.device,
                          reduce_scatter=bool(getattr(embedding, "reduce_scatter_embeddings", False)),
                          tp_group=getattr(embedding, "tp_group", None))
    embedding.word_embeddings = hook  # the VocabParallelEmbedding (and its weight) leaves the model
    return weight.detach(), hook


def _strip_output_layer(model, config, tied: bool):
    """Delete the last stage's output layer and make the chunk return its final hidden state (the decoder keeps
    its final norm); return (the untied output weight or None, the labels hook)."""
    layer = model.output_layer
    if getattr(layer, "bias", None) is not None:
        raise ConfigError(f"{FLAG}: the output layer has a bias, which the vocabulary passes do not compute")
    # Tied: the last stage's weight is Megatron's copy of the embedding (all-reduced at init, or copied
    # locally on a V); the shards start from the first stage's embedding instead.
    weight = None if tied else layer.weight.detach()
    del model.output_layer
    model.post_process = False  # GPTModel._postprocess returns hidden_states (0.19.2 and main)
    final = FinalOutput(inspect.signature(model.forward))
    model.register_forward_pre_hook(final.pre_hook, with_kwargs=True)
    if config.sequence_parallel:
        model.register_forward_hook(_gather_sequence(model.pg_collection.tp))
    return weight, final


def _gather_sequence(tp_group):
    """Under sequence parallelism: the last stage's [s/tp, b, h] gathered to [s, b, h], as Megatron's output
    layer gathers its input. The backward keeps this rank's part of the hidden state's gradient, which
    :meth:`VocabShardLayers.output_backward` has already summed over TP (Megatron's reduce-scatter)."""

    def hook(module, args, output):
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        return gather_from_sequence_parallel_region(output, tensor_parallel_output_grad=False, group=tp_group)

    return hook


def _device_of(models) -> torch.device:
    for model in models:
        for param in model.parameters():
            return param.device
    return torch.device("cpu")


def _comm_device(group) -> torch.device:
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _scatter_rows(param: torch.nn.Parameter, source: torch.Tensor | None, src: int, group) -> None:
    """Fill ``param`` ([rows, h] on every pipeline rank) with its part of ``source`` ([p * rows, h], the TP
    shard of a weight, held by pipeline rank ``src``): part s to pipeline rank s, one scatter."""
    import torch.distributed as dist

    rows, parts = param.shape[0], group.size()
    holder = group.rank() == src
    if holder:
        if source is None:
            raise RuntimeError(f"{FLAG}: pipeline rank {src} should hold the weight to shard but does not")
        if tuple(source.shape) != (rows * parts, param.shape[1]):
            raise ConfigError(f"{FLAG}: a weight of shape {tuple(source.shape)} does not split into {parts} parts of "
                              f"{tuple(param.shape)}")
    if parts == 1:
        with torch.no_grad():
            param.copy_(source)
        return
    device = _comm_device(group)
    received = torch.empty(param.shape, dtype=param.dtype, device=device)
    pieces = None
    if holder:
        full = source.to(device=device, dtype=param.dtype)
        pieces = [piece.contiguous() for piece in full.split(rows, dim=0)]
    dist.scatter(received, pieces, src=dist.get_global_rank(group, src), group=group)
    with torch.no_grad():
        param.copy_(received)
