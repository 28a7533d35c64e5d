"""Per-GPU memory: parameters + gradients + optimizer state, and peak activations.

Activations come from the simulated timeline with per-stage sizes (the first and last stages
hold one layer fewer, the last also keeps the fp32 logits), so a device's peak is where its
stages' allocations (F) and releases (B frees what only the input gradient needed, W the GEMM
inputs) actually overlap in time.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedules import Kind, SimulationResult
from .layout import Layout, stage_layers
from .model import GPTModel

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


def static_bytes(model: GPTModel, layout: Layout, stages_per_device, num_stages: int,
                 distributed_optimizer: bool) -> tuple[float, ...]:
    layers = stage_layers(model, num_stages)
    per_param = bytes_per_param(layout.dp, distributed_optimizer)
    out = []
    for stages in stages_per_device:
        params = sum(layers[s] for s in stages) * model.layer_params
        if 0 in stages:
            params += model.embedding_params
        if num_stages - 1 in stages:
            params += model.head_params
        out.append(params / layout.tp * per_param)
    return tuple(out)


@dataclass(frozen=True)
class ActivationModel:
    """Bytes one F of each stage allocates, and the share B releases (the rest W releases)."""

    stage_bytes: tuple[float, ...]
    b_release: float
    transient: float = 0.0  # extra bytes alive only inside a pass (recomputation)


def activation_model(model: GPTModel, layout: Layout, num_stages: int, flash_attention: bool,
                     recompute: bool) -> ActivationModel:
    mb, tp = layout.micro_batch, layout.tp
    layers = stage_layers(model, num_stages)
    if recompute:
        # Full recomputation keeps each layer's input; the backward rebuilds one layer at a time.
        per_layer, b_release = model.input_bytes(mb, tp), 1.0
        transient = model.activation_bytes(mb, tp, flash_attention)
    else:
        per_layer = model.activation_bytes(mb, tp, flash_attention)
        b_release, transient = 1.0 - model.w_held_fraction(flash_attention), 0.0
    sizes = [n * per_layer for n in layers]
    sizes[-1] += model.logits_bytes(mb, tp)
    return ActivationModel(tuple(sizes), b_release, transient)


def activation_peaks(result: SimulationResult, acts: ActivationModel) -> tuple[float, ...]:
    """Peak activation bytes per device over the simulated timeline."""
    events: list[list[tuple[float, int, float]]] = [[] for _ in range(result.schedule.num_devices)]
    for action, interval in result.timeline.items():
        size = acts.stage_bytes[action.stage]
        if action.kind is Kind.F:
            events[interval.device].append((interval.start, 1, size))
        elif action.kind is Kind.B:
            events[interval.device].append((interval.end, 0, -size * acts.b_release))
        else:
            events[interval.device].append((interval.end, 0, -size * (1.0 - acts.b_release)))
    peaks = []
    for device_events in events:
        level = peak = 0.0
        for _, _, delta in sorted(device_events):
            level += delta
            peak = max(peak, level)
        peaks.append(peak + acts.transient)
    return tuple(peaks)
