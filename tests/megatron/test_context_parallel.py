"""Context parallelism with V placement, the parts a CPU can check: the start-up refusals (one line each,
before any rank computes). The p2p shapes (seq / CP per message) and the CP attention run in the GPU check
(``scripts/gpu_check.sh``: CP 2 under V-Half against Megatron's 1F1B); see docs/transformer-engine.md."""

from __future__ import annotations

import pytest
from test_arguments import megatron_like

from megatron_vshape.megatron.arguments import ConfigError, validate
from megatron_vshape.megatron.checks import problems


def _cp(**overrides):
    base = dict(world_size=8, context_parallel_size=2, seq_length=64)
    return megatron_like(**{**base, **overrides})


@pytest.mark.parametrize("overrides, start", [
    ({}, "--context-parallel-size needs Transformer Engine's context-parallel attention, which --cpu does not have"),
    ({"cpu": False, "distributed_backend": None, "transformer_impl": "local"},
     "--context-parallel-size needs Transformer Engine's attention"),
    ({"cpu": False, "distributed_backend": None, "seq_length": 66},
     "--seq-length 66 must be divisible by 2 x --context-parallel-size = 4"),
])
def test_context_parallel_refusals_are_one_line_naming_the_flag(overrides, start):
    with pytest.raises(ConfigError) as info:
        validate(_cp(**overrides))
    assert str(info.value).startswith(start) and "\n" not in str(info.value) and ";" in str(info.value)


@pytest.mark.parametrize("schedule", ["v-half", "v-zb", "1f1b"])
def test_context_parallel_on_te_passes_the_checks_under_v_schedules(schedule):
    args = _cp(cpu=False, distributed_backend=None, pipeline_schedule=schedule, gradient_accumulation_fusion=False)
    assert [p for p in problems(args) if "context-parallel" in p or "seq-length" in p] == []
