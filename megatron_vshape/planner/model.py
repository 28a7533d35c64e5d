"""GPT shapes: parameter counts, FLOPs split into F / B / W passes, activation bytes.

FLOPs follow Megatron-LM's ``num_floating_point_operations`` (no GQA, no SwiGLU, FFN = 4h):
a layer's forward over ``t = b*s`` tokens costs ``24*t*h^2`` in GEMMs plus ``4*t*s*h`` in
attention (QK^T and AV, counted in full as Megatron does), and the output head ``2*t*h*V``.
The backward splits into B (input gradients: the GEMMs' data-gradients ``24*t*h^2`` plus the
attention backward ``8*t*s*h``, which has no weights) and W (the GEMMs' weight-gradients
``24*t*h^2``). So F + B + W = 3x the forward, Megatron's 72*B*s*L*h^2*(1 + s/6h + V/12hL).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPTModel:
    name: str
    layers: int
    hidden: int
    heads: int
    seq_length: int
    vocab: int = 51200

    def __post_init__(self):
        for field_name in ("layers", "hidden", "heads", "seq_length", "vocab"):
            if getattr(self, field_name) <= 0:
                raise ValueError(f"--{field_name.replace('_', '-')}: must be a positive integer")
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} must be divisible by --heads {self.heads}")

    def with_seq(self, seq_length: int) -> GPTModel:
        return GPTModel(self.name, self.layers, self.hidden, self.heads, seq_length, self.vocab)

    # ---- parameters -------------------------------------------------------------------------
    @property
    def layer_params(self) -> int:
        h = self.hidden
        return 12 * h * h + 13 * h  # QKV + proj + 2 FFN GEMMs, their biases, two layer norms

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden + self.seq_length * self.hidden  # word + learned positions

    @property
    def head_params(self) -> int:
        # Untied output layer: the V placement keeps embedding and head on device 0, and the
        # authors' code does not support tying them there, so count both.
        return self.vocab * self.hidden + 2 * self.hidden  # + final layer norm

    @property
    def total_params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params + self.head_params

    # ---- FLOPs (per microbatch of b sequences) ----------------------------------------------
    def _gemm_flops(self, micro_batch: int) -> float:
        return 24.0 * micro_batch * self.seq_length * self.hidden**2

    def _attention_flops(self, micro_batch: int) -> float:
        return 4.0 * micro_batch * self.seq_length**2 * self.hidden

    def layer_flops(self, micro_batch: int) -> tuple[float, float, float]:
        """(F, B, W) FLOPs of one transformer layer for one microbatch."""
        gemm, attention = self._gemm_flops(micro_batch), self._attention_flops(micro_batch)
        return gemm + attention, gemm + 2 * attention, gemm

    def elementwise_bytes(self, micro_batch: int, flash_attention: bool) -> tuple[float, float]:
        """HBM bytes moved by one layer's memory-bound kernels in F and in B, one microbatch (TP 1).

        Counted per token from Megatron's GPT layer (bf16 = 2 bytes, masks 1 byte), reads plus writes:

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
        h, a, s = self.hidden, self.heads, self.seq_length
        attention_f, attention_b = (8 * h, 16 * h) if flash_attention else (13 * a * s, 19 * a * s)
        tokens = micro_batch * s
        return (38 * h + attention_f) * tokens, (58 * h + attention_b) * tokens

    def head_flops(self, micro_batch: int) -> float:
        """Forward FLOPs of the output projection (logits)."""
        return 2.0 * micro_batch * self.seq_length * self.hidden * self.vocab

    def model_flops(self, global_batch: int) -> float:
        """Megatron's per-iteration model FLOPs (no recomputation counted): the MFU numerator."""
        forward = self.layers * self.layer_flops(1)[0] + self.head_flops(1)
        return 3.0 * forward * global_batch

    # ---- activation memory (bytes per transformer layer per microbatch) ----------------------
    def activation_bytes(self, micro_batch: int, tp: int, flash_attention: bool) -> float:
        """Stored activations of one layer (Korthikanti et al.: s*b*(34h + 5as) bytes, bf16).

        With sequence parallelism every term is split over the TP ranks. Flash attention stores
        no s x s score matrices, which removes the 5as term.
        """
        per_token = 34 * self.hidden + (0 if flash_attention else 5 * self.heads * self.seq_length)
        return per_token * micro_batch * self.seq_length / tp

    def w_held_fraction(self, flash_attention: bool) -> float:
        """Part of a layer's activations only W needs (the GEMM inputs, 32h of 34h+5as per token)."""
        per_token = 34 * self.hidden + (0 if flash_attention else 5 * self.heads * self.seq_length)
        return 32 * self.hidden / per_token

    def input_bytes(self, micro_batch: int, tp: int) -> float:
        """A layer's bf16 input: all that full recomputation keeps (sequence-parallel split)."""
        return 2.0 * micro_batch * self.seq_length * self.hidden / tp

    def logits_bytes(self, micro_batch: int, tp: int) -> float:
        """The fp32 logits the loss keeps for its backward (vocabulary-parallel split)."""
        return 4.0 * micro_batch * self.seq_length * self.vocab / tp


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
