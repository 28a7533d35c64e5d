"""The vocabulary's shards under ``--pipeline-vocab-parallel``: the arithmetic that training (``megatron/``,
``runtime/``) and the planner share, so that the planner offers the flag exactly where training takes it and
counts the rows each rank holds. Pure Python.

Megatron pads the vocabulary (``_vocab_size_with_padding``) and shards its rows over the TP ranks; each TP
shard is split again over the p pipeline ranks, pipeline rank s holding the s-th contiguous part.
Checkpoints need the TP x PP shards equal (:func:`splits_evenly`); the arithmetic itself allows parts one
row apart (:func:`shard_rows`).
"""

from __future__ import annotations


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary size: a multiple of ``--make-vocab-size-divisible-by`` x TP."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def shard_rows(rows: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, end)`` of part ``index`` when ``rows`` split into ``parts`` contiguous parts, the first
    ``rows % parts`` parts one row longer."""
    if not 0 <= index < parts:
        raise ValueError(f"part {index} of {parts}")
    base, extra = divmod(rows, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def shard_sizes(rows: int, parts: int) -> tuple[int, ...]:
    """The rows of each part of :func:`shard_rows`."""
    return tuple(end - start for start, end in (shard_rows(rows, parts, index) for index in range(parts)))


def splits_evenly(padded_vocab: int, tp: int, pp: int) -> bool:
    """Whether the padded vocabulary splits into ``tp * pp`` equal shards (what checkpoints need)."""
    return padded_vocab % (tp * pp) == 0
