"""Building megatron-core model chunks for a schedule's placement (looped or V).

Megatron numbers pipeline stages *looped*: stage ``s`` lives on pipeline rank ``s % d`` as virtual
stage ``s // d``, and it derives a chunk's layer offset from (pipeline rank, vp_stage). The V
placement puts stage ``2d-1-i`` on rank ``i`` instead. That stage is exactly the looped stage
(rank ``d-1-i``, vp_stage 1), so we build V chunk 1 of rank ``i`` as megatron would build the looped
chunk of rank ``d-1-i``: the chunk gets a :class:`ProcessGroupCollection` whose ``pp`` member is a
read-only :class:`PipelineRankView` reporting that rank. Megatron's TransformerBlock asks
``pg_collection.pp.rank()`` for the layer offset, so layer numbers (and therefore global parameter
names and checkpoint keys) come out right without touching megatron. ``pre_process`` and
``post_process`` are passed explicitly (rank 0 holds both the first and the last stage on a V).
Uneven layers per stage (``--pipeline-layout``) go through the config's
``pipeline_model_parallel_layout`` instead; :mod:`.layer_layout` makes megatron's layout answer for
the same looped (rank, vp_stage) of each V chunk.

Tied embeddings on a V live on rank 0 (chunk 0 has the embedding, chunk 1 the output layer): the
chunks get no embedding group, :func:`tie_output_to_embedding` copies the initial weight locally and
:func:`sum_tied_embedding_grads` adds the two local gradients before the data-parallel reduction (the
sum commutes with it), which is what megatron's embedding-group all-reduce does across ranks on a
looped placement.

Usage::

    chunks = build_model_chunks(placement, pp_rank, lambda spec, pgs: GPTModel(
        config, layer_spec, vocab, seq, pre_process=spec.pre_process,
        post_process=spec.post_process, vp_stage=spec.vp_stage, pg_collection=pgs))
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_vshape.schedules.core.schedule import Placement, PlacementKind


@dataclass(frozen=True)
class ChunkSpec:
    """What one model chunk of one pipeline rank holds."""

    stage: int  # global stage index of the chunk
    chunk: int  # index among the rank's chunks (megatron model chunk / vp_stage)
    num_stages: int
    looped_rank: int  # the pipeline rank megatron's looped numbering assigns to this stage
    looped_vp_stage: int | None  # None when there is one chunk per rank (no virtual pipeline)

    @property
    def pre_process(self) -> bool:
        return self.stage == 0

    @property
    def post_process(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def vp_stage(self) -> int | None:
        """The ``vp_stage`` to pass to the model (and to megatron's forward_step)."""
        return self.looped_vp_stage


def chunk_specs(placement: Placement, pp_rank: int) -> list[ChunkSpec]:
    """The chunks of pipeline rank ``pp_rank`` in local (model list) order."""
    d, stages = placement.num_devices, placement.stages_per_device[pp_rank]
    single = placement.chunks_per_device == 1
    specs = []
    for chunk, stage in enumerate(stages):
        specs.append(ChunkSpec(
            stage=stage, chunk=chunk, num_stages=placement.num_stages,
            looped_rank=stage % d, looped_vp_stage=None if single else stage // d,
        ))
    return specs


class PipelineRankView:
    """Read-only stand-in for the pipeline group that answers a chosen rank.

    Used only while building a V chunk (megatron reads ``rank()``/``size()`` for layer offsets and
    first/last-stage predicates); any collective on it fails loudly instead of miscommunicating.
    """

    def __init__(self, group, rank: int):
        self._group, self._rank = group, rank

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._group.size()

    def __getattr__(self, name):
        raise AttributeError(
            f"PipelineRankView only answers rank()/size(); '{name}' needs the real pipeline group"
        )


class LocalGroup:
    """A one-rank "group": megatron skips an embedding all-reduce over a group of size 1.

    Passed as ``pg_collection.embd`` on a V, where both tied copies live on rank 0. (``None`` would
    not do: megatron's finalize then falls back to parallel_state's cross-rank embedding group.)
    """

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def chunk_pg_collection(spec: ChunkSpec, placement: Placement, base=None):
    """The process groups to build ``spec``'s chunk with (``base`` defaults to parallel_state's)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = base if base is not None else ProcessGroupCollection.use_mpu_process_groups()
    if placement.kind is not PlacementKind.V:
        return pgs
    pgs = copy.copy(pgs)
    if spec.looped_rank != pgs.pp.rank():
        # Only a chunk megatron would place on another rank needs the view. Chunk 0 keeps the real
        # group: megatron.training reads model[0]'s groups for its own collectives after the pass
        # (MoE metrics all-reduce over pg_collection.pp), and those need a real process group.
        pgs.pp = PipelineRankView(pgs.pp, spec.looped_rank)
    pgs.embd = None  # embedding and output layer share rank 0: tied locally, no group needed
    return pgs


def build_model_chunks(
    placement: Placement, pp_rank: int, build_chunk: Callable[[ChunkSpec, object], torch.nn.Module],
    pg_collection=None,
) -> list[torch.nn.Module]:
    """Build this rank's chunks; ``build_chunk(spec, pg_collection)`` makes one megatron module.

    The caller's TransformerConfig must have ``pipeline_model_parallel_size == d`` and
    ``virtual_pipeline_model_parallel_size`` equal to the chunks per rank (None for one chunk).
    """
    chunks = [build_chunk(spec, chunk_pg_collection(spec, placement, pg_collection))
              for spec in chunk_specs(placement, pp_rank)]
    if placement.kind is PlacementKind.V:
        tie_output_to_embedding(chunks)
    return chunks


def _unwrap(module):
    """The model inside megatron's wrappers (DDP, Float16Module: each keeps the wrapped one as ``.module``)."""
    while hasattr(module, "module"):
        module = module.module
    return module


def tied_embedding_pair(chunks) -> tuple[torch.nn.Parameter, torch.nn.Parameter] | None:
    """(embedding weight, output weight) when both live in ``chunks`` as separate tied copies."""
    models = [_unwrap(c) for c in chunks]
    first = next((m for m in models if getattr(m, "pre_process", False)), None)
    last = next((m for m in models if getattr(m, "post_process", False)), None)
    if first is None or last is None or first is last:
        return None
    if not getattr(last, "share_embeddings_and_output_weights", False):
        return None
    return first.embedding.word_embeddings.weight, last.output_layer.weight


def tie_output_to_embedding(chunks) -> None:
    """Give the output layer the embedding's initial weight (both on this rank)."""
    pair = tied_embedding_pair(chunks)
    if pair is not None:
        with torch.no_grad():
            pair[1].copy_(pair[0])


def sum_tied_embedding_grads(chunks) -> None:
    """Make both tied copies carry the sum of their gradients (keeps them identical after a step)."""
    pair = tied_embedding_pair(chunks)
    if pair is None:
        return
    grads = [_grad_of(p) for p in pair]
    if any(g is None for g in grads):
        return
    total = grads[0] + grads[1]
    for g in grads:
        g.copy_(total)


def _grad_of(param: torch.nn.Parameter):
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad
