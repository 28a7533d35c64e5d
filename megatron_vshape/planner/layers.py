"""Per-token costs of one layer (or one HybridModel pattern symbol): FLOPs, parameters, bytes.

Every number is per token of one sequence of length ``s`` and follows Megatron-LM 0.19's own
accounting (``num_floating_point_operations`` in megatron/training/training.py, and
``theoretical_memory_usage.py``), generalised where Megatron's simplified formulas assume
``q = h`` (activations):

* A linear layer ``n -> m`` costs ``2 n m`` FLOPs per token forward (an FMA is 2 FLOPs); its
  input gradient (B) and weight gradient (W) cost as much again each. Core attention (``QK^T``,
  ``PV``) costs ``4 s q`` forward per token, halved when the causal mask is counted as Megatron
  >= 0.13 does (``causal``); its backward (B only, no weights) costs twice the forward.
* Megatron counts no FLOPs for norms, the router GEMM, RoPE or softmax; neither does this.
* Activation bytes (bf16 = 2, masks 1) follow Korthikanti et al. (arXiv 2205.05198, Table 2),
  whose ``34 h + 5 a s`` per token is the ``q = h``, FFN = 4h case of the counts below.

Symbols are HybridModel's (``--hybrid-layer-pattern``): ``*`` attention, ``-`` dense MLP,
``E`` MoE, ``M`` Mamba-2, ``G`` Gated DeltaNet. A GPT layer is ``*`` plus ``-`` (or ``E``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """The model dimensions the layer formulas need (Megatron's flag names in the comments)."""

    hidden: int  # --hidden-size
    heads: int  # --num-attention-heads
    seq_length: int  # --seq-length
    ffn_hidden: int  # --ffn-hidden-size
    query_groups: int  # --num-query-groups (= heads without --group-query-attention)
    kv_channels: int  # --kv-channels
    swiglu: bool = False  # --swiglu
    bias: bool = True  # not --disable-bias-linear
    norm_params: int = 2  # per hidden unit: LayerNorm 2 (weight, bias), RMSNorm 1
    num_experts: int = 0  # --num-experts
    moe_topk: int = 2  # --moe-router-topk
    moe_ffn_hidden: int = 0  # --moe-ffn-hidden-size
    moe_shared_ffn: int = 0  # --moe-shared-expert-intermediate-size
    causal: bool = False  # Megatron 0.19 halves the s^2 term for the causal mask
    mamba_state: int = 128  # --mamba-state-dim
    mamba_head_dim: int = 64  # --mamba-head-dim
    mamba_groups: int = 8  # --mamba-num-groups
    mamba_heads: int = 0  # --mamba-num-heads (0: 2h / head_dim)
    mamba_chunk: int = 128  # SSD chunk length (mamba_ssm's default)

    @property
    def q(self) -> int:
        return self.kv_channels * self.heads

    @property
    def kv(self) -> int:
        return self.kv_channels * self.query_groups

    @property
    def gate(self) -> int:
        """FFN input projections: SwiGLU's fc1 is two (gate and up), GeLU's one."""
        return 2 if self.swiglu else 1


@dataclass(frozen=True)
class LayerCost:
    """One layer's per-token costs. FLOPs are the forward's; see the module docstring for B and W."""

    symbol: str
    linear_flops: float  # GEMMs with weights (B and W each cost as much)
    core_flops: float  # per token: no weights (attention, scan); B costs twice this, W nothing
    dense_params: float  # parameters every TP rank holds a 1/TP share of
    expert_params: float  # routed-expert parameters (sharded over EP x TP)
    act_bytes: float  # stored activations with flash attention
    score_bytes: float  # extra without flash attention: 5 a s (the s x s scores)
    mask_bytes: float  # part of act_bytes only B needs (dropout masks); the rest W also reads
    stream_f: float  # HBM bytes of F's memory-bound kernels (flash attention)
    stream_b: float
    collectives: int  # sequence-parallel all-gathers + reduce-scatters in F (B the same)
    attention: bool = False  # CP exchanges K and V here
    a2a_tokens: float = 0.0  # tokens' worth of hidden states each EP all-to-all moves (top-k copies)
    transient_bytes: float = 0.0  # alive only inside the backward (recomputed Mamba chunk states)
    selective_core: bool = False  # --recompute-granularity selective recomputes this (core_attn)
    core_stream: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # flash F, B; unfused F, B


def attention(sh: Shape) -> LayerCost:
    h, q, kv = sh.hidden, sh.q, sh.kv
    linear = 2.0 * (h * (q + 2 * kv) + q * h)
    core = (2.0 if sh.causal else 4.0) * sh.seq_length * q
    params = h * (q + 2 * kv) + q * h + (q + 2 * kv + h if sh.bias else 0) + sh.norm_params * h
    # Korthikanti's 11h: QKV input 2h, Q and K 4h, V 2h (kept for PV), the projection's input 2h,
    # dropout mask h; with GQA that is 3h + 4q + 4kv. Plus the norm's input 2h.
    act = 3 * h + 4 * q + 4 * kv + 2 * h
    scores = 5.0 * sh.heads * sh.seq_length
    # F: norm (4h), bias-dropout-add (7h). B: norm (6h), dropout (5h), residual sum (6h).
    # Core attention: flash reads Q, K, V and writes O (F), reads Q, K, V, O, dO and writes dQ, dK, dV
    # (B); unfused, the a x s scores per token: 13 a s (F) and 19 a s (B), see GPTModel.elementwise_bytes.
    flash = (4.0 * q + 4.0 * kv, 8.0 * q + 8.0 * kv)
    unfused = (13.0 * sh.heads * sh.seq_length, 19.0 * sh.heads * sh.seq_length)
    return LayerCost("*", linear, core, params, 0.0, act, scores, h, 11 * h, 17 * h, 2, attention=True,
                     selective_core=True, core_stream=(*flash, *unfused))


def _ffn(sh: Shape, ffn: int) -> tuple[float, float, float, float, float]:
    """(linear FLOPs, params without bias, act bytes, stream F, stream B) of one FFN of width ``ffn``."""
    h, g = sh.hidden, sh.gate
    linear = 2.0 * h * ffn * (g + 1)
    params = h * ffn * (g + 1)
    act = 2 * h + 2 * ffn * g + 2 * ffn  # fc1 input, activation input, fc2 input
    stream_f = 6 * ffn if sh.swiglu else 4 * ffn  # GeLU reads and writes ffn; SwiGLU reads 2 ffn, writes 1
    stream_b = 10 * ffn if sh.swiglu else 6 * ffn
    return linear, params, act, stream_f, stream_b


def mlp(sh: Shape) -> LayerCost:
    h = sh.hidden
    linear, params, act, sf, sb = _ffn(sh, sh.ffn_hidden)
    params += (sh.ffn_hidden * sh.gate + h if sh.bias else 0) + sh.norm_params * h
    act += 2 * h + h  # norm input, dropout mask
    return LayerCost("-", linear, 0.0, params, 0.0, act, 0.0, h, 4 * h + 7 * h + sf, 6 * h + 11 * h + sb, 2)


def moe(sh: Shape) -> LayerCost:
    """Routed experts (top-k of ``num_experts``) plus an optional shared expert, as Megatron counts them."""
    h, k = sh.hidden, sh.moe_topk
    r_linear, r_params, r_act, r_sf, r_sb = _ffn(sh, sh.moe_ffn_hidden)
    s_linear, s_params, s_act, s_sf, s_sb = _ffn(sh, sh.moe_shared_ffn) if sh.moe_shared_ffn else (0,) * 5
    expert_params = sh.num_experts * (r_params + (sh.moe_ffn_hidden * sh.gate + h if sh.bias else 0))
    dense = h * sh.num_experts + s_params + sh.norm_params * h  # router, shared expert, norm
    # per token: k dispatched copies through an expert; router logits (fp32) and probabilities
    act = k * r_act + s_act + 2 * h + h + 8 * sh.num_experts
    permute = 4 * h * k  # the dispatcher's permutation reads and writes k copies
    stream_f = 4 * h + 7 * h + k * r_sf + s_sf + permute
    stream_b = 6 * h + 11 * h + k * r_sb + s_sb + permute
    return LayerCost("E", k * r_linear + s_linear, 0.0, dense, expert_params, act, 0.0, h, stream_f, stream_b, 2,
                     a2a_tokens=float(k))


def mamba(sh: Shape) -> LayerCost:
    """Mamba-2 (SSD): Megatron's ``mamba_layer_flops`` (in_proj, a 7 d N scan, out_proj), expand 2."""
    h, n, g = sh.hidden, sh.mamba_state, sh.mamba_groups
    d_in = 2 * h
    nheads = sh.mamba_heads or d_in // sh.mamba_head_dim
    in_out = 2 * d_in + 2 * g * n + nheads
    linear = 2.0 * h * in_out + 2.0 * d_in * h
    scan = 7.0 * d_in * n
    conv_dim = d_in + 2 * g * n
    params = h * in_out + 4 * conv_dim + conv_dim + 3 * nheads + d_in + d_in * h + sh.norm_params * h
    # stored: norm input, in_proj input, conv input and output (x, B, C), z, dt and dA_cumsum (fp32),
    # the scan output, the gated norm's input and out_proj's input
    act = 2 * h + 2 * h + 4 * conv_dim + 2 * d_in + 8 * nheads + 2 * d_in + 2 * d_in + 2 * d_in
    # The SSD backward recomputes the per-chunk states (fp32, nheads x head_dim x N each chunk):
    # the layer's state memory, alive only while its backward runs.
    head_dim = d_in // nheads
    states = 4.0 * nheads * head_dim * n / sh.mamba_chunk  # per token
    stream_f = 4 * h + 7 * h + 4 * conv_dim + 6 * d_in
    stream_b = 6 * h + 11 * h + 8 * conv_dim + 12 * d_in
    return LayerCost("M", linear, scan, params, 0.0, act, 0.0, h, stream_f, stream_b, 2, transient_bytes=states)


def gated_delta_net(sh: Shape, qk_head_dim: int = 128, v_head_dim: int = 128, qk_heads: int = 16,
                    v_heads: int = 32, conv_kernel: int = 4) -> LayerCost:
    """Gated DeltaNet with Megatron's defaults (``gdn_layer_flops``); the recurrence counted as core."""
    h = sh.hidden
    qk, v = qk_head_dim * qk_heads, v_head_dim * v_heads
    linear = 2.0 * (h * (2 * qk + 2 * v + 2 * v_heads) + h * v)
    core = 2.0 * (conv_kernel * (2 * qk + v) + v_heads * v_head_dim**2 * 4)
    params = h * (2 * qk + 2 * v + 2 * v_heads) + conv_kernel * (2 * qk + v) + v * h + sh.norm_params * h
    act = 2 * h + 2 * h + 4 * (2 * qk + v) + 2 * v + 2 * v + h
    return LayerCost("G", linear, core, params, 0.0, act, 0.0, h, 11 * h + 6 * (qk + v), 17 * h + 12 * (qk + v), 2)


BUILDERS = {"*": attention, "-": mlp, "E": moe, "M": mamba, "G": gated_delta_net}
SYMBOLS = "".join(BUILDERS)


def combine(symbol: str, parts: list[LayerCost]) -> LayerCost:
    """One pipeline layer made of several sublayers (a GPT layer: attention then MLP or MoE)."""
    total = {name: sum(getattr(p, name) for p in parts) for name in (
        "linear_flops", "core_flops", "dense_params", "expert_params", "act_bytes", "score_bytes", "mask_bytes",
        "stream_f", "stream_b", "collectives", "a2a_tokens")}
    total["core_stream"] = tuple(sum(p.core_stream[i] for p in parts) for i in range(4))
    return LayerCost(symbol, attention=any(p.attention for p in parts),
                     transient_bytes=max(p.transient_bytes for p in parts),
                     selective_core=any(p.selective_core for p in parts), **total)
