"""A parallel layout: how GPUs split into DP x TP x PP x CP (EP inside DP x CP), how the batch splits
into microbatches, and which recomputation mode runs (Megatron's --recompute-granularity)."""

from __future__ import annotations

from dataclasses import dataclass

from .model import GPTModel


@dataclass(frozen=True)
class ParallelLayout:
    dp: int
    tp: int
    pp: int
    micro_batch: int
    global_batch: int
    cp: int = 1  # --context-parallel-size: splits every sequence
    ep: int = 1  # --expert-model-parallel-size: splits the experts over DP x CP ranks
    recompute: str = "none"  # none | selective (core attention) | full (every layer, uniform)

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def token_split(self) -> int:
        """Ranks that share one microbatch's tokens: TP (sequence parallelism) x CP."""
        return self.tp * self.cp

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    def __str__(self) -> str:
        extra = (f" CP{self.cp}" if self.cp > 1 else "") + (f" EP{self.ep}" if self.ep > 1 else "")
        mode = "" if self.recompute == "none" else f" rc:{self.recompute}"
        return f"DP{self.dp} TP{self.tp} PP{self.pp}{extra} mb{self.micro_batch} x{self.num_microbatches}{mode}"

    def problem(self, model: GPTModel, num_stages: int) -> str | None:
        """Why this layout cannot run ``model`` with ``num_stages`` pipeline stages (None if it can)."""
        if self.global_batch % (self.dp * self.micro_batch):
            return (f"--global-batch {self.global_batch} is not divisible by DP {self.dp} x "
                    f"microbatch {self.micro_batch}")
        if model.heads % self.tp or model.hidden % self.tp or model.groups % self.tp:
            return (f"TP {self.tp} must divide --heads {model.heads}, --hidden {model.hidden} and the "
                    f"{model.groups} query groups")
        if self.cp > 1 and model.seq_length % (2 * self.cp):
            return f"CP {self.cp}: --seq-length {model.seq_length} must be divisible by 2 x CP"
        if self.ep > 1 and (not model.num_experts or model.num_experts % self.ep or (self.dp * self.cp) % self.ep):
            return f"EP {self.ep} must divide --num-experts {model.num_experts} and DP x CP = {self.dp * self.cp}"
        if model.segments and len(model.segments) != num_stages:
            return (f"--hybrid-layer-pattern has {len(model.segments)} '|' segments; the schedule needs "
                    f"{num_stages} stages")
        if model.layers < num_stages - 2:
            return (f"{model.layers} layers cannot fill the {num_stages - 2} middle stages of {num_stages}; "
                    "use fewer pipeline devices")
        return None

    def uses_slots(self, model: GPTModel, num_stages: int) -> bool:
        """The paper's cost model: its layer, and layers + 2 dividing the stages (the embedding and the
        head each take one layer's slot). Every other case is costed per stage with an uneven layout."""
        return model.paper_shape and not model.segments and (model.layers + 2) % num_stages == 0


def stage_layers(model: GPTModel, num_stages: int) -> list[int]:
    """Transformer layers per stage: the embedding and the head each take one layer's slot.

    This is how the paper sizes its models (layers + 2 divisible by the stage count): the first
    and the last stage hold one transformer layer fewer than the others.
    """
    per_stage = (model.layers + 2) // num_stages
    layers = [per_stage] * num_stages
    layers[0] -= 1
    layers[-1] -= 1
    return layers
