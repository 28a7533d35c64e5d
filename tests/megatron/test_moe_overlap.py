"""--overlap-moe-expert-parallel-comm at start-up (issue 43): the V schedules take it and build their schedule with
overlapped F&B pairs; every other case refuses it in one line (no launch: the checks and the schedule only)."""

from __future__ import annotations

import dataclasses

import pytest
from test_arguments import megatron_like

from megatron_vshape.megatron import moe_overlap, patches
from megatron_vshape.megatron.checks import problems
from megatron_vshape.megatron.sizes import Sizes
from megatron_vshape.megatron.startup_schedule import costs_for_run, schedule_for_run

FLAG = dict(overlap_moe_expert_parallel_comm=True, bf16=True)


@pytest.mark.parametrize("name", ["v-zb", "v-half", "v-min", "v-auto"])
def test_v_schedules_take_the_flag_and_build_pairs(name):
    extra = dict(pipeline_memory_limit=1.0) if name == "v-auto" else {}
    args = megatron_like(pipeline_schedule=name, pipeline_model_parallel_size=2, world_size=4,
                         global_batch_size=32, **FLAG, **extra)
    assert problems(args) == []
    costs = costs_for_run(args)
    assert costs.a2a == moe_overlap.DEFAULT_A2A
    schedule = schedule_for_run(args, Sizes.from_args(args))
    assert schedule.pairs, name  # d 2, m 8: V-ZB 13 pairs, V-Half and V-Min 9
    # without the flag: the same schedule as before the feature (no all-to-all cost, no pairs)
    plain = megatron_like(pipeline_schedule=name, pipeline_model_parallel_size=2, world_size=4,
                          global_batch_size=32, bf16=True, **extra)
    assert costs_for_run(plain).a2a == 0.0 and not schedule_for_run(plain, Sizes.from_args(plain)).pairs


def test_pipeline_costs_give_the_pairs_all_to_all():
    """The all-to-all the pairs are placed for comes from --pipeline-costs when it names one (a measured ratio),
    and places a different order than the default's; without the flag an a2a is refused in one line."""
    sized = dict(pipeline_schedule="v-zb", pipeline_model_parallel_size=2, world_size=4, global_batch_size=32)
    given = megatron_like(**sized, **FLAG, pipeline_costs="f=1,b=1,w=1,a2a=0.25")
    assert problems(given) == [] and costs_for_run(given).a2a == 0.25
    default = megatron_like(**sized, **FLAG, pipeline_costs="f=1,b=1,w=1")
    assert costs_for_run(default).a2a == moe_overlap.DEFAULT_A2A
    assert schedule_for_run(given, Sizes.from_args(given)).pairs != schedule_for_run(default, Sizes.from_args(default)).pairs
    [line] = problems(megatron_like(**sized, bf16=True, pipeline_costs="f=1,a2a=0.25"))
    assert "add that flag or drop a2a" in line and "\n" not in line


@pytest.mark.parametrize("name", ["zb-h1", "zb-1p", "zb-2p", "gpipe"])
def test_one_chunk_schedules_refuse_in_one_line(name):
    [line] = problems(megatron_like(pipeline_schedule=name, **FLAG))
    assert line.startswith("--overlap-moe-expert-parallel-comm runs under the V schedules") and "\n" not in line
    assert f"--pipeline-schedule {name} places one model chunk per pipeline rank" in line


def test_megatrons_own_schedules_keep_megatrons_rules():
    args = megatron_like(pipeline_schedule="interleaved-1f1b", num_virtual_stages_per_pipeline_rank=2, **FLAG)
    assert moe_overlap.problem(args, lambda: False) is None
    assert not moe_overlap.wants_pairs(args) and costs_for_run(args).a2a == 0.0


def test_hybrid_model_refuses_in_one_line():
    args = megatron_like(**FLAG)
    args.hybrid_layer_pattern = "*E*E*E*E"
    line = moe_overlap.problem(args, lambda: False)
    assert line.startswith("--overlap-moe-expert-parallel-comm needs the model's schedule plans, which HybridModel")


def test_te_deferral_route_refuses_in_one_line():
    line = moe_overlap.problem(megatron_like(**FLAG), lambda: True)
    assert "Transformer Engine's deferral computes W inside the combined step's backward_dw()" in line
    assert line.startswith("--overlap-moe-expert-parallel-comm") and "\n" not in line


def test_a_megatron_core_without_the_combined_step_refuses_in_one_line(monkeypatch):
    assert moe_overlap.combined_step_missing() is None  # this megatron-core (0.19) has it
    gone = dataclasses.replace(patches.COMBINED_STEP, attribute="combined_forward_backward_step_gone")
    monkeypatch.setattr(patches, "PATCHES", tuple(gone if p is patches.COMBINED_STEP else p for p in patches.PATCHES))
    line = moe_overlap.problem(megatron_like(**FLAG), lambda: False)
    assert line.startswith("--overlap-moe-expert-parallel-comm under --pipeline-schedule v-half runs Megatron's "
                           "combined 1F1B step, which megatron-core") and "is missing" in line and "\n" not in line


def test_the_patch_table_names_the_combined_step_with_its_signature():
    entry = patches.COMBINED_STEP
    assert entry in patches.PATCHES and entry.group is patches.Group.MOE_OVERLAP
    group = [p for p in patches.PATCHES if p.group is patches.Group.MOE_OVERLAP]
    assert [p.attribute for p in group] == ["combined_forward_backward_step", "forward_step_calc_loss",
                                            "TransformerLayerSchedulePlan.run", "TransformerModelChunkSchedulePlan.run"]
    assert all(patches.problem(p) is None for p in group)
    assert entry.params[:11] == ("forward_step_func", "data_iterator", "f_model", "num_microbatches",
                                 "input_tensor", "forward_data_store", "b_model", "b_input_tensor",
                                 "b_output_tensor", "b_output_tensor_grad", "config")
