"""The plan's rows per schedule: the schedule as it is, and its variants with a flag that changes how the
pipeline runs, each searched on its own (``vshape plan`` prints one line per row):

* ``+vocab``: ``--pipeline-vocab-parallel`` (the vocabulary layers on every pipeline device, planner/vocab.py);
* ``+pairs``: ``--overlap-moe-expert-parallel-comm`` under a V schedule (overlapped F&B pairs hide the
  expert-parallel all-to-all, planner/moe_pairs.py).

The two flags do not run together (megatron/vocab_checks.py refuses the pair), so no row has both.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import moe_pairs, vocab
from .model import GPTModel


@dataclass(frozen=True)
class RowKind:
    """Which flags a row runs with."""

    vocab_parallel: bool = False
    pairs: bool = False

    def __post_init__(self):
        if self.vocab_parallel and self.pairs:
            raise ValueError(f"{vocab.FLAG} and {moe_pairs.FLAG} do not run together; drop one")

    @property
    def suffix(self) -> str:
        """The row name's suffix ("" for the schedule as it is)."""
        return vocab.LABEL if self.vocab_parallel else moe_pairs.LABEL if self.pairs else ""

    @property
    def flag(self) -> str | None:
        return vocab.FLAG if self.vocab_parallel else moe_pairs.FLAG if self.pairs else None


PLAIN, VOCAB, PAIRS = RowKind(), RowKind(vocab_parallel=True), RowKind(pairs=True)


def row_label(schedule: str, vocab_parallel: bool = False, pairs: bool = False) -> str:
    """The row's name: the schedule, with its variant's suffix ("v-zb +vocab", "v-zb +pairs")."""
    suffix = RowKind(vocab_parallel, pairs).suffix
    return f"{schedule} {suffix}" if suffix else schedule


def row_kinds(schedule: str, model: GPTModel, vocab_rows: bool = True, pair_rows: bool = True) -> tuple[RowKind, ...]:
    """The rows ``vshape plan`` searches for ``schedule``: as it is, ``+vocab`` unless ``vocab_rows`` is off, and
    ``+pairs`` for a MoE model under a pairing schedule unless ``pair_rows`` is off."""
    kinds = [PLAIN]
    if vocab_rows:
        kinds.append(VOCAB)
    if pair_rows and moe_pairs.offered(schedule, model):
        kinds.append(PAIRS)
    return tuple(kinds)
