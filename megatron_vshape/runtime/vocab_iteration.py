"""One iteration's vocabulary passes on one pipeline rank (``--pipeline-vocab-parallel``).

The schedule holds, per microbatch, one H and one G pass on every rank (schedules/generators/
vocab_passes.py); the model's vocabulary layers are a :class:`~megatron_vshape.runtime.vocab_model.VocabShardLayers`
in the rank's first chunk (runtime/vocab_model.py). What this rank does, and every collective it
issues, in the one order every rank follows (the collectives run over the TP group, then the pipeline
group of this TP rank, as ``VocabShardLayers.groups``):

* **The embedding, per microbatch** (runtime/vocab_embedding.py): the first stage's rank reads the tokens of
  microbatch k from its data iterator one slot ahead (its forward steps then read the same items) and
  broadcasts them (T(k), 8 bytes a token; over TP first, from TP rank 0: Megatron's other TP ranks read no
  data); every rank looks up its rows of them and the sums are reduced onto the first stage's rank (E(k)),
  which hands them to its F(0, k) (``EmbeddingInput.set``); after its B(0, k) the embedding's gradient is
  broadcast back (D(k)) and every rank adds its rows' weight gradient into the fp32 ``main_grad``. These
  collectives go at the start of the call (the **prologue**), at the start of an H, or at the end (the
  **epilogue**), as late as the first stage's program allows (schedules/core/vocab_embedding.py): the
  ranks hold a few microbatches' tokens, embeddings and gradients, a number the schedule bounds, not m.
* **H(k)**, a collective pass (all ranks run it together, runtime/vocab_h.py): one rendezvous per
  microbatch; the last stage's B(k) then starts from the hidden state's gradient, as any stage whose
  output went to another stage. Evaluation calls run the forward half only.
* **G(k)**: waits for H's loss gradient and adds this rank's output-layer weight gradient (a W, deferrable).
* **Epilogue** (after the last pass): the embedding's last slot (the gradients whose B came after the
  last H). The shard's buckets' DP reduction starts after it; every other bucket's at its last W, as without
  the flag (runtime/iteration.py, ``BucketLauncher``'s ``held``).

Every pipeline-group collective goes through the rank's vocabulary queue (runtime/comm_queue.py), in the
one order the lowering's program records (schedules/lowering/exchange.py) and the NCCL model checks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron_vshape.schedules.core.schedule import Placement
from megatron_vshape.schedules.core.vocab_embedding import EmbeddingSlots, embedding_slots
from megatron_vshape.schedules.lowering.loss_grads import carried_loss_grads

from .comm_queue import CommQueue
from .placement import _unwrap
from .vocab_embedding import EmbeddingPasses, LookaheadIterator
from .vocab_h import HPass

LAYERS_NAME = "vocab_parallel"  # the submodule of a rank's first chunk that holds its vocabulary shard


def vocab_layers_of(model):
    """The rank's vocabulary shard layers (the first chunk's submodule), or None without the flag;
    ``model``: the rank's chunks, or its first chunk (wrappers allowed)."""
    first = model[0] if isinstance(model, (list, tuple)) else model
    return getattr(_unwrap(first), LAYERS_NAME, None)


