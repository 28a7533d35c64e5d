"""Vocabulary parallelism over the pipeline group: the arithmetic of its passes (Yeung et al., MLSys 2025).

Megatron shards the vocabulary rows over the tensor-parallel ranks. Here each TP shard is sharded again
over the p pipeline ranks: pipeline rank s holds the s-th contiguous part of its TP shard's rows
(:func:`..vocab_shards.shard_rows`; parts differ by at most one row when p does not divide them). The input embedding,
the output layer and the cross-entropy then run on every pipeline rank, each on its rows, instead of all
on the first and last stage (on a V placement both sit on device 0).

The output layer and the loss are the H pass of every microbatch on every pipeline rank (the executor's
protocol, with its collectives, is runtime/vocab_h.py). The arithmetic, in the order H runs it:

* :func:`local_output`: this rank's logits for the final hidden state and, per token, three numbers: the
  local maximum, the sum of ``exp(logit - local max)`` and the target's logit where this rank holds the
  target. One all-gather of those numbers over the vocabulary's ranks gives every rank the loss
  (:func:`combine_statistics`: ``M = max_s m_s``, ``Z = sum_s z_s exp(m_s - M)``,
  ``loss = log Z + M - target logit``) and its softmax.
* :func:`unit_grad_parts` (while the all-gather runs) and :func:`unit_hidden_grad`: this rank's part of the
  hidden state's gradient *per unit loss gradient*. The loss gradient g (a number per token, from the
  script's loss function on the last stage) factors out of the sum over the shards, so the parts go into
  one reduce onto the last stage right after the statistics, without waiting for the loss function.
* :func:`logits_grad`: the gradient of this rank's logits once g is known; the weight gradient (G, a W).

:func:`output_forward` and :func:`output_backward` run the same arithmetic with blocking collectives (the
S/T form of the authors' Algorithm 1, for the tests and the benchmark's calibration).

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
    # [tokens, rows] fp32: exp(logit - local max); the softmax is probs * scale (with ``scale`` None: probs is the
    # softmax itself). The scale is applied in :func:`logits_grad`, with the loss gradient: one pass, not two.
    probs: torch.Tensor
    target_local: torch.Tensor  # [tokens] index of the target in this shard's rows, or -1
    loss: torch.Tensor | None = None  # [tokens], fp32, once the statistics are combined
    stats: torch.Tensor | None = None  # [3, tokens] fp32: this rank's max, sum of exp(logit - max), target logit
    scale: torch.Tensor | None = None  # [tokens] fp32: exp(local max - M) / Z, once combined


def local_output(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, shard: VocabShard,
                 out: torch.Tensor | None = None) -> OutputState:
    """This rank's logits and softmax statistics, no collective (the first half of S).

    ``hidden``: [tokens, hidden] (the final norm's output); ``weight``: [shard.rows, hidden] (this rank's
    rows of the output layer); ``labels``: [tokens] in the full vocabulary; ``out``: an fp32 [tokens, rows]
    buffer to compute the logits in (a freed earlier microbatch's: a fresh one of tens of MiB costs its page
    faults on the CPU), or None.
    """
    if out is None or tuple(out.shape) != (hidden.shape[0], weight.shape[0]) or out.dtype != torch.float32:
        logits = (hidden @ weight.t()).float()
    elif weight.dtype == torch.float32 and hidden.dtype == torch.float32:
        logits = torch.mm(hidden, weight.t(), out=out)
    else:
        logits = out.copy_(hidden @ weight.t())
    held = (labels >= shard.start) & (labels < shard.end)
    target_local = torch.where(held, labels - shard.start, torch.full_like(labels, -1))
    picked = logits.gather(-1, target_local.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    target_logit = torch.where(held, picked, torch.zeros_like(picked))
    local_max = logits.amax(dim=-1)  # (max() also finds the indices: several times slower)
    # In place, one exp over the logits (the pass is bound by its elementwise work on a large shard): the
    # buffer holds exp(logit - local max); times the scale of the combined statistics it is the softmax.
    exp = logits.sub_(local_max.unsqueeze(-1)).exp_()
    stats = torch.stack([local_max, exp.sum(dim=-1), target_logit])
    return OutputState(hidden, exp, target_local, stats=stats)


def combine_statistics(state: OutputState, gathered: torch.Tensor) -> None:
    """The loss from every rank's statistics (``gathered``: [ranks, 3, tokens]) and the scale that turns this
    rank's ``probs`` into its softmax: ``M = max_s m_s``, ``Z = sum_s z_s exp(m_s - M)``,
    ``loss = log Z + M - target logit``, ``scale = exp(m - M) / Z``. The probs are left as they are (the
    scale goes in with the loss gradient, :func:`logits_grad`)."""
    maxima, sums, targets = gathered[:, 0], gathered[:, 1], gathered[:, 2]
    global_max = maxima.max(dim=0).values
    total = (sums * (maxima - global_max).exp()).sum(dim=0)
    state.loss = total.log() + global_max - targets.sum(dim=0)
    state.scale = (state.stats[0] - global_max).exp() / total


def unit_grad_parts(state: OutputState, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Before the statistics are combined (overlapping their all-gather): ``exp(logit - local max) @ W``
    and the target's row of W where this rank holds it (zero elsewhere), both fp32 [tokens, hidden].

    The hidden state's gradient is ``g * (sum_s scale_s * A_s - sum_s B_s)`` (g: d(objective)/d(per-token
    loss), a number per token): with ``g`` factored out, every rank's part needs only the statistics, not the
    loss function's gradient, so it goes into the one reduce right after the statistics' all-gather, and the
    last stage multiplies by ``g`` itself. The product stays fp32 (see :func:`output_backward`)."""
    exp = state.probs if state.probs.dtype == weight.dtype else state.probs.to(weight.dtype)
    held = (state.target_local >= 0).unsqueeze(-1)
    target_rows = weight.index_select(0, state.target_local.clamp(min=0)).float() * held
    return matmul_fp32_out(exp, weight), target_rows


