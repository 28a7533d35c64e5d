"""Vocabulary parallelism over the pipeline group: the arithmetic of its passes (Yeung et al., MLSys 2025).

Megatron shards the vocabulary rows over the tensor-parallel ranks. Here each TP shard is sharded again
over the p pipeline ranks: pipeline rank s holds the s-th contiguous part of its TP shard's rows
(:func:`..vocab_shards.shard_rows`; parts differ by at most one row when p does not divide them). The input embedding,
the output layer and the cross-entropy then run on every pipeline rank, each on its rows, instead of all
on the first and last stage (on a V placement both sit on device 0).

The output layer and loss are two passes per microbatch on every pipeline rank, with one collective
each, so that a schedule can place them like any other pass:

* **S** (:func:`output_forward`): this rank's logits for the final hidden state (which the last stage
  sends to every pipeline rank) and, per token, three numbers: the local maximum, the sum of
  ``exp(logit - local max)`` and the target's logit where this rank holds the target. One all-gather of
  those numbers over the vocabulary's ranks gives every rank the loss (the softmax statistics combine as
  ``M = max_s m_s``, ``Z = sum_s z_s exp(m_s - M)``, ``loss = log Z + M - target logit``).
* **T** (:func:`output_backward`): the softmax gradient of this rank's logits, its part of the hidden
  state's gradient (summed over the vocabulary's ranks: one all-reduce, for the last stage's B) and the
  weight gradient, returned as a task so that it is a W pass like any other (deferrable).

The input embedding is one lookup of this rank's rows (zero elsewhere) summed over the vocabulary's ranks
for the first stage (:func:`embedding_forward`), and a weight gradient from the embedding output's
gradient, which the first stage sends to every rank (:func:`embedding_weight_grad`).

The vocabulary's ranks of one model replica are its TP x PP ranks; a collective over them is run as one
over each group in turn (``groups``: the TP group, then the pipeline group), which is the same reduction.
The math is Megatron's ``vocab_parallel_cross_entropy`` (fp32 softmax statistics, the same loss), with
the two reductions of its forward replaced by the one gather above.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..vocab_shards import shard_rows


@dataclass(frozen=True)
class VocabShard:
    """The rows of the padded vocabulary one (TP rank, pipeline rank) holds: ``[start, end)``."""

    start: int
    end: int

    @classmethod
    def of(cls, padded_vocab: int, tp_size: int, tp_rank: int, pp_size: int, pp_rank: int) -> VocabShard:
        if padded_vocab % tp_size:
            raise ValueError(f"the padded vocabulary ({padded_vocab}) must divide by the TP size ({tp_size}), "
                             "as Megatron pads it")
        per_tp = padded_vocab // tp_size
        start, end = shard_rows(per_tp, pp_size, pp_rank)
        return cls(tp_rank * per_tp + start, tp_rank * per_tp + end)

    @property
    def rows(self) -> int:
        return self.end - self.start


@dataclass
class OutputState:
    """What S keeps for T: this rank's logits (then softmax) and the loss statistics."""

    hidden: torch.Tensor  # [tokens, hidden], the final hidden state S was given
    probs: torch.Tensor  # [tokens, rows]: exp(logit - M) / Z once S is done
    target_local: torch.Tensor  # [tokens] index of the target in this shard's rows, or -1
    loss: torch.Tensor  # [tokens], fp32


