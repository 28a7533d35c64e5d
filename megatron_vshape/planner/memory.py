"""Per-GPU memory: parameters + gradients + optimizer state, and peak activations.

Activations come from the simulated timeline with per-stage sizes (the first and last stages
hold one layer fewer, the last also keeps the fp32 logits), so a device's peak is where its
stages' allocations (F) and releases (B frees what only the input gradient needed, W the GEMM
inputs) actually overlap in time. Context parallelism splits activations like sequence
parallelism does (over TP x CP); recomputation modes: see :func:`activation_model`.

Vocabulary parallelism (``--pipeline-vocab-parallel``): each of the p pipeline devices holds 1/p of the
rows of the word embedding and of the output layer (:func:`vocab_params_per_device`), and instead of
the last stage keeping one microbatch's fp32 logits from its F to its B, every device holds its shard's
fp32 softmax and a copy of the final hidden state from its H pass to its G pass
(:func:`vocab_activation_bytes`), and every device but the last stage's one fp32 [tokens, hidden] send buffer
of the hidden gradient's reduce (:func:`vocab_send_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedules.core.actions import Kind, VocabKind
from ..schedules.core.simulator import SimulationResult
from ..schedules.core.vocab_embedding import buffer_events, send_events
from ..vocab_shards import shard_sizes
from .model import GPTModel
from .parallel_layout import ParallelLayout, stage_layers

# CUDA context, NCCL buffers, allocator fragmentation: not available to the model.
RESERVED_BYTES = 4 * 1024**3


@dataclass(frozen=True)
class MemoryEstimate:
    static: tuple[float, ...]  # per device: weights, grads, optimizer state
    activation: tuple[float, ...]  # per device peak activations

    @property
    def per_device(self) -> tuple[float, ...]:
        return tuple(s + a for s, a in zip(self.static, self.activation))

    @property
    def peak(self) -> float:
        return max(self.per_device)

    @property
    def peak_activation(self) -> float:
        return max(self.activation)


def bytes_per_param(dp: int, distributed_optimizer: bool) -> float:
    """bf16 weight (2) + fp32 main grad (4) + fp32 master, Adam m and v (12, sharded over DP)."""
    return 6.0 + (12.0 / dp if distributed_optimizer else 12.0)


def stage_starts(layers) -> list[int]:
    starts, at = [], 0
    for n in layers:
        starts.append(at)
        at += n
    return starts


def vocab_params_per_device(model: GPTModel, stages_per_device, num_stages: int,
                            vocab_parallel: bool = False) -> tuple[float, ...]:
    """Parameters of the vocabulary layers (the word embedding and the output layer's matrix) on each
    pipeline device, before the TP split.

    Without vocabulary parallelism the first stage's device holds the embedding and the last stage's
    the output layer (a copy of the embedding when they are tied: Megatron keeps the tied matrix on both
    stages); on a V placement device 0 holds both. With it each device holds its rows of each distinct
    matrix (one when tied, two when not): 1/p of the vocabulary layers.
    """
    if vocab_parallel:
        matrices = model.vocab_layer_params // model.vocab_matrix_params
        return tuple(float(rows * model.hidden * matrices)
                     for rows in shard_sizes(model.padded_vocab, len(stages_per_device)))
    one = float(model.vocab_matrix_params)
    return tuple(one * ((0 in stages) + (num_stages - 1 in stages)) for stages in stages_per_device)


def static_bytes(model: GPTModel, layout: ParallelLayout, stages_per_device, num_stages: int,
                 distributed_optimizer: bool, layers_per_stage=None, vocab_parallel: bool = False) -> tuple[float, ...]:
    """Weights, gradients and optimizer state per device; routed experts split over EP x TP and
    their optimizer state over the DP x CP / EP ranks that share them (Megatron's expert-DP group).
    The vocabulary layers: :func:`vocab_params_per_device`; learned positions stay on the first stage,
    the final norm on the last."""
    layers = list(layers_per_stage) if layers_per_stage is not None else stage_layers(model, num_stages)
    starts = stage_starts(layers)
    data = layout.dp * layout.cp
    per_param = bytes_per_param(data, distributed_optimizer)
    per_expert = bytes_per_param(max(data // layout.ep, 1), distributed_optimizer)
    vocab = vocab_params_per_device(model, stages_per_device, num_stages, vocab_parallel)
    out = []
    for stages, vocab_params in zip(stages_per_device, vocab):
        dense, experts = vocab_params, 0.0
        for s in stages:
            d, e = model.stage_params(starts[s], layers[s]) if layers_per_stage is not None else \
                (layers[s] * model.layer_params, 0.0)
            dense, experts = dense + d, experts + e
        if 0 in stages:
            dense += model.embedding_params - model.vocab_matrix_params  # learned positions
        if num_stages - 1 in stages:
            dense += model.head_params - model.vocab_matrix_params  # final norm
        out.append(dense / layout.tp * per_param + experts / (layout.tp * layout.ep) * per_expert)
    return tuple(out)


# Per token, the small tensors one microbatch's H keeps for its G (runtime/vocab_h.py, vocab_parallel.py): the
# labels (int64, in the broadcast's buffer the hidden state is a view of), the target's index in the shard
# (int64), the statistics (3 fp32), the scale and the loss (fp32), the loss gradient g (fp32) and, on the
# ranks it rides to, its copy in the next H's buffer (fp32).
VOCAB_TOKEN_BYTES = 8 + 8 + 12 + 4 + 4 + 4 + 4


def vocab_activation_bytes(model: GPTModel, layout: ParallelLayout) -> tuple[float, float]:
    """(held, transient) bytes of one microbatch's vocabulary passes on the busiest shard (the most rows
    of one TP rank's part of the vocabulary, split over the p pipeline ranks), as the runtime holds them
    (runtime/vocab_h.py; the hidden state in the pipeline dtype, bf16).

    Held from H to G: the shard's fp32 softmax (the logits' buffer, which G turns into their gradient in
    place), the final hidden state G reads (bf16, every token of the microbatch) and the per-token tensors
    (:data:`VOCAB_TOKEN_BYTES`). The reduce's fp32 send buffer of the ranks other than the last stage's is
    not per microbatch (:func:`vocab_send_bytes`). Alive only inside a pass: in H the bf16 logits before
    their fp32 copy, then the bf16 softmax the hidden gradient's GEMM reads and the target rows (fp32 and
    bf16, t x h); in G the bf16 logits' gradient and the bf16 [rows, hidden] weight gradient before it is
    added into fp32 ``main_grad``: the larger of the two."""
    tokens = layout.micro_batch * model.seq_length / layout.cp
    rows = shard_sizes(-(-model.padded_vocab // layout.tp), layout.pp)[0]
    held = 4.0 * tokens * rows + 2.0 * tokens * model.hidden + VOCAB_TOKEN_BYTES * tokens
    return held, 2.0 * tokens * rows + max(6.0 * tokens * model.hidden, 2.0 * rows * model.hidden)


def vocab_send_bytes(model: GPTModel, layout: ParallelLayout) -> float:
    """The fp32 [tokens, hidden] part of the hidden gradient a rank other than the last stage's sends in its
    H's reduce, which it holds until the reduce is waited: at its next H or at G(k), whichever comes first
    (:func:`..schedules.core.vocab_embedding.send_events`; at most one at a time)."""
    return 4.0 * layout.micro_batch * model.seq_length / layout.cp * model.hidden


@dataclass(frozen=True)
class ActivationModel:
    """Bytes one F of each stage allocates, and the share B releases (the rest W releases)."""

    stage_bytes: tuple[float, ...]
    b_release: float
    transient: float = 0.0  # extra bytes alive only inside a pass (recomputation)
    vocab_held: float = 0.0  # vocabulary parallelism: bytes one shard holds from its H to its G
    vocab_transient: float = 0.0  # ... and alive only inside its H
    # ... and the embedding's buffers (schedules/core/vocab_embedding.buffer_events): one microbatch's
    # embedding (or its gradient) on the first stage's device, one microbatch's tokens on every device
    vocab_embedding: float = 0.0
    vocab_tokens: float = 0.0
    vocab_send: float = 0.0  # the reduce's send buffer of a device other than the last stage's (one at most)


def activation_model(model: GPTModel, layout: ParallelLayout, num_stages: int, flash_attention: bool,
                     recompute: bool | str, layers_per_stage=None, vocab_parallel: bool = False) -> ActivationModel:
    """``recompute``: False/"none", True/"full" (each layer keeps its input; the backward rebuilds
    one layer at a time), or "selective" (core attention rebuilt: its s x s scores not kept).
    ``vocab_parallel``: the last stage keeps no logits; each vocabulary shard holds
    :func:`vocab_activation_bytes` instead."""
    mode = {True: "full", False: "none"}.get(recompute, recompute)
    mb, split = layout.micro_batch, layout.tp * layout.cp
    layers = list(layers_per_stage) if layers_per_stage is not None else stage_layers(model, num_stages)
    full = model.activation_bytes(mb, split, flash_attention)
    tokens = mb * model.seq_length / split
    # the backward of one Mamba layer rebuilds its chunk states (the layer's state memory)
    states = max(c.transient_bytes for c in model.layer_costs) * tokens
    if mode == "full":
        per_layer, b_release, transient = model.input_bytes(mb, split), 1.0, full + states
    elif mode == "selective":
        kept = model.activation_bytes(mb, split, True)  # the scores are rebuilt, never stored
        per_layer, b_release = kept, 1.0 - model.w_held_fraction(True)
        transient = full - kept + states  # one layer's scores, alive inside its backward
    else:
        per_layer, b_release, transient = full, 1.0 - model.w_held_fraction(flash_attention), states
    if layers_per_stage is None or mode == "full":
        sizes = [n * per_layer for n in layers]
    else:  # layers that differ (a pattern): each stage's own sum
        weights = [w[3] for w in model.layer_weights(flash_attention or mode == "selective")]
        sizes = [sum(weights[s:s + n]) * per_layer for s, n in zip(stage_starts(layers), layers)]
    if not vocab_parallel:
        sizes[-1] += model.logits_bytes(mb, split)
        return ActivationModel(tuple(sizes), b_release, transient)
    held, inside = vocab_activation_bytes(model, layout)
    embedding, token_bytes = vocab_embedding_bytes(model, layout)
    return ActivationModel(tuple(sizes), b_release, transient, held, inside, embedding, token_bytes,
                           vocab_send_bytes(model, layout))


def vocab_embedding_bytes(model: GPTModel, layout: ParallelLayout) -> tuple[float, float]:
    """(embedding, tokens) bytes of one microbatch under vocabulary parallelism: its embedding (or the
    embedding's gradient) as the first stage's device holds it between the collectives and the passes (bf16,
    b x s x h: the whole sequence, before any sequence-parallel scatter), and its tokens (int64), which every
    device holds from their broadcast to the gradient's."""
    tokens = layout.micro_batch * model.seq_length / layout.cp
    return 2.0 * tokens * model.hidden, 8.0 * tokens


def activation_peaks(result: SimulationResult, acts: ActivationModel) -> tuple[float, ...]:
    """Peak activation bytes per device over the simulated timeline. A vocabulary H allocates its
    shard's bytes at its start, its G frees them at its end; a pass's transient bytes (a recomputing
    backward's, an H's logits) come on top of the device's peak, the larger of the two where both run."""
    events: list[list[tuple[float, int, float]]] = [[] for _ in range(result.schedule.num_devices)]
    for action, interval in result.timeline.items():
        kind = action.kind
        if kind is VocabKind.H:
            events[interval.device].append((interval.start, 1, acts.vocab_held))
            continue
        if kind is VocabKind.G:
            events[interval.device].append((interval.end, 0, -acts.vocab_held))
            continue
        size = acts.stage_bytes[action.stage]
        if kind is Kind.F:
            events[interval.device].append((interval.start, 1, size))
        elif kind is Kind.B:
            events[interval.device].append((interval.end, 0, -size * acts.b_release))
        else:
            events[interval.device].append((interval.end, 0, -size * (1.0 - acts.b_release)))
    if result.schedule.vocab_parallel and (acts.vocab_embedding or acts.vocab_tokens):
        _embedding_buffer_events(result, acts, events)
    if result.schedule.vocab_parallel and acts.vocab_send:
        _send_buffer_events(result, acts, events)
    transient = max(acts.transient, acts.vocab_transient if result.schedule.vocab_parallel else 0.0)
    peaks = []
    for device_events in events:
        level = peak = 0.0
        for _, _, delta in sorted(device_events):
            level += delta
            peak = max(peak, level)
        peaks.append(peak + transient)
    return tuple(peaks)


def _send_buffer_events(result: SimulationResult, acts: ActivationModel, events) -> None:
    """The reduce's send buffers (:func:`~..schedules.core.vocab_embedding.send_events`) as timed events."""
    schedule = result.schedule
    last = schedule.placement.device_of(schedule.placement.num_stages - 1)
    for device, (program, changes) in enumerate(zip(schedule.programs, send_events(schedule.programs, last))):
        for index, change in changes:
            events[device].append((result.timeline[program[index]].start, 1 if change > 0 else 0,
                                   change * acts.vocab_send))


def _embedding_buffer_events(result: SimulationResult, acts: ActivationModel, events) -> None:
    """The embedding's buffers (:func:`~..schedules.core.vocab_embedding.buffer_events`) as timed events."""
    schedule = result.schedule
    first = schedule.placement.device_of(0)
    for device, (program, changes) in enumerate(zip(schedule.programs, buffer_events(schedule.programs, first))):
        end = max((result.timeline[a].end for a in program), default=0.0)
        for change in changes:
            if change.index < len(program):
                interval = result.timeline[program[change.index]]
                at = interval.end if change.at_end else interval.start
            else:
                at = end
            delta = change.embeddings * acts.vocab_embedding + change.tokens * acts.vocab_tokens
            events[device].append((at, 1 if delta > 0 else 0, delta))
