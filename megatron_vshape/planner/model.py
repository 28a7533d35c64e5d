"""GPT and HybridModel shapes: parameter counts, FLOPs split into F / B / W passes, activation bytes.

Per-layer costs come from :mod:`.layers` and follow Megatron-LM's ``num_floating_point_operations``.
For the paper's layer (no GQA, no SwiGLU, FFN = 4h) a layer's forward over ``t = b*s`` tokens costs
``24*t*h^2`` in GEMMs plus ``4*t*s*h`` in attention (QK^T and AV, counted in full as Megatron did
before 0.13; ``causal=True`` halves it as Megatron 0.19 does), and the output head ``2*t*h*V``.
The backward splits into B (input gradients: the GEMMs' data-gradients ``24*t*h^2`` plus the
attention backward ``8*t*s*h``, which has no weights) and W (the GEMMs' weight-gradients
``24*t*h^2``). So F + B + W = 3x the forward, Megatron's 72*B*s*L*h^2*(1 + s/6h + V/12hL).
GQA, SwiGLU, MoE (routed top-k plus shared experts) and HybridModel pattern symbols change the
per-layer terms (see :mod:`.layers`); a model whose layers differ (a pattern, ``--moe-layer-freq``)
has per-layer weights (:meth:`GPTModel.layer_weights`) that the per-stage costs sum.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from ..vocab_shards import padded_vocab_size
from .layers import BUILDERS, SYMBOLS, LayerCost, Shape, attention, combine, mlp, moe


@dataclass(frozen=True)
class GPTModel:
    """A GPT (or HybridModel) shape. The fields after ``vocab`` are Megatron's flags; their defaults
    are the paper's GPT-3-style layer (MHA, FFN 4h, GeLU, biases, LayerNorm, learned positions)."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq_length: int
    vocab: int = 51200
    ffn_hidden: int | None = None  # --ffn-hidden-size (default 4h)
    query_groups: int | None = None  # --num-query-groups with --group-query-attention (default: heads)
    kv_channels: int | None = None  # --kv-channels (default h / heads)
    swiglu: bool = False
    bias: bool = True  # False: --disable-bias-linear
    rmsnorm: bool = False  # --normalization RMSNorm
    learned_positions: bool = True  # False: --position-embedding-type rope / none
    num_experts: int = 0  # --num-experts (0: dense)
    moe_topk: int = 2
    moe_ffn_hidden: int | None = None  # default --ffn-hidden-size
    moe_shared_ffn: int = 0
    moe_layer_freq: int = 1  # every n-th layer is MoE (Megatron's int form of --moe-layer-freq)
    causal: bool = False  # count causal attention at half, as Megatron 0.19's num_floating_point_operations
    pattern: str | None = None  # --hybrid-layer-pattern without '|': one symbol per layer
    segments: tuple[int, ...] = ()  # layers per '|'-separated segment of the pattern (its own stages)
    mamba_state: int = 128
    mamba_head_dim: int = 64
    mamba_groups: int = 8
    mamba_heads: int = 0
    make_vocab_divisible_by: int = 1  # Megatron pads the vocabulary to a multiple of this (its default: 128)
    tied_embeddings: bool = True  # False: --untie-embeddings-and-output-weights (Megatron ties them by default)

    def __post_init__(self):
        for field_name in ("layers", "hidden", "heads", "seq_length", "vocab"):
            if getattr(self, field_name) <= 0:
                raise ValueError(f"--{field_name.replace('_', '-')}: must be a positive integer")
        if self.hidden % self.heads and self.kv_channels is None:
            raise ValueError(f"--hidden {self.hidden} must be divisible by --heads {self.heads}")
        if self.heads % self.groups:
            raise ValueError(f"--num-query-groups {self.groups} must divide --num-attention-heads {self.heads}")
        if self.pattern is not None:
            bad = sorted(set(self.pattern) - set(SYMBOLS))
            if bad:
                raise ValueError(f"--hybrid-layer-pattern: the planner has no cost model for {bad[0]!r}; "
                                 f"it models {', '.join(SYMBOLS)}")
            if len(self.pattern) != self.layers:
                raise ValueError(f"--hybrid-layer-pattern has {len(self.pattern)} layers, --num-layers {self.layers}")
            if "E" in self.pattern and not self.num_experts:
                raise ValueError("--hybrid-layer-pattern has MoE layers (E): give --num-experts")
        if self.num_experts and not 1 <= self.moe_topk <= self.num_experts:
            raise ValueError(f"--moe-router-topk {self.moe_topk} must be in [1, --num-experts {self.num_experts}]")

    def with_seq(self, seq_length: int) -> GPTModel:
        return replace(self, seq_length=seq_length)

    # ---- shape -----------------------------------------------------------------------------
    @property
    def groups(self) -> int:
        return self.query_groups or self.heads

    @property
    def paper_shape(self) -> bool:
        """The paper's layer (all defaults): the search keeps its "embedding and head take a layer's
        slot" model for it, which the paper's tables were reproduced with."""
        return self == GPTModel(self.name, self.layers, self.hidden, self.heads, self.seq_length, self.vocab)

    @property
    def padded_vocab(self) -> int:
        """Megatron's ``_vocab_size_with_padding`` at TP 1 (a multiple of --make-vocab-size-divisible-by)."""
        return self.padded_vocab_at(1)

    def padded_vocab_at(self, tp: int) -> int:
        """Megatron's ``_vocab_size_with_padding`` at TP ``tp`` (a multiple of --make-vocab-size-divisible-by x TP)."""
        return padded_vocab_size(self.vocab, self.make_vocab_divisible_by, tp)

    @cached_property
    def shape(self) -> Shape:
        return Shape(self.hidden, self.heads, self.seq_length, self.ffn_hidden or 4 * self.hidden, self.groups,
                     self.kv_channels or self.hidden // self.heads, self.swiglu, self.bias,
                     1 if self.rmsnorm else 2, self.num_experts, self.moe_topk,
                     self.moe_ffn_hidden or self.ffn_hidden or 4 * self.hidden, self.moe_shared_ffn, self.causal,
                     self.mamba_state, self.mamba_head_dim, self.mamba_groups, self.mamba_heads)

    @cached_property
    def layer_costs(self) -> tuple[LayerCost, ...]:
        """Per pipeline layer: a pattern symbol, or a GPT layer (attention + MLP, or + MoE)."""
        sh = self.shape
        if self.pattern is not None:
            built = {s: BUILDERS[s](sh) for s in set(self.pattern)}
            return tuple(built[s] for s in self.pattern)
        dense = combine("*-", [attention(sh), mlp(sh)])
        if not self.num_experts:
            return (dense,) * self.layers
        sparse = combine("*E", [attention(sh), moe(sh)])
        return tuple(sparse if i % self.moe_layer_freq == 0 else dense for i in range(self.layers))

    @cached_property
    def mean_cost(self) -> LayerCost:
        n = self.layers
        total = combine("mean", list(self.layer_costs))
        fields = {k: getattr(total, k) / n for k in (
            "linear_flops", "core_flops", "dense_params", "expert_params", "act_bytes", "score_bytes", "mask_bytes",
            "stream_f", "stream_b", "a2a_tokens")}
        return replace(total, collectives=total.collectives / n, core_stream=tuple(x / n for x in total.core_stream),
                       **fields)

    # ---- parameters -------------------------------------------------------------------------
    @property
    def layer_params(self) -> float:
        """Mean parameters of one layer (all experts included)."""
        c = self.mean_cost
        return c.dense_params + c.expert_params

    def stage_params(self, start: int, count: int) -> tuple[float, float]:
        """(dense, routed-expert) parameters of layers ``start .. start + count - 1``."""
        costs = self.layer_costs[start:start + count]
        return sum(c.dense_params for c in costs), sum(c.expert_params for c in costs)

    @property
    def embedding_params(self) -> int:
        positions = self.seq_length * self.hidden if self.learned_positions else 0
        return self.padded_vocab * self.hidden + positions

    @property
    def head_params(self) -> int:
        # The output layer is counted even when tied: with PP > 1 the last stage holds its own copy
        # (Megatron keeps the tied word embedding on both the first and the last stage).
        return self.padded_vocab * self.hidden + (1 if self.rmsnorm else 2) * self.hidden  # + final norm

    @property
    def vocab_matrix_params(self) -> int:
        """One vocabulary matrix (padded vocabulary x hidden): the word embedding, or the output layer."""
        return self.padded_vocab * self.hidden

    @property
    def vocab_layer_params(self) -> int:
        """The distinct parameters of the vocabulary layers: one matrix when the embedding and the output
        layer are tied, two when not (the shards of vocabulary parallelism hold each once)."""
        return self.vocab_matrix_params * (1 if self.tied_embeddings else 2)

    @property
    def total_params(self) -> float:
        return self.layers * self.layer_params + self.embedding_params + self.head_params

    # ---- FLOPs (per microbatch of b sequences; mean over the layers) ------------------------
    def layer_flops(self, micro_batch: int) -> tuple[float, float, float]:
        """(F, B, W) FLOPs of one (mean) layer for one microbatch."""
        c, tokens = self.mean_cost, micro_batch * self.seq_length
        gemm, core = c.linear_flops * tokens, c.core_flops * tokens
        return gemm + core, gemm + 2 * core, gemm

    def linear_share(self) -> float:
        """Part of a layer's F FLOPs in GEMMs with weights (what FP8 speeds up)."""
        c = self.mean_cost
        return c.linear_flops / (c.linear_flops + c.core_flops)

    def elementwise_bytes(self, micro_batch: int, flash_attention: bool) -> tuple[float, float]:
        """HBM bytes moved by one (mean) layer's memory-bound kernels in F and in B, one microbatch (TP 1).

        Counted per token from Megatron's GPT layer (bf16 = 2 bytes, masks 1 byte), reads plus writes
        (see :mod:`.layers` for each kernel); for the paper's layer:

        * F, 38h: two layer norms (read h, write h: 8h), two fused bias-dropout-adds (read the
          branch and the residual, write the sum and the mask: 14h), the fused bias-GeLU on the 4h
          FFN activation (read, write: 16h).
        * B, 58h: two layer-norm backwards (read dy and x, write dx: 12h), two dropout backwards
          (read dy and the mask, write dx: 10h), the two residual-gradient sums (read two, write
          one: 12h), the GeLU backward (read dy and x, write dx, on 4h: 24h).
        * Attention without flash attention materialises the a x s scores per token: F writes S
          (2as), the fused softmax reads S and writes P (4as), dropout reads P and writes P' and
          its mask (5as), the AV product reads P' (2as): 13as. B: writes dP' and reads P' for dV
          (4as), the dropout backward (5as), the softmax backward reads P and dP and writes dS
          (6as), the QK^T backward reads dS twice (4as): 19as.
        * Flash attention keeps the scores on chip: it reads Q, K, V and writes O (8h) in F, and
          reads Q, K, V, O, dO and writes dQ, dK, dV (16h) in B.

        W runs only the weight-gradient GEMMs, which are compute-bound, so it has no such term.
        """
        c, tokens = self.mean_cost, micro_batch * self.seq_length
        core_f, core_b = c.core_stream[:2] if flash_attention else c.core_stream[2:]
        return (c.stream_f + core_f) * tokens, (c.stream_b + core_b) * tokens

    def head_flops(self, micro_batch: int) -> float:
        """Forward FLOPs of the output projection (logits)."""
        return 2.0 * micro_batch * self.seq_length * self.hidden * self.padded_vocab

    def model_flops(self, global_batch: int) -> float:
        """Megatron's per-iteration model FLOPs (no recomputation counted): the MFU numerator."""
        forward = self.layers * self.layer_flops(1)[0] + self.head_flops(1)
        return 3.0 * forward * global_batch

    # ---- activation memory (bytes per layer per microbatch) ----------------------------------
    def activation_bytes(self, micro_batch: int, tp: int, flash_attention: bool) -> float:
        """Stored activations of one (mean) layer (Korthikanti et al.: s*b*(34h + 5as) bytes, bf16).

        With sequence parallelism every term is split over the TP ranks (divide by CP too for
        context parallelism). Flash attention stores no s x s score matrices: no 5as term.
        """
        c = self.mean_cost
        per_token = c.act_bytes + (0 if flash_attention else c.score_bytes)
        return per_token * micro_batch * self.seq_length / tp

    def w_held_fraction(self, flash_attention: bool) -> float:
        """Part of a layer's activations W needs (all but the dropout masks and the scores: 32h of 34h+5as)."""
        c = self.mean_cost
        per_token = c.act_bytes + (0 if flash_attention else c.score_bytes)
        return (c.act_bytes - c.mask_bytes) / per_token

    def input_bytes(self, micro_batch: int, tp: int) -> float:
        """A layer's bf16 input: all that full recomputation keeps (sequence-parallel split)."""
        return 2.0 * micro_batch * self.seq_length * self.hidden / tp

    def logits_bytes(self, micro_batch: int, tp: int) -> float:
        """The fp32 logits the loss keeps for its backward (vocabulary-parallel split)."""
        return 4.0 * micro_batch * self.seq_length * self.padded_vocab / tp

    def layer_weights(self, flash_attention: bool = True) -> tuple[tuple[float, float, float, float], ...]:
        """Per layer: (F, B, W FLOPs, activation bytes) relative to the mean layer (all 1.0 when alike)."""
        mean = self.mean_cost
        f0, b0 = mean.linear_flops + mean.core_flops, mean.linear_flops + 2 * mean.core_flops
        w0 = mean.linear_flops
        a0 = mean.act_bytes + (0 if flash_attention else mean.score_bytes)
        out = []
        for c in self.layer_costs:
            act = c.act_bytes + (0 if flash_attention else c.score_bytes)
            out.append(((c.linear_flops + c.core_flops) / f0, (c.linear_flops + 2 * c.core_flops) / b0,
                        c.linear_flops / w0 if w0 else 1.0, act / a0))
        return tuple(out)


# The paper's models (arXiv v1, Table 3). The vocabulary is not given there; 51200 (GPT-2's
# 50257 padded to a multiple of 128 * 8 TP ranks, Megatron's habit) is an assumption.
PRESETS: dict[str, GPTModel] = {
    "9.6b": GPTModel("9.6B", 30, 5120, 40, 1024),
    "21b": GPTModel("21B", 46, 6144, 48, 1024),
    "38.5b": GPTModel("38.5B", 62, 7168, 64, 1024),
    "98.5b": GPTModel("98.5B", 78, 10240, 80, 1024),
}


def get_model(name: str) -> GPTModel:
    model = PRESETS.get(name.lower().removesuffix("-gpt"))
    if model is None:
        raise ValueError(f"--model: unknown preset {name!r}; choose one of: {', '.join(PRESETS)} "
                         "or give --layers/--hidden/--heads")
    return model
