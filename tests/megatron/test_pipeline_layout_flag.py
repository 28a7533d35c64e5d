"""--pipeline-layout: flag checks, what reaches Megatron, per-stage costs (pure argparse, no processes)."""

import argparse

import pytest

from megatron_vshape.megatron import pipeline_layout as layout
from megatron_vshape.megatron.arguments import ConfigError, add_arguments, validate
from megatron_vshape.megatron.checks import problems
from megatron_vshape.planner.balance import choose_layout
from megatron_vshape.planner.model import GPTModel
from megatron_vshape.schedules.core.schedule import Costs
from megatron_vshape.schedules.core.simulator import simulate
from megatron_vshape.schedules.generators.registry import get_schedule


def training_args(*argv: str, **overrides) -> argparse.Namespace:
    """A Megatron-like Namespace for the README's CPU example (PP=4, 8 layers, m=8)."""
    args = add_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args(
        ["--pipeline-schedule", "v-half", "--cpu", *argv])
    base = dict(world_size=4, tensor_model_parallel_size=1, pipeline_model_parallel_size=4, context_parallel_size=1,
                num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1024,
                micro_batch_size=2, global_batch_size=16, recompute_granularity=None)
    for key, value in {**base, **overrides}.items():
        setattr(args, key, value)
    return args


def one_problem(args) -> str:
    found = problems(args)
    assert len(found) >= 1 and "\n" not in found[0], found
    return found[0]


def test_uniform_default_changes_nothing():
    args = validate(training_args())
    assert args.pipeline_layout == "uniform"
    assert layout.counts(args) is None
    assert getattr(args, "pipeline_model_parallel_layout", None) is None
    assert args.num_virtual_stages_per_pipeline_rank == 2  # today's V setup


def test_explicit_counts_become_megatrons_layout():
    args = validate(training_args("--pipeline-layout", "0,2,1,1,1,1,2,0"))
    assert layout.counts(args) == (0, 2, 1, 1, 1, 1, 2, 0)
    assert args.pipeline_model_parallel_layout == "E|tt|t|t|t|t|tt|L"
    # Megatron derives two chunks from the layout and refuses both flags at once
    assert args.num_virtual_stages_per_pipeline_rank is None


def test_looped_schedule_takes_pp_counts():
    args = validate(training_args("--pipeline-layout", "1,3,3,1", pipeline_schedule="zb-1p"))
    assert args.pipeline_model_parallel_layout == "Et|ttt|ttt|tL"


def test_uneven_v_layout_needs_no_divisible_layer_count():
    args = training_args("--pipeline-layout", "1,2,2,2,2,2,2,1", num_layers=14)
    assert problems(args) == []
    assert "divisible" in one_problem(training_args(num_layers=14))  # uniform still needs it


@pytest.mark.parametrize("text, expected", [
    ("1,1,1,1,1,1,1", r"--pipeline-layout: 7 counts given for 8 pipeline stages"),
    ("1,2,2,2,2,2,2,1", r"--pipeline-layout: counts sum to 14 but --num-layers is 8"),
    ("2,2,0,1,1,1,1,0", r"--pipeline-layout: stage\(s\) 2 would hold no layer"),
    ("1,2,x", r"--pipeline-layout: '1,2,x' is not uniform, balanced or comma-separated"),
])
def test_bad_counts_fail_in_one_line_naming_the_flag(text, expected):
    with pytest.raises(ConfigError, match=expected):
        validate(training_args("--pipeline-layout", text))


@pytest.mark.parametrize("dest, flag", layout.CONFLICTING_FLAGS)
def test_megatrons_own_layout_flags_are_refused_next_to_it(dest, flag):
    args = training_args("--pipeline-layout", "1,3,3,1", pipeline_schedule="zb-1p", **{dest: 1})
    message = one_problem(args)
    assert message.startswith(flag) and "--pipeline-layout" in message and f"drop {flag}" in message


def test_needs_a_schedule_and_interleaved_needs_chunks():
    assert "needs --pipeline-schedule" in one_problem(training_args("--pipeline-layout", "3,5",
                                                                    pipeline_schedule=None, pipeline_model_parallel_size=2))
    message = one_problem(training_args("--pipeline-layout", "1,1,1,1,1,1,1,1", pipeline_schedule="interleaved-1f1b"))
    assert "--num-virtual-stages-per-pipeline-rank" in message


def test_interleaved_counts_are_per_chunk():
    args = validate(training_args("--pipeline-layout", "0,2,1,1,1,1,2,0", pipeline_schedule="interleaved-1f1b",
                                  num_virtual_stages_per_pipeline_rank=2))
    assert args.pipeline_model_parallel_layout == "E|tt|t|t|t|t|tt|L"
    assert args.num_virtual_stages_per_pipeline_rank is None


