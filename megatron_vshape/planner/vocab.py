"""Vocabulary parallelism in the plan (``--pipeline-vocab-parallel``; Yeung et al., MLSys 2025): the work of
the vocabulary passes, as the schedule core takes it (:class:`VocabWork`).

With the flag the stages hold the transformer layers alone (:func:`.balance.stage_work` with
``vocab_parallel``), so the uniform layout is even, and every pipeline device runs, per microbatch, one
H pass (its 1/p of the output layer's forward and input gradient and of the loss, with the pipeline
group's collectives) and one G pass (its 1/p of the output layer's weight gradient).

Time. The head's F, B and W are the planner's own (:meth:`.balance.StageExtras.from_flops`: the logits
GEMM, its input gradient and its weight gradient, in layers' worth, times one layer's F, B, W), the
same work that sits on the last stage without the flag, so the two rows cost the same head and differ
only in where it runs. The simulator times one shard's H as ``(F f + B b) / p + messages x comm``
(:meth:`VocabWork.shard_times`). The planner's collectives (:meth:`.costs.CostModel.vocab_collective_parts`,
over the pipeline group's ring): what every rank waits for in H (the packed hidden state's broadcast, the
statistics' all-gather: the rendezvous), as ``messages`` (in ``f`` where the timed costs have no message
time); and the fp32 hidden gradient's
reduce, which only the last stage's device waits for (``VocabWork.holder``: its H is that much longer,
and the other devices' G passes wait for its end, the loss gradient's broadcast).

Outside the passes (:func:`vocab_call_seconds`, added to the iteration by ``predict``): the call's
prologue (the first slot's tokens and the first embedding) and epilogue (the last gradients), with every
rank waiting; the data-parallel gradient reduction (:func:`vocab_dp_exposed`) as the runtime starts it: the
layers' buckets at their last W (hidden by the backward's window and the epilogue, as without the flag), the
vocabulary shard's buckets after the epilogue (exposed).
Memory: the first stage's device holds a few microbatches' embeddings and gradients, every device a few microbatches' tokens (``ActivationModel.vocab_embedding`` and ``vocab_tokens``, counted
along the simulated timeline by :func:`.memory.activation_peaks`, as the simulator's ledger counts them).

Memory. ``VocabWork.memory`` is what one microbatch holds from H to G over the whole vocabulary (p
shards' fp32 softmax, hidden-state copies and per-token tensors, as the runtime holds them:
:func:`.memory.vocab_activation_bytes`), in units of one V chunk's F activation; the planner's byte count of the
same (``ActivationModel.vocab_held``) is what its memory estimate uses, with the reduce's send buffer of every
device but the last stage's (one at a time: ``ActivationModel.vocab_send``, from each H to the next H or its G),
which the simulator counts in its memory timeline (``VocabWork.send``).
"""

from __future__ import annotations

from dataclasses import replace

from ..schedules.core.schedule import Costs, VocabWork
from ..schedules.core.vocab_embedding import embedding_slots
from ..vocab_shards import shard_sizes
from .balance import StageExtras
from .costs import P2P_LATENCY, CostModel, PassTimes
from .memory import vocab_activation_bytes, vocab_embedding_bytes, vocab_send_bytes
from .model import GPTModel
from .parallel_layout import ParallelLayout

FLAG = "--pipeline-vocab-parallel"
LABEL = "+vocab"  # a row with the flag: "v-zb +vocab"


