"""Per-pass times (F, B, W per layer), communication and optimizer times for one layout.

Compute: FLOPs / (peak * efficiency) for the GEMMs (and attention), one efficiency which the user
calibrates from one measured F pass (:func:`calibrate_efficiency`), plus the bytes the memory-bound
kernels move (layer norms, dropout, GeLU, softmax: :meth:`GPTModel.elementwise_bytes`) over HBM
bandwidth * hbm_efficiency. F and B carry such kernels, W (weight-gradient GEMMs) does not, so W is
cheaper than its FLOPs alone say relative to F and B.
Communication: ring collectives, time = (n-1)/n * bytes / (bandwidth * bandwidth_efficiency).
Megatron's rank order is TP innermost, then CP, EP (inside DP), DP, then PP, 8 GPUs per node.

Beyond the paper's setting (see docs/planner.md for the derivations):

* FP8 (``fp8``): the GEMMs with weights run at the GPU's dense FP8 peak; core attention stays bf16.
* Context parallelism: every per-token term splits over CP; ring attention sends each K/V chunk
  CP - 1 times and overlaps it with the attention kernels, so only the excess is exposed.
* Expert parallelism: two all-to-alls (dispatch, combine) of the top-k token copies per MoE layer
  in F and in B; expert weights split over EP, their gradients reduce over DP x CP / EP ranks.
* Selective recomputation (Megatron's default ``core_attn``) re-runs core attention before B.
* DP gradient sync: :meth:`CostModel.dp_exposed` says how much of it the pipeline hides with
  ``--overlap-grad-reduce`` / ``--overlap-param-gather``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .hardware import GPU
from .model import GPTModel
from .parallel_layout import ParallelLayout

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
    grad_reduce: float = 0.0  # the part of dp_sync that reduces gradients (the rest gathers parameters)
    # The expert-parallel all-to-alls of one mean layer in each F and each B (dispatch and combine), already
    # inside ``f`` and ``b``: an overlapped F&B pair hides them under the other pass (planner/moe_pairs.py).
    a2a: float = 0.0

    def compute_only(self) -> PassTimes:
        """These times with the all-to-all taken out of F and B (what a pair that hides it all would pay)."""
        return replace(self, f=self.f - self.a2a, b=self.b - self.a2a, a2a=0.0)


@dataclass(frozen=True)
class CostModel:
    gpu: GPU
    efficiency: float = 0.6  # achievable fraction of peak for the GEMM-heavy passes
    bandwidth_efficiency: float = 0.7  # achievable fraction of link bandwidth for NCCL
    distributed_optimizer: bool = True
    # Megatron's own schedules (1F1B, interleaved) wait for each p2p message (exposed_p2p.py)
    blocking_p2p: bool = True
    hbm_efficiency: float = HBM_EFFICIENCY  # memory-bound kernels and the optimizer step
    fp8: bool = False  # --fp8-format: GEMMs at the FP8 peak
    overlap_grad_reduce: bool = False  # --overlap-grad-reduce
    overlap_param_gather: bool = False  # --overlap-param-gather
    grad_bytes: int = 4  # bytes per gradient element reduced over DP (2 with --grad-reduce-in-bf16)

    def __post_init__(self):
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"--efficiency {self.efficiency}: must be in (0, 1]; calibrate with --calibrate-f-ms")
        if not 0 < self.bandwidth_efficiency <= 1:
            raise ValueError(f"--bandwidth-efficiency {self.bandwidth_efficiency}: must be in (0, 1]")
        if self.fp8 and not self.gpu.fp8_flops:
            raise ValueError(f"--fp8-format: {self.gpu.name} has no FP8 tensor cores; drop it or use --gpu h100/h200/b200")

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

    @property
    def mfu_peak(self) -> float:
        """The dense peak MFU is measured against: FP8's when the GEMMs run in FP8 (against the bf16
        peak an FP8 run could pass 100 %), bf16's otherwise."""
        return self.gpu.fp8_flops if self.fp8 else self.gpu.peak_flops

    def _gemm(self, flops: float) -> float:
        return flops / (self.mfu_peak * self.efficiency)

    def _within_node(self, extent: int) -> float:
        """Bandwidth of a group spanning ``extent`` consecutive ranks (NVLink if it fits one node)."""
        return self.gpu.nvlink_bandwidth if extent <= self.gpu.gpus_per_node else self.gpu.internode_bandwidth

    def pass_times(self, model: GPTModel, layout: ParallelLayout, flash_attention: bool = False) -> PassTimes:
        """Seconds of one mean layer's F, B, W for one microbatch on one GPU, and the fixed costs."""
        tp, cp, mb = layout.tp, layout.cp, layout.micro_batch
        split = tp * cp
        f_flops, b_flops, w_flops = model.layer_flops(mb)
        # memory-bound kernels: sequence parallelism and TP split every one of them over the TP ranks
        f_bytes, b_bytes = model.elementwise_bytes(mb, flash_attention)
        # Sequence parallelism: forward = 2 all-gathers + 2 reduce-scatters of the b*s*h bf16
        # activation; B the same; W re-gathers the two GEMM inputs (Megatron does not keep them).
        tensor = 2.0 * mb * model.seq_length * model.hidden / cp
        tp_bw = self._bandwidth(1) if tp <= self.gpu.gpus_per_node else self.gpu.internode_bandwidth
        collective = self._ring(tensor, tp, tp_bw)
        per_pass = model.mean_cost.collectives  # 4 for a GPT layer (attention and MLP: 2 each)
        if self.fp8:  # only the GEMMs with weights speed up; core attention (f - w, b - w) stays bf16
            f = self._gemm(w_flops / split) + self._compute((f_flops - w_flops) / split)
            b = self._gemm(w_flops / split) + self._compute((b_flops - w_flops) / split)
            w = self._gemm(w_flops / split)
        else:
            f, b, w = self._compute(f_flops / split), self._compute(b_flops / split), self._compute(w_flops / split)
        f += self._streaming(f_bytes / split) + per_pass * collective
        b += self._streaming(b_bytes / split) + per_pass * collective
        w += per_pass / 2 * collective
        core_f = self._compute((f_flops - w_flops) / split)
        ring, a2a = self._cp_exposed(model, layout, core_f), self._ep_all_to_all(model, layout)
        f, b = f + ring[0] + a2a, b + ring[1] + a2a
        if layout.recompute == "selective":  # Megatron's default --recompute-modules core_attn
            b += core_f
        grad, gather = self._dp_parts(model, layout)
        return PassTimes(f, b, w, self._p2p(model, layout), grad + gather, self._optimizer(model, layout), grad,
                         a2a)

    def _cp_exposed(self, model: GPTModel, layout: ParallelLayout, core_f: float) -> tuple[float, float]:
        """Ring attention's K/V exchange beyond what the attention kernels hide, (F, B) per mean layer."""
        if layout.cp == 1:
            return 0.0, 0.0
        sh, share = model.shape, sum(c.attention for c in model.layer_costs) / model.layers
        chunk = 2.0 * layout.micro_batch * model.seq_length / layout.cp * 2 * sh.kv / layout.tp  # K and V, bf16
        send = (layout.cp - 1) * chunk / (self._within_node(layout.tp * layout.cp) * self.bandwidth_efficiency)
        return share * max(0.0, send - core_f), share * max(0.0, 2 * send - 2 * core_f)  # B also returns dK, dV

    def _ep_all_to_all(self, model: GPTModel, layout: ParallelLayout) -> float:
        """Dispatch + combine all-to-alls of one mean layer's MoE tokens, per pass (F or B)."""
        if layout.ep == 1:
            return 0.0
        tokens = layout.micro_batch * model.seq_length / (layout.cp * layout.tp)
        nbytes = 2.0 * tokens * model.hidden * model.mean_cost.a2a_tokens
        bandwidth = self._within_node(layout.tp * layout.cp * layout.ep)
        return 2 * self._ring(nbytes, layout.ep, bandwidth)

    def _p2p(self, model: GPTModel, layout: ParallelLayout) -> float:
        """Mean time of one activation/gradient message between neighbouring stages.

        The simulator takes one message time, and a pipeline's fill and drain pay the sum over its
        hops, so the mean over hops is the right single number.
        """
        hops = max(layout.pp - 1, 1)
        return sum(self.p2p_between(model, layout, p, p + 1) for p in range(hops)) / hops

    def p2p_between(self, model: GPTModel, layout: ParallelLayout, a: int, b: int) -> float:
        """One activation/gradient message (b*s*h/TP bf16) between pipeline devices ``a`` and ``b``.

        Pipeline ranks are tp*dp apart in Megatron's rank order; the message crosses the
        inter-node network when the two ranks sit in different nodes, else NVLink.
        """
        nbytes = 2.0 * layout.micro_batch * model.seq_length * model.hidden / (layout.tp * layout.cp)
        span, per_node = layout.tp * layout.dp, self.gpu.gpus_per_node
        crossing = (a * span) // per_node != (b * span) // per_node
        bandwidth = self.gpu.internode_bandwidth if crossing else self.gpu.nvlink_bandwidth
        return P2P_LATENCY + nbytes / (bandwidth * self.bandwidth_efficiency)

    def pipeline_group_bandwidth(self, layout: ParallelLayout) -> float:
        """Bytes/s of a ring over one pipeline group. Its ranks are TP x CP x DP apart in Megatron's rank
        order; once the group spans more than one node the ring crosses the inter-node network (twice),
        which then paces it, whatever the links between most neighbours are."""
        return self._within_node(layout.tp * layout.cp * layout.dp * layout.pp) * self.bandwidth_efficiency

    def vocab_collectives(self, model: GPTModel, layout: ParallelLayout) -> float:
        """Seconds of the pipeline group's collectives on the critical path of one vocabulary-parallel H pass
        (runtime/vocab_h.py; the table in docs/vocab_parallel.md), in issue order on the last stage's rank:

        * the final hidden state (bf16, every token: under sequence parallelism the last stage gathers it)
          and the labels (int64), one broadcast from the last stage; a ring broadcast sends the bytes in
          pipelined chunks, about bytes / bandwidth;
        * the softmax statistics (max, sum of exponentials, target logit: three fp32 per token), gathered
          from the p - 1 other ranks (the rendezvous);
        * the hidden gradient per unit loss gradient (fp32, every token), reduced onto the last stage,
          which waits for it before its B (the other ranks do not);
        * a launch latency each. The loss gradient's broadcast (4 bytes a token) is waited for only in G
          and is left out, as is the TP all-reduce of the gradient among the last stage's TP ranks.
        """
        return sum(self.vocab_collective_parts(model, layout))

    def vocab_collective_parts(self, model: GPTModel, layout: ParallelLayout) -> tuple[float, float]:
        """:meth:`vocab_collectives` as (what every rank waits for in H: the hidden state's broadcast and the
        statistics' all-gather, the rendezvous; what only the last stage's rank waits for: the reduce of the
        hidden gradient, posted on the vocabulary queue, which the other ranks leave behind)."""
        if layout.pp <= 1:
            return 0.0, 0.0
        tokens = layout.micro_batch * model.seq_length / layout.cp
        hidden = 2.0 * tokens * model.hidden + 8.0 * tokens
        statistics = 3 * 4.0 * tokens * (layout.pp - 1)
        gradient = 4.0 * tokens * model.hidden
        bandwidth = self.pipeline_group_bandwidth(layout)
        return 2 * P2P_LATENCY + (hidden + statistics) / bandwidth, P2P_LATENCY + gradient / bandwidth

    def params_per_gpu(self, model: GPTModel, layout: ParallelLayout) -> float:
        return model.total_params / (layout.tp * layout.pp)

    def _shards(self, model: GPTModel, layout: ParallelLayout) -> tuple[tuple[float, int], tuple[float, int]]:
        """((dense parameters per GPU, ranks sharing their gradients), (the same for routed experts))."""
        experts = model.layers * model.mean_cost.expert_params
        dense = (model.total_params - experts) / (layout.tp * layout.pp)
        data = layout.dp * layout.cp  # Megatron's data-parallel group with context parallelism
        return (dense, data), (experts / (layout.tp * layout.ep * layout.pp), data // layout.ep)

    def _dp_parts(self, model: GPTModel, layout: ParallelLayout) -> tuple[float, float]:
        """(gradient reduction, parameter all-gather) seconds, not overlapped.

        With the distributed optimizer: a reduce-scatter of the gradients (``grad_bytes`` each, fp32
        main_grad unless --grad-reduce-in-bf16) and a bf16 all-gather of the updated parameters;
        otherwise an all-reduce (2x a reduce-scatter) and nothing to gather."""
        grad = gather = 0.0
        for params, ranks in self._shards(model, layout):
            bandwidth = self._bandwidth(layout.tp * layout.cp * ranks)
            if self.distributed_optimizer:
                grad += self._ring(params * self.grad_bytes, ranks, bandwidth)
                gather += self._ring(params * 2, ranks, bandwidth)
            else:
                grad += self._ring(params * 2 * self.grad_bytes, ranks, bandwidth)
        return grad, gather

    def _dp_sync(self, model: GPTModel, layout: ParallelLayout) -> float:
        return sum(self._dp_parts(model, layout))

    def dp_exposed(self, model: GPTModel, layout: ParallelLayout, times: PassTimes, window: float) -> float:
        """DP sync time the iteration pays, given ``window`` seconds of backward work that run after a
        device's first gradients are final (its last microbatch's backward: B + W for a fused
        schedule, the deferred W passes for a split one, which is when a gradient is final).

        Megatron launches a bucket's reduction when its last gradient is ready (``--overlap-grad-reduce``,
        buckets of max(40M, 1M x DP) parameters), so all but the last bucket can hide in the window;
        ``--overlap-param-gather`` gathers parameters during the next forward, all but the first bucket.
        Without the flags the whole sync is exposed (the paper's setting)."""
        grad, gather = times.grad_reduce, times.dp_sync - times.grad_reduce
        if layout.dp * layout.cp == 1:
            return 0.0
        params = sum(p for p, _ in self._shards(model, layout))
        bucket = min(1.0, max(40e6, 1e6 * layout.dp * layout.cp) / max(params, 1.0))  # one bucket's share
        if self.overlap_grad_reduce:
            grad = max(grad * bucket, grad - window)
        if self.overlap_param_gather and self.distributed_optimizer:
            gather *= bucket
        return grad + gather

    def _optimizer(self, model: GPTModel, layout: ParallelLayout) -> float:
        # read grad (4) + master/m/v read+write (24) + bf16 param write (2) bytes per parameter
        if not self.distributed_optimizer:
            return self._streaming(self.params_per_gpu(model, layout) * 30)
        return self._streaming(sum(p / ranks for p, ranks in self._shards(model, layout)) * 30)


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