def unit_hidden_grad(state: OutputState, parts: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """This rank's part of the hidden state's gradient per unit loss gradient, fp32 [tokens, hidden]:
    ``scale * A - B`` (in place in ``A``), once the statistics are combined."""
    exp_w, target_rows = parts
    return exp_w.mul_(state.scale.unsqueeze(-1)).sub_(target_rows)


def logits_grad(state: OutputState, grad_loss: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The gradient of this rank's logits, ``(softmax - one-hot(target)) * grad_loss``, in place in
    ``probs`` (``probs * (scale * grad_loss) - one-hot * grad_loss``: one pass over the logits), cast to
    ``dtype``. The one-hot goes in by ``scatter_add_`` (a row without the target adds 0 at column 0): no
    ``nonzero``, so no host sync."""
    factor = grad_loss if state.scale is None else state.scale * grad_loss
    grad = state.probs.mul_(factor.to(state.probs.dtype).unsqueeze(-1))
    held = (state.target_local >= 0).to(grad.dtype)
    grad.scatter_add_(1, state.target_local.clamp(min=0).unsqueeze(-1), (-held * grad_loss.to(grad.dtype)).unsqueeze(-1))
    return grad.to(dtype)


def output_forward(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, shard: VocabShard,
                   groups: Sequence) -> OutputState:
    """S at once: :func:`local_output`, the statistics' all-gather over ``groups``, :func:`combine_statistics`.
    Every rank gets the same loss. (The executor's H runs the steps itself, with the collectives on its
    queue: runtime/vocab_h.py.)"""
    state = local_output(hidden, weight, labels, shard)
    combine_statistics(state, _all_gather(state.stats, groups))
    return state


def output_backward(state: OutputState, weight: torch.Tensor, grad_loss: torch.Tensor,
                    groups: Sequence) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """T at once: the hidden state's gradient (summed over ``groups``: one all-reduce) and the task that
    computes this rank's output-layer weight gradient (the W of the vocabulary layers).

    ``grad_loss``: [tokens], d(objective)/d(per-token loss) (the loss mask and the scaling of the loss
    function, as Megatron's loss function applies them).
    """
    grad_logits = logits_grad(state, grad_loss, weight.dtype)
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
