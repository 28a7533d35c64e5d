"""Vocabulary parallelism on Megatron's model chunks: the shard layers, the surgery and their checkpoints.

With ``--pipeline-vocab-parallel`` the input embedding, the output layer and the cross-entropy are
sharded by vocabulary rows over the pipeline group, on top of Megatron's TP sharding (the arithmetic is
:mod:`megatron_vshape.runtime.vocab_parallel`): (TP rank t, pipeline rank s) holds rows
``[t*V/tp + s*V/(tp*p), ...)`` of Megatron's padded vocabulary V, the s-th contiguous p-th of its TP
shard. This module is the Megatron side, for the executor and the start-up code:

* :class:`VocabShardLayers`: this rank's shard parameters (``embedding_weight`` and, untied,
  ``output_weight``; tied, one parameter serves both) and the passes the executor calls. A submodule of
  the rank's FIRST local chunk, so Megatron's DDP, optimizer and checkpointing see it.
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
* Checkpoints: :meth:`VocabShardLayers.sharded_state_dict` writes ShardedTensors under the keys a run
  without the flag uses (``embedding.word_embeddings.weight``, untied ``output_layer.weight``), global
  shape [V, hidden], at this rank's row offset, so torch_dist checkpoints move between runs with and
  without the flag at any TP/PP the loader supports (the shards must be equal: :func:`check_vocab_sizes`).
* The flag combinations this cannot run are refused at start-up, before any rank computes
  (:mod:`.vocab_checks`, pure Python).

One iteration, as the executor runs it (per microbatch; "every rank" is every TP x PP rank of a replica;
the vocabulary's groups are ``layers.groups`` = (TP group, pipeline group)):

1. every rank: ``partial = layers.embed(tokens)`` ([b, s, h], this rank's rows, zero elsewhere), then
   all-reduce it over the TP group and then the pipeline group;
2. the rank of the first stage: ``leaf = layers.embedding_input.set(summed)``, then the first chunk's
   forward as usual; its position embeddings, dropout and (under sequence parallelism) the scatter apply;
3. the rank of the last stage: the last chunk's forward returns the final hidden state [s, b, h] (after
   the final norm; gathered over TP under sequence parallelism); ``layers.final_output.take()`` gives
   the ``labels`` (and ``loss_mask``) its forward was called with; send both to every pipeline rank;
4. every rank: ``out = layers.output_forward(hidden, labels)`` (S: one all-gather over the groups);
   ``out.loss`` is the per-token loss [b, s] that ``GPTModel`` returns with labels: give it to the loss
   function as Megatron would, and ``grad_loss`` = d(objective)/d(out.loss) [b, s];
5. every rank: ``grad_hidden, w = layers.output_backward(out, grad_loss)`` (T: one all-reduce); the last
   stage's backward starts from ``grad_hidden`` [s, b, h]; ``w()`` (the W, deferrable) adds the output
   layer's weight gradient into ``main_grad`` (or ``.grad``);
6. after the first stage's backward, ``leaf.grad`` ([b, s, h]) goes from that rank to every pipeline rank
   (TP ranks hold the same); every rank: ``layers.embedding_weight_grad_task(tokens, grad)()`` (or
   ``embedding_weight_grad``: now).

The tasks carry ``.weight``, as the split linears' W tasks do, so the weight-gradient store counts them.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..runtime import vocab_parallel as vp
from ..runtime.placement import PipelineRankView, _unwrap, chunk_specs
from ..runtime.vocab_iteration import LAYERS_NAME  # the submodule of a rank's first chunk the executor reads
from ..runtime.wgrad_linear import accumulate_weight_grad
from ..schedules.core.schedule import Placement
from .flags import V_SCHEDULE_NAMES, ConfigError
from .vocab_checks import FLAG, check_vocab_sizes

EMBEDDING_KEY = "embedding.word_embeddings.weight"  # the checkpoint keys of a run without the flag
OUTPUT_KEY = "output_layer.weight"
OUTPUT_EXTRA_STATE = "output_extra_state"  # the state-dict name of the output layer's extra state (HybridModel)


# --- the hooks in the stripped chunks ------------------------------------------------------------------


class EmbeddingInput(torch.nn.Module):
    """Stands in for ``LanguageModelEmbedding.word_embeddings`` on the chunk of the first stage.

    :meth:`set` hands it the summed embedding of the next forward ([b, s, h], what Megatron's
    ``VocabParallelEmbedding`` returns after its TP all-reduce); the forward returns it (cast to the
    dtype the embedding's weight had, which follows ``.to()`` / Float16Module through a buffer), under
    sequence parallelism without learned position embeddings reduce-scattered as Megatron's is. The
    tensor is a leaf of the chunk's graph: after the backward its ``.grad`` is the gradient of the
    embedding output, which the embedding's weight gradient needs.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, device, reduce_scatter: bool = False, tp_group=None):
        super().__init__()
        self.hidden_size = hidden_size
        self.reduce_scatter = reduce_scatter
        self.tp_group = tp_group
        self.register_buffer("dtype_probe", torch.empty(0, dtype=dtype, device=device), persistent=False)
        self._pending: torch.Tensor | None = None

    def set(self, embedded: torch.Tensor) -> torch.Tensor:
        """The input of the next forward; returns the leaf whose ``.grad`` the backward fills."""
        leaf = embedded if embedded.is_leaf and embedded.requires_grad else embedded.detach().requires_grad_(True)
        self._pending = leaf
        return leaf

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        embedded, self._pending = self._pending, None
        if embedded is None:
            raise RuntimeError(f"{FLAG}: the first stage ran without an embedding: call "
                               "layers.embedding_input.set(tensor) before each forward of its chunk")
        want = (*input_ids.shape, self.hidden_size)
        if tuple(embedded.shape) != want:
            raise RuntimeError(f"{FLAG}: the embedding handed to the first stage has shape {tuple(embedded.shape)}, "
                               f"the tokens need {want}")
        out = embedded.to(self.dtype_probe.dtype)
        if self.reduce_scatter:  # Megatron's reduce-scattered lookup: [b s h] -> [s/tp b h]
            from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

            out = scatter_to_sequence_parallel_region(out.transpose(0, 1).contiguous(), group=self.tp_group)
        return out


@dataclass
class LastStageInputs:
    """What the last stage's forward was called with (the loss needs them)."""

    labels: torch.Tensor | None
    loss_mask: torch.Tensor | None


class FinalOutput:
    """On the rank of the last stage: records the ``labels`` (and ``loss_mask``) of its chunk's forwards."""

    def __init__(self, forward_signature: inspect.Signature):
        self._signature = forward_signature
        self._recorded: list[LastStageInputs] = []

    def pre_hook(self, module, args, kwargs):
        bound = self._signature.bind(*args, **kwargs)
        self._recorded.append(LastStageInputs(bound.arguments.get("labels"), bound.arguments.get("loss_mask")))

    def take(self) -> LastStageInputs:
        """The inputs of the oldest forward not taken yet."""
        if not self._recorded:
            raise RuntimeError(f"{FLAG}: no forward of the last stage is waiting for its labels")
        return self._recorded.pop(0)

    def __len__(self) -> int:
        return len(self._recorded)


# --- the shard layers ----------------------------------------------------------------------------------


class WeightGradTask:
    """A weight gradient to add later (a W): ``task()`` computes it and adds it into ``task.weight``."""

    def __init__(self, weight: torch.nn.Parameter, compute: Callable[[], torch.Tensor]):
        self.weight = weight
        self._compute: Callable[[], torch.Tensor] | None = compute

    def __call__(self) -> None:
        if self._compute is None:
            raise RuntimeError(f"{FLAG}: a vocabulary weight gradient ran twice")
        compute, self._compute = self._compute, None
        accumulate_weight_grad(self.weight, compute())


class EmbeddingGradTask:
    """The embedding's W: rows of ``grad_output`` added by token id, straight into the fp32 ``main_grad``
    (no [rows, hidden] temporary); without one (no DDP) summed in fp32 and added to ``.grad`` once."""

    def __init__(self, weight: torch.nn.Parameter, tokens: torch.Tensor, grad_output: torch.Tensor, shard):
        self.weight, self._args = weight, (tokens, grad_output, shard)

    def __call__(self) -> None:
        if self._args is None:
            raise RuntimeError(f"{FLAG}: a vocabulary weight gradient ran twice")
        (tokens, grad_output, shard), self._args = self._args, None
        main_grad = getattr(self.weight, "main_grad", None)
        if main_grad is not None and main_grad.dtype == torch.float32:
            vp.embedding_weight_grad(tokens, grad_output, shard, into=main_grad)
        else:
            accumulate_weight_grad(self.weight, vp.embedding_weight_grad(tokens, grad_output, shard))


@dataclass
class OutputPass:
    """What S (:meth:`VocabShardLayers.output_forward`) gives: the loss, and what T needs."""

    loss: torch.Tensor  # [b, s] fp32, the per-token loss GPTModel returns when given labels
    state: vp.OutputState
    seq_batch: tuple[int, int]
    hidden_dtype: torch.dtype  # of the hidden state given (Float16Module hands the last stage's out in fp32)


def mark_vocab_shard(param: torch.nn.Parameter) -> None:
    """The attributes Megatron reads on a vocabulary shard.

    Disjoint rows over TP x PP, like a tensor-parallel weight: ``tensor_model_parallel`` keeps it in every
    rank's grad norm (which sums over the model-parallel group, TP x PP) and its zero count, partition dim
    0 stride 1; ``is_embedding_or_output_parameter`` as Megatron's embedding and output layer
    (decoupled LR, Muon); no ``shared``/``shared_embedding``: there is no tied copy to skip.
    """
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)
    param.is_embedding_or_output_parameter = True