@dataclass
class VocabPasses:
    """The vocabulary passes of one call on one rank (see the module docstring)."""

    layers: object  # VocabShardLayers
    placement: Placement
    rank: int  # this rank's pipeline rank
    num_microbatches: int
    micro_batch_size: int
    seq_length: int
    dtype: torch.dtype
    forward_only: bool
    # Every rank's actions in run order (the lowered program's): the first stage's rank's place the embedding's
    # collectives (schedules/core/vocab_embedding.py), and all of them which loss gradients ride with the
    # next H (schedules/lowering/loss_grads.py). Empty: all lookups at the start, all gradients at the end (a
    # call-wide buffer), every loss gradient its own broadcast (only for callers without a program).
    programs: tuple = ()
    embedding_leaves: dict[int, torch.Tensor] = field(default_factory=dict)  # first stage: F(k)'s inputs
    labels: dict[int, torch.Tensor] = field(default_factory=dict)  # last stage: what F(k) was called with
    loss_funcs: dict[int, Callable] = field(default_factory=dict)  # last stage: the script's loss of F(k)
    # What the passes hold, for the [vshape] line: the peak of the bytes kept from H(k) to G(k) (the
    # softmax shard, the hidden state, the loss gradient, a reduce's send), and the peak of the embedding's
    # (embeddings and gradients held, collectives in flight, tokens, the data items read ahead).
    peak_held_bytes: int = 0
    h_pass: HPass = field(init=False)
    embedding: EmbeddingPasses | None = field(init=False, default=None)
    h_count: int = 0

    def __post_init__(self):
        self.queue = CommQueue("vocabulary", self.layers.embedding_weight.device)
        carried = carried_loss_grads(self.programs, self.last_rank) if self.programs else {}
        self.h_pass = HPass(self.layers, self.queue, self.rank, self.last_rank, self.dtype, carried)

    @property
    def first_rank(self) -> int:
        return self.placement.device_of(0)

    @property
    def last_rank(self) -> int:
        return self.placement.device_of(self.placement.num_stages - 1)

    @property
    def tp_group(self):
        return self.layers.tp_group

    @property
    def pp_group(self):
        return self.layers.pp_group

    @property
    def embedding_bytes(self) -> int:
        return 0 if self.embedding is None else self.embedding.peak_bytes

    # --- the call's start and end ------------------------------------------------------------------

    def prologue(self, first_chunk_iterator) -> object:
        """The embedding's slot 0 (the first lookups' tokens to every rank, waited at once; their embeddings
        to the first stage; the next slot's tokens posted). Returns the first chunk's data iterator to use (on
        the first stage's rank: the same one, read ahead by the tokens' broadcasts)."""
        first = self.rank == self.first_rank
        source = LookaheadIterator(first_chunk_iterator) if first and first_chunk_iterator is not None else None
        self.embedding = EmbeddingPasses(self.layers, self.queue, self._slots(),
                                         (self.micro_batch_size, self.seq_length), first, self.first_rank,
                                         self.dtype, source, training=not self.forward_only)
        self.embedding.run_slot(0)
        return source if source is not None else first_chunk_iterator

    def _slots(self) -> EmbeddingSlots:
        if self.programs:
            return embedding_slots(self.programs[self.first_rank], not self.forward_only)
        everything = tuple(range(self.num_microbatches))
        return EmbeddingSlots((everything, ()), ((), () if self.forward_only else everything))

    def epilogue(self) -> None:
        """The embedding's last slot (the gradients whose first-stage B came after the last H), all settled."""
        self.embedding.finish()

    # --- around the first and last stage's passes ---------------------------------------------------

    def hand_embedding(self, microbatch: int) -> None:
        """Before the first stage's F(k): its embedding, as the leaf whose gradient D(k) needs."""
        embedded = self.embedding.embedding(microbatch)
        if self.forward_only:
            embedded = embedded.detach()
        leaf = self.layers.embedding_input.set(embedded)
        if not self.forward_only:
            self.embedding_leaves[microbatch] = leaf

    def take_embedding_grad(self, microbatch: int) -> None:
        """After the first stage's B(k): the gradient of the embedding it was handed."""
        leaf = self.embedding_leaves.pop(microbatch)
        if leaf.grad is None:
            raise RuntimeError(f"--pipeline-vocab-parallel: the first stage's backward of microbatch {microbatch} "
                               "left no gradient on its embedding")
        self.embedding.keep_grad(microbatch, leaf.grad)

    def wrap_last_forward(self, forward_step_func, microbatch: int):
        """The script's forward step for the last stage's F(k): keeps its loss function for H(k)."""

        def forward_step(*args, **kwargs):
            output, loss_func = forward_step_func(*args, **kwargs)
            self.loss_funcs[microbatch] = loss_func
            return output, loss_func

        return forward_step

    def record_labels(self, microbatch: int) -> None:
        """After the last stage's F(k): the labels its model was called with."""
        labels = self.layers.final_output.take().labels
        if labels is None:
            raise RuntimeError("--pipeline-vocab-parallel: the last stage's model was called without labels; the "
                               "vocabulary-parallel loss needs them (GPTModel(..., labels=labels))")
        self.labels[microbatch] = labels

    # --- the passes --------------------------------------------------------------------------------

    def run_h(self, microbatch: int, hidden: torch.Tensor | None, loss: Callable | None) -> torch.Tensor | None:
        """H(k) (runtime/vocab_h.py). ``hidden``: the last stage's output on its rank (None elsewhere);
        ``loss(per_token_loss, loss_func)`` runs the script's loss function and, when training, returns
        d(objective)/d(loss). Returns the hidden state's gradient on the last stage's rank (None elsewhere or
        when evaluating)."""
        self.h_count += 1
        self.embedding.run_slot(self.h_count)  # the embedding's collectives placed at this H
        holder = self.rank == self.last_rank
        labels = self.labels.pop(microbatch) if holder else None
        loss_func = self.loss_funcs.pop(microbatch) if holder else None
        shape = (self.seq_length, self.micro_batch_size, self.layers.hidden_size)
        grad = self.h_pass.run(microbatch, shape, hidden, labels,
                               (lambda per_token: loss(per_token, loss_func)) if holder else None,
                               not self.forward_only)
        self.peak_held_bytes = max(self.peak_held_bytes, self.h_pass.held_bytes())
        return grad

    def run_g(self, microbatch: int) -> None:
        if not self.forward_only:
            self.h_pass.weight_grad(microbatch)

    def check_drained(self) -> None:
        left = {name: sorted(d) for name, d in (("weight gradients", self.h_pass.held), ("labels", self.labels),
                                                 ("embedding leaves", self.embedding_leaves),
                                                 ("loss functions", self.loss_funcs))
                if d}
        if left:
            raise RuntimeError(f"schedule left vocabulary work undone: {left}")