def test_balanced_is_the_planners_choice():
    args = validate(training_args("--pipeline-layout", "balanced"))
    model = GPTModel("training", 8, 64, 4, 32, 1024)
    assert layout.counts(args) == choose_layout(model, "v-half", 4, 8).layers_per_stage
    assert layout.counts(args) is not None  # the head of a 1024 vocabulary is worth moving layers for


def test_balanced_without_a_vocabulary_fails_in_one_line():
    message = one_problem(training_args("--pipeline-layout", "balanced", vocab_size=None))
    assert message.startswith("--pipeline-layout balanced") and "--vocab-size" in message


def test_schedule_gets_per_stage_work_only_when_uneven():
    assert layout.schedule_costs(validate(training_args()), Costs()) == Costs()
    args = validate(training_args("--pipeline-layout", "0,2,1,1,1,1,2,0"))
    costs = layout.schedule_costs(args, Costs())
    assert len(costs.stages) == 8
    # the head makes the last stage (0 layers) cost more than the empty first stage, and a 2-layer
    # stage twice a 1-layer one
    assert costs.stages[7].f > costs.stages[0].f
    assert costs.stages[1].f == pytest.approx(2 * costs.stages[2].f)
    schedule = get_schedule("v-half", 4, 8, costs)
    assert simulate(schedule, costs).makespan != simulate(get_schedule("v-half", 4, 8), Costs()).makespan


def test_layout_costs_without_planner_scale_by_layers():
    costs = layout.layout_costs(Costs(), (0, 3, 3, 2))
    assert [w.f for w in costs.stages] == [layout.MIN_STAGE_WORK, 1.5, 1.5, 1.0]
    assert layout.layout_costs(Costs(), (2, 2, 2, 2)) == Costs()


def test_start_up_line_names_the_layout():
    args = validate(training_args("--pipeline-layout", "0,2,1,1,1,1,2,0"))
    assert layout.describe(args) == ("pipeline layout: 0,2,1,1,1,1,2,0 transformer layers per stage "
                                     "(V: device i holds stages i and 2d-1-i)")


def _chunk(numbers):
    layers = [argparse.Namespace(layer_number=n) for n in numbers]
    return argparse.Namespace(decoder=argparse.Namespace(layers=layers))


def test_a_chunk_built_without_the_layout_is_refused(monkeypatch):
    """The safety net behind the model provider: rank 1's V chunk 1 is stage 6, layers 7 and 8."""
    from megatron.core import parallel_state

    from megatron_vshape.megatron.model_chunks import ChunkBuilder

    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda *a, **k: 4)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda *a, **k: 1)
    builder = ChunkBuilder(validate(training_args("--pipeline-layout", "0,2,1,1,1,1,2,0")))
    builder._check_layers(_chunk([7, 8]), vp_stage=1)
    builder._check_layers(_chunk([1, 2]), vp_stage=0)  # stage 1
    with pytest.raises(ConfigError, match=r"--pipeline-layout: stage 6 was built with layers \[7\], not \[7, 8\]"):
        builder._check_layers(_chunk([7]), vp_stage=1)


def test_measured_costs_are_refused_with_an_uneven_layout():
    message = one_problem(training_args("--pipeline-layout", "0,2,1,1,1,1,2,0", "--pipeline-costs", "auto"))
    assert message.startswith("--pipeline-costs auto cannot re-plan an uneven --pipeline-layout")
    assert problems(training_args("--pipeline-layout", "0,2,1,1,1,1,2,0", "--pipeline-costs", "f=1,b=1.2,w=0.8")) == []


def test_a_config_built_beforehand_gets_the_v_layout_for_good(monkeypatch):
    """Config containers (Megatron-LM's pretrain_gpt.py) build the TransformerConfig before any chunk:
    its layout is replaced by the V-aware one and kept (sharded_state_dict asks it at save time)."""
    from megatron.core import parallel_state

    from megatron_vshape.megatron.model_chunks import ChunkBuilder
    from megatron_vshape.runtime.layer_layout import VShapeLayerLayout

    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda *a, **k: 4)
    args = validate(training_args("--pipeline-layout", "0,2,1,1,1,1,2,0"))
    config = argparse.Namespace(pipeline_model_parallel_layout="megatron's own, from the text")
    with ChunkBuilder(args)._layout_for_build(config):
        assert isinstance(args.pipeline_model_parallel_layout, VShapeLayerLayout)  # for configs built from args
    assert isinstance(config.pipeline_model_parallel_layout, VShapeLayerLayout)
    assert args.pipeline_model_parallel_layout == "E|tt|t|t|t|t|tt|L"  # args (pickled in checkpoints) keep text