def output_forward(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, shard: VocabShard,
                   groups: Sequence) -> OutputState:
    """The S pass: this rank's logits and the per-token loss, from one all-gather over ``groups``.

    ``hidden``: [tokens, hidden] (the final norm's output); ``weight``: [shard.rows, hidden] (this rank's
    rows of the output layer); ``labels``: [tokens] in the full vocabulary.
    """
    logits = (hidden @ weight.t()).float()
    held = (labels >= shard.start) & (labels < shard.end)
    target_local = torch.where(held, labels - shard.start, torch.full_like(labels, -1))
    picked = logits.gather(-1, target_local.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    target_logit = torch.where(held, picked, torch.zeros_like(picked))
    local_max = logits.amax(dim=-1)  # (max() also finds the indices: several times slower)
    # In place, one exp over the logits (the pass is bound by its elementwise work on a large shard): the
    # buffer holds exp(logit - local max), scaled into the softmax once the statistics are in.
    exp = logits.sub_(local_max.unsqueeze(-1)).exp_()
    local_sum = exp.sum(dim=-1)
    stats = _all_gather(torch.stack([local_max, local_sum, target_logit]), groups)  # [ranks, 3, tokens]
    maxima, sums, targets = stats[:, 0], stats[:, 1], stats[:, 2]
    global_max = maxima.max(dim=0).values
    total = (sums * (maxima - global_max).exp()).sum(dim=0)
    loss = total.log() + global_max - targets.sum(dim=0)
    probs = exp.mul_(((local_max - global_max).exp() / total).unsqueeze(-1))
    return OutputState(hidden, probs, target_local, loss)


def output_backward(state: OutputState, weight: torch.Tensor, grad_loss: torch.Tensor,
                    groups: Sequence) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """The T pass: the hidden state's gradient (summed over ``groups``: one all-reduce) and the task that
    computes this rank's output-layer weight gradient (the W of the vocabulary layers).

    ``grad_loss``: [tokens], d(objective)/d(per-token loss) (the loss mask and the scaling of the loss
    function, as Megatron's loss function applies them).
    """
    grad_logits = state.probs
    held = state.target_local >= 0
    rows = torch.nonzero(held).squeeze(-1)
    grad_logits[rows, state.target_local[rows]] -= 1.0
    grad_logits.mul_(grad_loss.unsqueeze(-1))
    grad_logits = grad_logits.to(weight.dtype)
    # In fp32 until the sum over the shards is complete: an unsharded output layer's GEMM accumulates over
    # the whole vocabulary in fp32 and rounds once, so each shard's part stays fp32 through the all-reduce
    # (the caller casts the sum once). Rounding every part to bf16 and summing in bf16 drifted from Megatron.
    grad_hidden = matmul_fp32_out(grad_logits, weight)
    for group in groups:
        dist.all_reduce(grad_hidden, group=group)
    hidden = state.hidden

    def weight_grad() -> torch.Tensor:
        return grad_logits.t() @ hidden

    return grad_hidden, weight_grad


def matmul_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with fp32 accumulation and an fp32 result, for inputs of any float dtype.

    On CUDA the half-precision GEMM writes fp32 directly (``out_dtype``); elsewhere the inputs are upcast,
    which gives the same sums (a product of two bf16 or fp16 values is exact in fp32)."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return a @ b
    if a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def embedding_partial(tokens: torch.Tensor, weight: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """This rank's rows of the embedding lookup, zero for tokens it does not hold (``[..., hidden]`` for
    ``tokens`` of any shape); no collective: the sum over the vocabulary's ranks is the lookup."""
    held = (tokens >= shard.start) & (tokens < shard.end)
    local = torch.where(held, tokens - shard.start, torch.zeros_like(tokens))
    return weight[local] * held.unsqueeze(-1).to(weight.dtype)


def embedding_forward(tokens: torch.Tensor, weight: torch.Tensor, shard: VocabShard, groups: Sequence) -> torch.Tensor:
    """This rank's rows of the embedding lookup, zero for tokens it does not hold, summed over ``groups``
    (every rank gets the sum; the first stage uses it)."""
    out = embedding_partial(tokens, weight, shard)
    for group in groups:
        dist.all_reduce(out, group=group)
    return out


def embedding_weight_grad(tokens: torch.Tensor, grad_output: torch.Tensor, shard: VocabShard,
                          into: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's embedding weight gradient from the embedding output's gradient ``grad_output``
    ([tokens, hidden], sent by the first stage to every rank), added into ``into`` ([rows, hidden], e.g. the
    weight's fp32 ``main_grad``) or into a new fp32 tensor, which is returned.

    The sum is taken in ``into``'s dtype (fp32): a frequent token's row sums thousands of values, which a
    sum in bf16 rounds away (Megatron adds each microbatch's gradient into fp32 ``main_grad``)."""
    held = (tokens >= shard.start) & (tokens < shard.end)
    if into is None:
        into = torch.zeros(shard.rows, grad_output.shape[-1], dtype=torch.float32, device=grad_output.device)
    into.index_add_(0, tokens[held] - shard.start, grad_output[held].to(into.dtype))
    return into


def _all_gather(tensor: torch.Tensor, groups: Sequence) -> torch.Tensor:
    """``tensor`` of every rank of the groups' product, stacked along a new first dimension."""
    gathered = tensor.unsqueeze(0)
    for group in groups:
        parts = [torch.empty_like(gathered) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, gathered.contiguous(), group=group)
        gathered = torch.cat(parts)
    return gathered
