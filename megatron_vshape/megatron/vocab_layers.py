"""Vocabulary parallelism on Megatron's model chunks: the shard layers, their passes and their checkpoints.

With ``--pipeline-vocab-parallel`` the input embedding, the output layer and the cross-entropy are
sharded by vocabulary rows over the pipeline group, on top of Megatron's TP sharding (the arithmetic is
:mod:`megatron_vshape.runtime.vocab_parallel`): (TP rank t, pipeline rank s) holds rows
``[t*V/tp + s*V/(tp*p), ...)`` of Megatron's padded vocabulary V, the s-th contiguous p-th of its TP
shard. This module is the Megatron side, for the executor and the start-up code:

* :class:`VocabShardLayers`: this rank's shard parameters (``embedding_weight`` and, untied,
  ``output_weight``; tied, one parameter serves both) and the passes the executor calls. A submodule of
  the rank's FIRST local chunk, so Megatron's DDP, optimizer and checkpointing see it.
* Checkpoints: :meth:`VocabShardLayers.sharded_state_dict` writes ShardedTensors under the keys a run
  without the flag uses (``embedding.word_embeddings.weight``, untied ``output_layer.weight``), global
  shape [V, hidden], at this rank's row offset, so torch_dist checkpoints move between runs with and
  without the flag at any TP/PP the loader supports (the shards must be equal: :func:`check_vocab_sizes`).
* The flag combinations this cannot run are refused at start-up, before any rank computes
  (:mod:`.vocab_checks`, pure Python).
* The hooks in the stripped chunks are :mod:`.vocab_hooks`; the surgery that strips them and installs the
  shard layers is :mod:`.vocab_surgery`.

The passes, as the executor runs them (runtime/vocab_iteration.py and runtime/vocab_h.py; "every rank" is
every TP x PP rank of a replica; the vocabulary's groups are ``layers.groups`` = (TP group, pipeline group)):
:meth:`VocabShardLayers.embed` (this rank's rows of the lookup, summed by the caller's collectives),
:meth:`VocabShardLayers.pass_weight` (the output rows an H reads, after Megatron's hooks),
:meth:`VocabShardLayers.output_weight_grad_task` and :meth:`VocabShardLayers.embedding_weight_grad_task`
(the W tasks; they carry ``.weight``, as the split linears' W tasks do, so the weight-gradient store counts
them). :meth:`VocabShardLayers.output_forward` / :meth:`~VocabShardLayers.output_backward` run S and T with
blocking collectives (the tests' and the benchmark's form).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..runtime import vocab_parallel as vp
from ..runtime.vocab_iteration import LAYERS_NAME  # the submodule of a rank's first chunk the executor reads
from ..runtime.wgrad_linear import accumulate_weight_grad
from .vocab_checks import FLAG, check_vocab_sizes

EMBEDDING_KEY = "embedding.word_embeddings.weight"  # the checkpoint keys of a run without the flag
OUTPUT_KEY = "output_layer.weight"
OUTPUT_EXTRA_STATE = "output_extra_state"  # the state-dict name of the output layer's extra state (HybridModel)


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
