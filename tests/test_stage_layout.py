"""--pipeline-layout parsing: uniform, balanced, explicit counts and their one-line errors."""

import pytest

from megatron_vshape.layout_flag import format_layout, parse_layout, uniform_layout
from megatron_vshape.schedules.core.inputs import InputError


def test_uniform_splits_evenly():
    assert parse_layout("uniform", 32, 8) == (4,) * 8
    assert uniform_layout(16, 4) == (4, 4, 4, 4)


def test_uniform_keeps_the_divisibility_rule():
    with pytest.raises(InputError, match=r"--pipeline-layout uniform: --num-layers 30 .* 8 pipeline stages"):
        parse_layout("uniform", 30, 8)


def test_balanced_is_left_to_the_caller():
    assert parse_layout(" Balanced ", 30, 8) == "balanced"


def test_explicit_counts_round_trip():
    counts = parse_layout("2, 4,5,5,5,5,4,2", 32, 8)
    assert counts == (2, 4, 5, 5, 5, 5, 4, 2)
    assert parse_layout(format_layout(counts), 32, 8) == counts


def test_first_and_last_stage_may_be_empty():
    assert parse_layout("0,4,4,0", 8, 4) == (0, 4, 4, 0)


@pytest.mark.parametrize("text, pattern", [
    ("4,4,4", r"3 counts given for 4 pipeline stages"),
    ("4,4,4,5", r"sum to 17 but --num-layers is 16"),
    ("6,-1,6,5", r"must be >= 0; got -1"),
    ("4,0,8,4", r"stage\(s\) 1 would hold no layer"),
    ("4,4,x,4", r"not uniform, balanced or comma-separated"),
    ("", r"not uniform, balanced or comma-separated"),
])
def test_bad_layouts_name_the_flag_in_one_line(text, pattern):
    with pytest.raises(InputError, match=pattern) as info:
        parse_layout(text, 16, 4)
    message = str(info.value)
    assert message.startswith("--pipeline-layout") and "\n" not in message
