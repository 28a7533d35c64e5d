"""HybridModel's pattern and the schedule's stages (megatron_vshape.megatron.hybrid_pattern): the checks our
flags run before Megatron's validate_args, and what they hand to Megatron. Pure Python, no processes."""

from __future__ import annotations

import pytest
from test_arguments import megatron_like

from megatron_vshape.megatron.arguments import ConfigError, validate
from megatron_vshape.megatron.hybrid_pattern import (
    HYBRID_LOCAL_SPEC_ARG,
    HYBRID_SPLIT_SPEC_ARG,
    HybridPattern,
    spec_arg,
)


def hybrid_args(pattern: str, schedule: str = "v-half", pp: int = 2, **overrides):
    base = dict(pipeline_model_parallel_size=pp, world_size=pp, num_layers=None, hybrid_layer_pattern=pattern,
                hybrid_override_pattern=None, spec=None, num_virtual_stages_per_pipeline_rank=None)
    args = megatron_like(**{**base, **overrides})
    args.pipeline_schedule = schedule
    return args


def refusal(args) -> str:
    with pytest.raises(ConfigError) as info:
        validate(args)
    message = str(info.value)
    assert "\n" not in message and ";" in message, message  # one line, with the fix
    return message


@pytest.mark.parametrize("symbol, name", [("M", "Mamba-2"), ("G", "Gated DeltaNet"), ("D", "DeepSeek sparse attention")])
def test_cpu_refuses_layers_that_need_cuda_kernels_naming_the_symbol(symbol, name):
    message = refusal(hybrid_args(f"*-{symbol}-*-*-"))
    assert message.startswith(f"--hybrid-layer-pattern: '{symbol}' ({name}) layers need CUDA kernels"), message


def test_cpu_refuses_a_cuda_only_layer_without_a_schedule_too():
    args = hybrid_args("M*M*")
    args.pipeline_schedule = None
    assert "'M' (Mamba-2)" in refusal(args)


@pytest.mark.parametrize("pattern, schedule, pp, want", [
    ("*-*-*-*-", "v-half", 2, "*-|*-|*-|*-"),  # a V splits evenly into 2d stages
    ("*-*E*-*E*-*E*-*E", "v-zb", 4, "*-|*E|*-|*E|*-|*E|*-|*E"),
    ("*-*-*-*-/*-", "v-min", 2, "*-|*-|*-|*-/*-"),  # the multi-token-prediction part stays as it was
    ("*-*-|*-*-|*-|*-", "v-half", 2, "*-*-|*-*-|*-|*-"),  # the pattern's own stages
    ("*-*-*-*-", "1f1b", 2, "*-*-*-*-"),  # looped schedules keep Megatron's own even split
    ("*-*-|*-*-", "zb-1p", 2, "*-*-|*-*-"),
])
def test_the_stages_reach_megatron_as_pipe_segments(pattern, schedule, pp, want):
    args = validate(hybrid_args(pattern, schedule, pp))
    assert args.hybrid_layer_pattern == want
    # Megatron refuses the virtual-pipeline flag next to a pattern; the V's 2 chunks follow from its 2d segments.
    assert args.num_virtual_stages_per_pipeline_rank is None
    assert args.spec == HYBRID_LOCAL_SPEC_ARG  # --cpu: megatron-core's torch layers


def test_pipeline_layout_is_written_into_the_pattern():
    args = validate(hybrid_args("*-*-*-*-", pipeline_layout="1,3,3,1"))
    assert args.hybrid_layer_pattern == "*|-*-|*-*|-"


def test_pipeline_layout_that_disagrees_with_the_pipes_is_refused():
    message = refusal(hybrid_args("*-*-|*-|*|-", pipeline_layout="2,2,2,2"))
    assert message.startswith("--pipeline-layout 2,2,2,2 disagrees with the '|' segments of --hybrid-layer-pattern "
                              "(4,2,1,1 layers)"), message
    assert validate(hybrid_args("*-*-|*-|*|-", pipeline_layout="4,2,1,1")).hybrid_layer_pattern == "*-*-|*-|*|-"


@pytest.mark.parametrize("pattern, schedule, flags, expected", [
    ("*-*-|*-*-", "v-half", {}, "has 2 '|' segments but --pipeline-schedule v-half at PP 2 runs 4 stages"),
    ("*-*-|*-|*-|*-", "1f1b", {}, "has 4 '|' segments but --pipeline-schedule 1f1b at PP 2 runs 2 stages"),
    ("*-*-*-", "v-half", {}, "has 6 layers, not divisible by the 4 stages of v-half"),
    ("*-*-*-*-", "v-half", {"pipeline_layout": "balanced"}, "--pipeline-layout balanced does not weigh"),
    ("*-*-*-*-", "interleaved-1f1b", {}, "interleaved-1f1b on HybridModel takes its chunks from the '|' segments"),
])
def test_stage_mismatches_are_refused_in_one_line(pattern, schedule, flags, expected):
    assert expected in refusal(hybrid_args(pattern, schedule, **flags))


def test_spec_choice():
    gpu = dict(cpu=False, transformer_impl="transformer_engine")
    assert spec_arg(hybrid_args("*-*-", **gpu), split_schedule=True) == HYBRID_SPLIT_SPEC_ARG
    assert spec_arg(hybrid_args("*-*-", **gpu), split_schedule=False) is None  # Megatron's own TE hybrid spec
    assert spec_arg(hybrid_args("*-*-", transformer_impl="local"), split_schedule=True) == HYBRID_LOCAL_SPEC_ARG
    mine = ["my_specs", "stack"]
    assert spec_arg(hybrid_args("*-*-", spec=mine), split_schedule=True) == mine  # the user's spec stays


def test_pattern_round_trip():
    pattern = HybridPattern.parse("*-*E|*-/*-/*-")
    assert pattern.segments == ("*-*E", "*-") and pattern.mtp == "/*-/*-" and pattern.counts == (4, 2)
    assert pattern.split((1, 2, 3)).text() == "*|-*|E*-/*-/*-"
