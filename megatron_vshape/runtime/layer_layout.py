"""Uneven transformer layers per pipeline stage, through megatron-core's own layout mechanism.

``--pipeline-layout N0,N1,...`` gives one layer count per *global* stage (2d numbers on a V, in
stage order). megatron-core (0.16.1 and 0.19.2 alike) splits layers unevenly with
``TransformerConfig.pipeline_model_parallel_layout``, a :class:`PipelineParallelLayerLayout` whose
stages are numbered the looped way, ``vp_stage * d + pp_rank``. A V stage ``s`` is exactly looped
stage ``s`` (stage 2d-1-i on rank i is built as looped rank d-1-i, vp_stage 1; see
:mod:`.placement`), so the V layout *is* a looped layout in the same stage order: layer offsets,
global layer numbers, checkpoint keys and the schedule-invariant init/dropout streams come out right.

Two gaps, closed by subclasses that answer megatron's two questions (layers to build, layer
offset) from the stage table itself: megatron's layout branch drops the ``pp_rank`` it is given
(it asks ``parallel_state`` for the real rank), so the :class:`~.placement.PipelineRankView` a V
chunk is built with is not consulted; and it treats ``vp_stage`` as 0 unless ``parallel_state``
has a virtual pipeline size. :class:`VShapeLayerLayout` answers for the looped rank of the V chunk:
vp_stage 0 of rank i is looped rank i, vp_stage 1 is looped rank d-1-i. Both are stateless (no
"building" flag), so later questions (``sharded_state_dict``'s layer offsets) get the answers
construction got.
"""

from __future__ import annotations

from megatron.core import parallel_state
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

from megatron_vshape.schedules.core.schedule import Placement, PlacementKind


def layout_stages(counts) -> list[list[str]]:
    """Megatron's per-stage layer lists for ``counts``: the embedding first, the loss last."""
    stages = [["decoder"] * int(n) for n in counts]
    stages[0].insert(0, "embedding")
    stages[-1].append("loss")
    return stages


class StageLayerLayout(PipelineParallelLayerLayout):
    """megatron's layout, answering for the chunk's own ``vp_stage`` and (looped) pipeline rank.

    megatron's methods replace ``vp_stage`` by 0 when ``parallel_state`` has no virtual pipeline
    size (megatron-core users such as ``vshape verify`` need not set one) and ignore the pipeline
    view a chunk is built with; these read both from the arguments instead.
    """

    def looped_rank(self, vp_stage, pp_rank) -> int:
        return parallel_state.get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank

    def _stage(self, vp_stage, pp_rank) -> int:
        """The looped stage index (= global stage) of the asked chunk."""
        return (vp_stage or 0) * self.pipeline_model_parallel_size + self.looped_rank(vp_stage, pp_rank)

    def _count(self, stage: int, layer_type) -> int:
        d = self.pipeline_model_parallel_size
        return self.layout[stage % d][stage // d].count(layer_type)

    def get_num_layers_to_build(self, layer_type: LayerType = LayerType.decoder, vp_stage=None, pp_rank=None):
        return self._count(self._stage(vp_stage, pp_rank), layer_type)

    def get_layer_offset(self, layer_type: LayerType = LayerType.decoder, vp_stage=None, pp_rank=None):
        return sum(self._count(stage, layer_type) for stage in range(self._stage(vp_stage, pp_rank)))


class VShapeLayerLayout(StageLayerLayout):
    """megatron's layout for a V placement: a chunk's looped rank follows from (real rank, vp_stage)."""

    def looped_rank(self, vp_stage, pp_rank) -> int:
        if pp_rank is not None:
            return pp_rank
        rank = parallel_state.get_pipeline_model_parallel_rank()
        return rank if not vp_stage else self.pipeline_model_parallel_size - 1 - rank


def megatron_layout(counts, placement: Placement) -> PipelineParallelLayerLayout:
    """The layout object for ``TransformerConfig.pipeline_model_parallel_layout``.

    ``counts`` has one entry per global stage of ``placement``. A looped placement gets megatron's
    own class (its rank numbering is megatron's); a V placement gets :class:`VShapeLayerLayout`.
    """
    counts = tuple(counts)
    if len(counts) != placement.num_stages:
        raise ValueError(f"--pipeline-layout: {len(counts)} counts for {placement.num_stages} stages")
    cls = VShapeLayerLayout if placement.kind is PlacementKind.V else StageLayerLayout
    return cls(layout_stages(counts), placement.num_devices)


def stage_layer_counts(layout: PipelineParallelLayerLayout) -> tuple[int, ...]:
    """Decoder layers per global stage of a megatron layout (inverse of :func:`megatron_layout`)."""
    d, v = layout.pipeline_model_parallel_size, layout.virtual_pipeline_model_parallel_size
    return tuple(layout.layout[stage % d][stage // d].count(LayerType.decoder) for stage in range(d * v))
