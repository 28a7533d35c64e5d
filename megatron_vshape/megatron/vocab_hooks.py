"""The hooks vocabulary parallelism leaves in Megatron's stripped model chunks (``--pipeline-vocab-parallel``).

:mod:`.vocab_surgery` puts them in: :class:`EmbeddingInput` in place of the first stage's word-embedding
lookup (it returns the embedding the executor hands it), and :class:`FinalOutput` on the last stage's
chunk (it records the labels the chunk's forward was called with, which the vocabulary's H pass needs).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from .vocab_checks import FLAG


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
