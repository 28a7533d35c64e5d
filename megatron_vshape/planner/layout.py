"""A parallel layout: how GPUs split into DP x TP x PP and how the batch splits into microbatches."""

from __future__ import annotations

from dataclasses import dataclass

from .model import GPTModel


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    micro_batch: int
    global_batch: int

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    def __str__(self) -> str:
        return f"DP{self.dp} TP{self.tp} PP{self.pp} mb{self.micro_batch} x{self.num_microbatches}"

    def problem(self, model: GPTModel, num_stages: int) -> str | None:
        """Why this layout cannot run ``model`` with ``num_stages`` pipeline stages (None if it can)."""
        if self.global_batch % (self.dp * self.micro_batch):
            return (f"--global-batch {self.global_batch} is not divisible by DP {self.dp} x "
                    f"microbatch {self.micro_batch}")
        if model.heads % self.tp or model.hidden % self.tp:
            return f"TP {self.tp} must divide --heads {model.heads} and --hidden {model.hidden}"
        if (model.layers + 2) % num_stages:
            return (f"{num_stages} stages must divide layers + 2 = {model.layers + 2} "
                    "(embedding and head each count as one layer, as the paper balances them)")
        return None


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
