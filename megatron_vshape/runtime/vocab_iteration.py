"""One iteration's vocabulary passes on one pipeline rank (``--pipeline-vocab-parallel``).

The schedule holds, per microbatch, one H and one G pass on every rank (schedules/generators/
vocab_passes.py); the model's vocabulary layers are a :class:`~megatron_vshape.runtime.vocab_model.VocabShardLayers`
in the rank's first chunk (runtime/vocab_model.py). What this rank does, and every collective it
issues, in the one order every rank follows (the collectives run over the TP group, then the pipeline
group of this TP rank, as ``VocabShardLayers.groups``):

* **Prologue** (before the first pass of the call): the rank that holds the first stage reads the
  tokens of all the call's microbatches ahead from its data iterator (the forward steps then read the
  same items from a buffer) and broadcasts them, over TP (from TP rank 0: Megatron's other TP ranks
  read no data) and then over the pipeline group. Every rank looks up its rows; the partial sums are
  reduced over TP and onto the first stage's rank over the pipeline group. That rank hands microbatch
  k's embedding to the first chunk before its F(k) (``EmbeddingInput.set``). These are the only
  collectives outside the passes, where every rank is at the same point of the call anyway; the cost is
  the first stage's rank holding m microbatches' embeddings (m x b x s x h) for the call.
* **H(k)**, a collective pass (all ranks run it together): the last stage's rank broadcasts the final
  hidden state of microbatch k and its labels; every rank computes its logits and the softmax
  statistics (one all-gather: ``output_forward``); the last stage's rank runs the script's loss function
  on the per-token loss (Megatron's ``forward_step_calc_loss``: its scaling, token counts and reported
  values) and its backward, and broadcasts d(objective)/d(per-token loss); every rank computes its part
  of the hidden state's gradient (one all-reduce) and keeps its weight gradient as a task. The last
  stage's B(k) then starts from that gradient, as any stage whose output went to another stage.
  Evaluation calls run the forward half only.
* **G(k)**: the task adds this rank's output-layer weight gradient (a W, deferrable).
* **Epilogue** (training, after the last pass): the first stage's rank broadcasts the gradients of the
  embeddings it was handed; every rank adds its rows' embedding weight gradient. The gradient reduction
  of the chunk holding the shard starts after this.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_vshape.schedules.core.schedule import Placement

from .comm_queue import CommQueue
from .placement import _unwrap
from .vocab_h import HPass

LAYERS_NAME = "vocab_parallel"  # the submodule of a rank's first chunk that holds its vocabulary shard


def vocab_layers_of(model):
    """The rank's vocabulary shard layers (the first chunk's submodule), or None without the flag;
    ``model``: the rank's chunks, or its first chunk (wrappers allowed)."""
    first = model[0] if isinstance(model, (list, tuple)) else model
    return getattr(_unwrap(first), LAYERS_NAME, None)