class VocabShardLayers(torch.nn.Module):
    """This rank's rows of the input embedding and (untied) the output layer, and their passes.

    ``embedding_weight`` [rows, hidden]; ``output_weight`` [rows, hidden] (tied: the same parameter, only
    ``embedding_weight`` is registered). ``groups``: the vocabulary's ranks as (TP group, pipeline group).
    ``embedding_input`` (:class:`EmbeddingInput`) and ``final_output`` (:class:`FinalOutput`) are set on the
    rank that holds the first and the last stage (None elsewhere).
    """

    def __init__(self, padded_vocab: int, hidden_size: int, *, tied: bool, tp_group, pp_group, dp_cp_group=None,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        tp_size, pp_size = tp_group.size(), pp_group.size()
        check_vocab_sizes(padded_vocab, tp_size, pp_size)
        self.padded_vocab, self.hidden_size, self.tied = padded_vocab, hidden_size, tied
        self.tp_group, self.pp_group, self.dp_cp_group = tp_group, pp_group, dp_cp_group
        self.tp_rank, self.tp_size = tp_group.rank(), tp_size
        self.pp_rank, self.pp_size = pp_group.rank(), pp_size
        self.shard = vp.VocabShard.of(padded_vocab, tp_size, self.tp_rank, pp_size, self.pp_rank)
        self.embedding_weight = torch.nn.Parameter(torch.empty(self.shard.rows, hidden_size, dtype=dtype, device=device))
        mark_vocab_shard(self.embedding_weight)
        if tied:
            object.__setattr__(self, "output_weight", self.embedding_weight)  # not registered twice
        else:
            self.output_weight = torch.nn.Parameter(torch.empty_like(self.embedding_weight))
            mark_vocab_shard(self.output_weight)
        # Plain attributes (not submodules): the embedding input lives in the first stage's chunk.
        object.__setattr__(self, "embedding_input", None)
        object.__setattr__(self, "final_output", None)
        # On the rank of the last stage of a model whose checkpoints keep the output layer's (empty) extra state
        # (HybridModel: GPTModel drops it), the shards write it too, so a run without the flag finds it.
        self.output_extra_state = False

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        if self.tied:  # .to() / Float16Module may replace the parameter: the alias follows
            object.__setattr__(self, "output_weight", self.embedding_weight)
        return out

    @property
    def groups(self) -> tuple:
        """The vocabulary's ranks, as the collectives of the passes run over them: TP, then pipeline."""
        return (self.tp_group, self.pp_group)

    def forward(self) -> None:
        """Nothing; calling the module (:meth:`_weights_ready`) runs its forward pre-hooks.

        Megatron's DDP under ``--overlap-param-gather`` waits for a parameter's all-gather in the forward
        pre-hook of the module that owns it (and dispatches the gather there if nothing has yet). The
        passes read the shards' weights directly, never through a forward, so without this the first
        passes of an iteration (the prologue's lookup, the first S) read the rows the optimizer step left
        before the gather brought every data-parallel rank's update: a silently wrong run.
        """
        return None

    def _weights_ready(self) -> None:
        """Before a pass reads the weights: whatever Megatron hooked on this module's forward runs first."""
        self()

    # The input embedding.

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's part of the lookup of ``tokens`` ([b, s] -> [b, s, h]): its rows, zero elsewhere. No
        collective: the executor sums it over the TP group and then the pipeline group."""
        self._weights_ready()
        return vp.embedding_partial(tokens, self.embedding_weight.detach(), self.shard)

    def embedding_weight_grad_task(self, tokens: torch.Tensor, grad_output: torch.Tensor) -> EmbeddingGradTask:
        """The W of the embedding: ``grad_output`` ([b, s, h], the gradient of the first stage's embedding
        output) into this rank's rows, summed in fp32."""
        return EmbeddingGradTask(self.embedding_weight, tokens, grad_output, self.shard)

    def embedding_weight_grad(self, tokens: torch.Tensor, grad_output: torch.Tensor) -> None:
        """:meth:`embedding_weight_grad_task`, run now."""
        self.embedding_weight_grad_task(tokens, grad_output)()

    # The output layer and the loss.

    def output_forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> OutputPass:
        """S: ``hidden`` [s, b, h] (the last stage's output, on every rank), ``labels`` [b, s]; one all-gather
        over :attr:`groups`. Every rank gets the same loss.

        The logits are computed in the weights' dtype, as Megatron's output layer does inside the model
        (under Float16Module the last stage's output arrives upcast to fp32: it is cast back, exactly)."""
        s, b, h = hidden.shape
        if tuple(labels.shape) != (b, s):
            raise RuntimeError(f"{FLAG}: labels of shape {tuple(labels.shape)} for a hidden state of [s, b] = [{s}, {b}]")
        self._weights_ready()
        weight = self.output_weight.detach()
        state = vp.output_forward(hidden.detach().to(weight.dtype).reshape(s * b, h), weight,
                                  labels.t().reshape(s * b), self.shard, self.groups)
        return OutputPass(state.loss.view(s, b).t().contiguous(), state, (s, b), hidden.dtype)

    def output_backward(self, out: OutputPass, grad_loss: torch.Tensor) -> tuple[torch.Tensor, WeightGradTask]:
        """T: the gradient of the hidden state ([s, b, h] in the dtype of the hidden state S was given, summed
        over :attr:`groups`: one all-reduce) and the W that adds this rank's output-layer weight gradient.
        ``grad_loss`` [b, s]."""
        s, b = out.seq_batch
        grad_hidden, compute = vp.output_backward(out.state, self.output_weight.detach(),
                                                  grad_loss.t().reshape(s * b), self.groups)
        return grad_hidden.view(s, b, -1).to(out.hidden_dtype), WeightGradTask(self.output_weight, compute)

    def pass_weight(self) -> torch.Tensor:
        """The output layer's rows for an H pass (runtime/vocab_h.py), once Megatron's hooks have run."""
        self._weights_ready()
        return self.output_weight.detach()

    def output_weight_grad_task(self, compute: Callable[[], torch.Tensor]) -> WeightGradTask:
        """The W that adds ``compute()`` ([rows, hidden]) into the output layer's gradient."""
        return WeightGradTask(self.output_weight, compute)

    # Checkpoints.

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """ShardedTensors under the keys of a run without the flag, global shape [V, hidden], this rank's rows.

        The dict keys are this module's own (``load_state_dict`` reads them); the ShardedTensor keys are the
        model's: ``embedding.word_embeddings.weight`` and, untied, ``output_layer.weight``.
        """
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        if sharded_offsets:
            raise ValueError(f"{FLAG}: the vocabulary shards take no pipeline offsets (got {sharded_offsets})")
        suffix = LAYERS_NAME + "."
        model_prefix = prefix[: -len(suffix)] if prefix.endswith(suffix) else prefix
        replica_id = (0, 0, self._dp_rank(metadata))
        # Rows [shard.start, shard.end) of [V, hidden]: fragment start / rows of V / rows (equal shards).
        fragment = (0, self.shard.start // self.shard.rows, self.padded_vocab // self.shard.rows)
        entries = [("embedding_weight", self.embedding_weight, EMBEDDING_KEY)]
        if not self.tied:
            entries.append(("output_weight", self.output_weight, OUTPUT_KEY))
        out = {f"{prefix}{name}": ShardedTensor.from_rank_offsets(
            f"{model_prefix}{key}", param, fragment, replica_id=replica_id, allow_shape_mismatch=True)
            for name, param, key in entries}
        if self.output_extra_state:
            from megatron.core.dist_checkpointing.mapping import ShardedObject

            # As the output layer's own (ColumnParallelLinear: None; one copy, TP and DP replicas of it).
            out[f"{prefix}{OUTPUT_EXTRA_STATE}"] = ShardedObject(
                f"{model_prefix}output_layer._extra_state", None, (1,), (0,), replica_id=(0, self.tp_rank, replica_id[2]))
        return out

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict.pop(prefix + OUTPUT_EXTRA_STATE, None)  # written for runs without the flag; nothing to restore
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _dp_rank(self, metadata: dict | None) -> int:
        group = (metadata or {}).get("dp_cp_group") or self.dp_cp_group
        if group is not None:
            return group.rank()
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank(with_context_parallel=True)

    def extra_repr(self) -> str:
        return (f"rows [{self.shard.start}, {self.shard.end}) of {self.padded_vocab}, hidden {self.hidden_size}, "
                f"{'tied' if self.tied else 'untied'}")


# --- the surgery ---------------------------------------------------------------------------------------


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