def head_seconds(model: GPTModel, layout: ParallelLayout, times: PassTimes) -> tuple[float, float, float]:
    """(F, B, W) seconds of the output layer over the whole vocabulary for one microbatch, as the planner
    costs the head on the last stage (layers' worth of FLOPs times one layer's pass), scaled to the
    vocabulary the p shards cover: each shard does the busiest shard's rows (the runtime's split gives
    the first ``rows % p`` shards one row more)."""
    head = StageExtras.from_flops(model).head
    rows = -(-model.padded_vocab // layout.tp)
    covered = shard_sizes(rows, layout.pp)[0] * layout.pp * layout.tp / model.padded_vocab
    return tuple(x * t * covered for x, t in zip(head, (times.f, times.b, times.w)))


def vocab_work(model: GPTModel, layout: ParallelLayout, cost_model: CostModel, times: PassTimes, costs: Costs,
               flash_attention: bool = False) -> VocabWork:
    """The vocabulary passes of ``layout`` relative to ``costs`` (the simulator's timed costs: one V
    chunk's F, B, W and the message time ``comm`` it will charge H twice)."""
    f, b, w = head_seconds(model, layout, times)
    every, reduce = cost_model.vocab_collective_parts(model, layout)
    # Every device's H waits for ``every`` (in message times; in f where the timed costs have no message time,
    # Megatron's blocking p2p: one shard's H carries 1/p of it) and the last stage's device's for the reduce
    # too (``holder``).
    messages = every / costs.comm if costs.comm > 0 else 0.0
    if costs.comm <= 0:
        f += layout.pp * every
    chunk = model.layers / (2 * layout.pp) * model.activation_bytes(layout.micro_batch, layout.token_split,
                                                                    flash_attention)
    held, _ = vocab_activation_bytes(model, layout)
    embedding, tokens = vocab_embedding_bytes(model, layout)
    # Only the last stage's device waits for the hidden gradient's reduce, in its H (VocabWork.holder).
    return VocabWork(f / costs.f, b / costs.b, w / costs.w, layout.pp * held / chunk, embedding / chunk, tokens / chunk,
                     reduce / costs.f, messages, vocab_send_bytes(model, layout) / chunk)


def vocab_call_seconds(model: GPTModel, layout: ParallelLayout, cost_model: CostModel, first_actions) -> float:
    """Seconds of the vocabulary work outside the passes, with every rank waiting (``first_actions``: the
    program of the device that holds stage 0, which places the embedding's collectives:
    schedules/core/vocab_embedding.py): the prologue's tokens of the first slot's lookups and the first
    microbatch's embedding (its lookup and reduce; the others' arrive while passes run), and the epilogue's
    gradients (the microbatches whose first-stage B came after the last H: broadcast, then each rank adds its
    rows into fp32 ``main_grad``). The tokens, lookups and gradients placed at the H passes run on the
    vocabulary queue beside the passes and are not charged."""
    slots = embedding_slots(first_actions, training=True)
    tokens = layout.micro_batch * model.seq_length / layout.cp
    embeddings = 1 + len(slots.grads[-1])
    moved = 8.0 * tokens * len(slots.lookups[0]) + embeddings * 2.0 * tokens * model.hidden
    seconds = 0.0 if layout.pp <= 1 else (2 + embeddings) * P2P_LATENCY + moved / cost_model.pipeline_group_bandwidth(layout)
    rows = embeddings * (2.0 + 2.0 + 4.0 + 4.0) * tokens * model.hidden  # lookup; gradient read; main_grad r + w
    return seconds + cost_model._streaming(rows)


def vocab_dp_exposed(model: GPTModel, layout: ParallelLayout, cost_model: CostModel, times: PassTimes,
                     window: float, outside: float) -> float:
    """The data-parallel sync the iteration pays with the flag, as the runtime starts it
    (runtime/grad_finish.py): every bucket of the layers at its last W, as without the flag, with the
    call's epilogue (``outside``, after the last W) hiding it too; the vocabulary shard's buckets only after
    the epilogue, since G and the embedding's gradients add to them until then, so their share of the
    gradient reduction is exposed in full (the parameter gather is as without the flag)."""
    if layout.dp * layout.cp == 1:
        return 0.0
    share = (model.embedding_params + model.head_params) / model.total_params  # every rank holds 1/p of both
    shard = times.grad_reduce * share
    layers = replace(times, grad_reduce=times.grad_reduce - shard, dp_sync=times.dp_sync - shard)
    return cost_model.dp_exposed(model, layout, layers, window + outside) + shard


def label(schedule: str, vocab_parallel: bool) -> str:
    """The row's name: the schedule, ``+vocab`` where it runs with the flag."""
    return f"{schedule} {LABEL}" if vocab_parallel else schedule