class PrefetchedIterator:
    """A data iterator read ``count`` items ahead: the forward steps get the same items, in order."""

    def __init__(self, iterator, count: int):
        self.items = [next(iterator) for _ in range(count)]
        self._next = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self._next >= len(self.items):
            raise StopIteration
        self._next += 1
        return self.items[self._next - 1]


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
    tokens: torch.Tensor | None = None  # [m, b, s] of the call
    embeddings: dict[int, torch.Tensor] = field(default_factory=dict)  # first stage: handed to F(k)
    embedding_leaves: dict[int, torch.Tensor] = field(default_factory=dict)  # first stage: F(k)'s inputs
    embedding_grads: dict[int, torch.Tensor] = field(default_factory=dict)  # first stage: after B(k)
    labels: dict[int, torch.Tensor] = field(default_factory=dict)  # last stage: what F(k) was called with
    loss_funcs: dict[int, Callable] = field(default_factory=dict)  # last stage: the script's loss of F(k)
    # What the passes hold, for the [vshape] line: the peak of the bytes kept from H(k) to G(k) (the
    # softmax shard, the hidden state, the loss gradient, a reduce's send), and the first stage's embeddings.
    peak_held_bytes: int = 0
    embedding_bytes: int = 0
    h_pass: HPass = field(init=False)

    def __post_init__(self):
        queue = CommQueue("vocabulary", self.layers.embedding_weight.device)
        self.h_pass = HPass(self.layers, queue, self.rank, self.last_rank, self.dtype)

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

    def _device(self) -> torch.device:
        return self.layers.embedding_weight.device

    def _broadcast(self, tensor: torch.Tensor, pp_src: int) -> torch.Tensor:
        dist.broadcast(tensor, src=dist.get_global_rank(self.pp_group, pp_src), group=self.pp_group)
        return tensor

    # --- prologue and epilogue --------------------------------------------------------------------

    def prologue(self, first_chunk_iterator) -> object:
        """Tokens to every rank, the embeddings to the first stage. Returns the first chunk's data
        iterator to use (the prefetched one on the first stage's rank)."""
        m, b, s = self.num_microbatches, self.micro_batch_size, self.seq_length
        tokens = torch.empty((m, b, s), dtype=torch.long, device=self._device())
        iterator = first_chunk_iterator
        problem = None
        if self.rank == self.first_rank:
            tokens.fill_(NO_TOKENS)  # what every rank receives when the first stage cannot read them
            if first_chunk_iterator is not None:
                iterator = PrefetchedIterator(first_chunk_iterator, m)
                problem = _tokens_into(tokens, iterator.items)
            elif self.tp_group.size() == 1:
                problem = "the first stage has no data iterator to read the tokens of its microbatches from"
            if self.tp_group.size() > 1:
                dist.broadcast(tokens, src=dist.get_global_rank(self.tp_group, 0), group=self.tp_group)
        self.tokens = self._broadcast(tokens, self.first_rank)
        if bool((self.tokens == NO_TOKENS).any()):  # every rank stops here, none waits in a collective
            raise RuntimeError(f"--pipeline-vocab-parallel: {problem or 'the first stage could not read the tokens'}")
        partial = self.layers.embed(self.tokens.view(m * b, s)).to(self.dtype)
        if self.tp_group.size() > 1:
            dist.all_reduce(partial, group=self.tp_group)
        dist.reduce(partial, dst=dist.get_global_rank(self.pp_group, self.first_rank), group=self.pp_group)
        if self.rank == self.first_rank:
            summed = partial.view(m, b, s, -1)
            self.embeddings = {k: summed[k] for k in range(m)}
            self.embedding_bytes = partial.nbytes * (1 if self.forward_only else 2)  # and their gradients
        return iterator

    def epilogue(self) -> None:
        """The embeddings' gradients from the first stage to every rank; each adds its rows' weight gradient."""
        if self.forward_only:
            return
        m, b, s = self.num_microbatches, self.micro_batch_size, self.seq_length
        hidden = self.layers.hidden_size
        if self.rank == self.first_rank:
            missing = [k for k in range(m) if k not in self.embedding_grads]
            if missing:
                raise RuntimeError(f"--pipeline-vocab-parallel: no embedding gradient for microbatches {missing}")
            grads = torch.stack([self.embedding_grads.pop(k) for k in range(m)]).to(self.dtype).contiguous()
        else:
            grads = torch.empty((m, b, s, hidden), dtype=self.dtype, device=self._device())
        self._broadcast(grads, self.first_rank)
        self.layers.embedding_weight_grad(self.tokens.view(m * b, s), grads.view(m * b, s, hidden))

    # --- around the first and last stage's passes ---------------------------------------------------

    def hand_embedding(self, microbatch: int) -> None:
        """Before the first stage's F(k): its embedding, as the leaf whose gradient the epilogue needs."""
        embedded = self.embeddings.pop(microbatch)
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
        self.embedding_grads[microbatch] = leaf.grad

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
                                                 ("embeddings", self.embeddings), ("loss functions", self.loss_funcs))
                if d}
        if left:
            raise RuntimeError(f"schedule left vocabulary work undone: {left}")


NO_TOKENS = -1  # never a token id: the first stage sends it when it could not read the tokens


def _tokens_into(tokens: torch.Tensor, items) -> str | None:
    """Copy the items' tokens into ``tokens`` ([m, b, s]); a one-line problem when they have none."""
    found = [item.get("tokens") if isinstance(item, dict) else None for item in items]
    if any(t is None for t in found):
        return ("the first stage's data items must be dicts with 'tokens' (as Megatron's GPT datasets give), to look "
                "the embedding up on every rank")
    tokens.copy_(torch.stack(found))
    return None
