"""runtime.layer_layout: megatron's layout object answers for V chunks (no processes)."""

from __future__ import annotations

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_vshape.megatron.pipeline_layout import megatron_layout_text
from megatron_vshape.runtime.layer_layout import (
    VShapeLayerLayout,
    layout_stages,
    megatron_layout,
    stage_layer_counts,
)
from megatron_vshape.schedules.core.schedule import Placement

V_COUNTS = (1, 2, 2, 2, 2, 2, 2, 1)  # d = 4, 14 layers


def _prefix(counts, stage):
    return sum(counts[:stage])


@pytest.fixture
def real_rank(monkeypatch):
    """Set parallel_state's pipeline rank, as a spawned rank would have it."""
    def set_rank(rank):
        monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda *a, **k: rank)
    return set_rank


def test_text_and_counts_round_trip():
    assert megatron_layout_text((0, 3, 3, 2)) == "E|ttt|ttt|ttL"
    # megatron parses the text form (what training hands it) into the same stages
    assert stage_layer_counts(PipelineParallelLayerLayout("E|ttt|ttt|ttL", 4)) == (0, 3, 3, 2)
    assert stage_layer_counts(PipelineParallelLayerLayout(megatron_layout_text(V_COUNTS), 4)) == V_COUNTS
    for placement, counts in ((Placement.v_shape(4), V_COUNTS), (Placement.looped(4), (0, 3, 3, 2)),
                              (Placement.looped(2, 2), (1, 2, 3, 2))):
        assert stage_layer_counts(megatron_layout(counts, placement)) == counts


def test_wrong_count_is_refused():
    with pytest.raises(ValueError, match="--pipeline-layout: 4 counts for 8 stages"):
        megatron_layout((2, 2, 2, 2), Placement.v_shape(4))


@pytest.mark.parametrize("rank", range(4))
def test_v_chunks_get_their_stage_layers_the_way_megatron_asks(real_rank, rank):
    """Megatron's layout branch asks without pp_rank (the real rank) and with the chunk's vp_stage."""
    placement = Placement.v_shape(4)
    layout = megatron_layout(V_COUNTS, placement)
    assert isinstance(layout, VShapeLayerLayout)
    real_rank(rank)
    for vp_stage, stage in enumerate(placement.stages_per_device[rank]):
        assert layout.get_num_layers_to_build(vp_stage=vp_stage) == V_COUNTS[stage]
        assert layout.get_layer_offset(vp_stage=vp_stage) == _prefix(V_COUNTS, stage)
        assert layout.get_layer_id_list(vp_stage=vp_stage) == list(
            range(_prefix(V_COUNTS, stage), _prefix(V_COUNTS, stage + 1)))


def test_megatrons_own_class_would_number_v_chunk_1_wrongly(real_rank):
    """Why the subclass exists: megatron's class answers chunk 1 of rank 0 as looped stage 4, not 7,
    and drops vp_stage altogether when parallel_state has no virtual pipeline size."""
    plain = PipelineParallelLayerLayout(layout_stages(V_COUNTS), 4)
    real_rank(0)
    assert plain.get_layer_offset(vp_stage=1) != _prefix(V_COUNTS, 7)
    assert megatron_layout(V_COUNTS, Placement.v_shape(4)).get_layer_offset(vp_stage=1) == _prefix(V_COUNTS, 7)


def test_transformer_config_takes_it_and_megatrons_offset_follows(real_rank):
    """TransformerConfig validates the object as its own; get_transformer_layer_offset (used for layer
    numbers, checkpoint keys and the schedule-invariant init) then gives the V stage's offset."""
    layout = megatron_layout(V_COUNTS, Placement.v_shape(4))
    config = TransformerConfig(num_layers=sum(V_COUNTS), hidden_size=8, num_attention_heads=2,
                               pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2,
                               pipeline_model_parallel_layout=layout, use_cpu_initialization=True,
                               pipeline_dtype=torch.float32)
    assert config.pipeline_model_parallel_layout is layout
    real_rank(1)
    # rank 1, chunk 1 = V stage 6 = looped (rank 2, vp_stage 1): the view passes pp_rank=2
    assert get_transformer_layer_offset(config, vp_stage=1, pp_rank=2) == _prefix(V_COUNTS, 6)
    assert get_transformer_layer_offset(config, vp_stage=0, pp_rank=1) == _prefix(V_COUNTS, 1)


def test_looped_layout_counts_follow_megatrons_numbering(real_rank):
    counts = (1, 2, 3, 2)  # d = 2, two chunks per rank: rank r holds stages r and r + 2
    layout = megatron_layout(counts, Placement.looped(2, 2))
    for rank in range(2):
        real_rank(rank)
        for vp_stage in range(2):
            stage = vp_stage * 2 + rank
            assert layout.get_num_layers_to_build(vp_stage=vp_stage) == counts[stage]
            assert layout.get_layer_offset(vp_stage=vp_stage) == _prefix(counts, stage)
