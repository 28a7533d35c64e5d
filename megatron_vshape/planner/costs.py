"""Per-pass times (F, B, W per layer), communication and optimizer times for one layout.

Compute: FLOPs / (peak * efficiency) for the GEMMs (and attention), one efficiency which the user
calibrates from one measured F pass (:func:`calibrate_efficiency`), plus the bytes the memory-bound
kernels move (layer norms, dropout, GeLU, softmax: :meth:`GPTModel.elementwise_bytes`) over HBM
bandwidth * hbm_efficiency. F and B carry such kernels, W (weight-gradient GEMMs) does not, so W is
cheaper than its FLOPs alone say relative to F and B.
Communication: ring collectives, time = (n-1)/n * bytes / (bandwidth * bandwidth_efficiency).
Megatron's rank order is TP innermost, then DP, then PP, 8 GPUs per node.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import GPU
from .layout import Layout
from .model import GPTModel

P2P_LATENCY = 20e-6  # seconds per point-to-point message (launch + NCCL handshake)
HBM_EFFICIENCY = 0.8  # achievable fraction of HBM bandwidth for streaming kernels


@dataclass(frozen=True)
class PassTimes:
    """Seconds per transformer-layer slot and microbatch, plus per-iteration fixed costs."""

    f: float
    b: float
    w: float
    p2p: float  # one activation / gradient message between neighbouring stages
    dp_sync: float  # gradient reduce-scatter + parameter all-gather, not overlapped
    optimizer: float  # Adam step, memory-bound


@dataclass(frozen=True)
class CostModel:
    gpu: GPU
    efficiency: float = 0.6  # achievable fraction of peak for the GEMM-heavy passes
    bandwidth_efficiency: float = 0.7  # achievable fraction of link bandwidth for NCCL
    distributed_optimizer: bool = True
    # Megatron's own schedules (1F1B, interleaved) wait for each p2p message (exposed_p2p.py)
    blocking_p2p: bool = True
    hbm_efficiency: float = HBM_EFFICIENCY  # memory-bound kernels and the optimizer step

    def __post_init__(self):
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"--efficiency {self.efficiency}: must be in (0, 1]; calibrate with --calibrate-f-ms")
        if not 0 < self.bandwidth_efficiency <= 1:
            raise ValueError(f"--bandwidth-efficiency {self.bandwidth_efficiency}: must be in (0, 1]")

    def _compute(self, flops: float) -> float:
        return flops / (self.gpu.peak_flops * self.efficiency)

    def _streaming(self, nbytes: float) -> float:
        return nbytes / (self.gpu.hbm_bandwidth * self.hbm_efficiency)

    def _ring(self, nbytes: float, ranks: int, bandwidth: float) -> float:
        if ranks <= 1:
            return 0.0
        return (ranks - 1) / ranks * nbytes / (bandwidth * self.bandwidth_efficiency)

    def _bandwidth(self, span: int) -> float:
        """Link for a group whose consecutive members are ``span`` ranks apart."""
        return self.gpu.nvlink_bandwidth if span < self.gpu.gpus_per_node else self.gpu.internode_bandwidth

    def pass_times(self, model: GPTModel, layout: Layout, flash_attention: bool = False) -> PassTimes:
        tp, mb = layout.tp, layout.micro_batch
        f_flops, b_flops, w_flops = model.layer_flops(mb)
        # memory-bound kernels: sequence parallelism and TP split every one of them over the TP ranks
        f_bytes, b_bytes = model.elementwise_bytes(mb, flash_attention)
        # Sequence parallelism: forward = 2 all-gathers + 2 reduce-scatters of the b*s*h bf16
        # activation; B the same; W re-gathers the two GEMM inputs (Megatron does not keep them).
        tensor = 2.0 * mb * model.seq_length * model.hidden
        tp_bw = self._bandwidth(1) if tp <= self.gpu.gpus_per_node else self.gpu.internode_bandwidth
        collective = self._ring(tensor, tp, tp_bw)
        f = self._compute(f_flops / tp) + self._streaming(f_bytes / tp) + 4 * collective
        b = self._compute(b_flops / tp) + self._streaming(b_bytes / tp) + 4 * collective
        w = self._compute(w_flops / tp) + 2 * collective
        return PassTimes(f, b, w, self._p2p(model, layout), self._dp_sync(model, layout), self._optimizer(model, layout))

    def _p2p(self, model: GPTModel, layout: Layout) -> float:
        """Mean time of one activation/gradient message between neighbouring stages.

        The simulator takes one message time, and a pipeline's fill and drain pay the sum over its
        hops, so the mean over hops is the right single number.
        """
        hops = max(layout.pp - 1, 1)
        return sum(self.p2p_between(model, layout, p, p + 1) for p in range(hops)) / hops

    def p2p_between(self, model: GPTModel, layout: Layout, a: int, b: int) -> float:
        """One activation/gradient message (b*s*h/TP bf16) between pipeline devices ``a`` and ``b``.

        Pipeline ranks are tp*dp apart in Megatron's rank order; the message crosses the
        inter-node network when the two ranks sit in different nodes, else NVLink.
        """
        nbytes = 2.0 * layout.micro_batch * model.seq_length * model.hidden / layout.tp
        span, per_node = layout.tp * layout.dp, self.gpu.gpus_per_node
        crossing = (a * span) // per_node != (b * span) // per_node
        bandwidth = self.gpu.internode_bandwidth if crossing else self.gpu.nvlink_bandwidth
        return P2P_LATENCY + nbytes / (bandwidth * self.bandwidth_efficiency)

    def params_per_gpu(self, model: GPTModel, layout: Layout) -> float:
        return model.total_params / (layout.tp * layout.pp)

    def _dp_sync(self, model: GPTModel, layout: Layout) -> float:
        params = self.params_per_gpu(model, layout)
        # fp32 gradient reduce (Megatron's main_grad) and, with the distributed optimizer,
        # a bf16 all-gather of the updated parameters; otherwise a fp32 all-reduce (2x a reduce-scatter).
        nbytes = params * (4 + 2) if self.distributed_optimizer else params * 8
        return self._ring(nbytes, layout.dp, self._bandwidth(layout.tp * layout.dp))

    def _optimizer(self, model: GPTModel, layout: Layout) -> float:
        shard = layout.dp if self.distributed_optimizer else 1
        params = self.params_per_gpu(model, layout) / shard
        # read grad (4) + master/m/v read+write (24) + bf16 param write (2) bytes per parameter
        return self._streaming(params * 30)


def calibrate_efficiency(gpu: GPU, model: GPTModel, micro_batch: int, f_seconds: float, layers: int = 1,
                         flash_attention: bool = False, hbm_efficiency: float = HBM_EFFICIENCY) -> float:
    """Achievable fraction of peak for the GEMMs implied by a measured F pass over ``layers`` layers
    (no TP): the measured time less what the memory-bound kernels take at ``hbm_efficiency``."""
    if f_seconds <= 0:
        raise ValueError("--calibrate-f-ms: the measured F time must be > 0")
    streaming = layers * model.elementwise_bytes(micro_batch, flash_attention)[0] / (gpu.hbm_bandwidth * hbm_efficiency)
    flops = model.layer_flops(micro_batch)[0] * layers
    gemm_seconds = f_seconds - streaming
    efficiency = flops / (gemm_seconds * gpu.peak_flops) if gemm_seconds > 0 else float("inf")
    if efficiency > 1:
        raise ValueError(
            f"--calibrate-f-ms: {f_seconds * 1e3:.2f} ms for {layers} layer(s) leaves "
            f"{max(gemm_seconds, 0) * 1e3:.2f} ms for the GEMMs after {streaming * 1e3:.2f} ms of memory-bound "
            "kernels, above the peak FLOP/s; check --calibrate-layers and the microbatch size"
        )
    return efficiency
