"""v-auto: the adaptive V schedule under a memory limit."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_vshape.schedules.core.actions import Kind
from megatron_vshape.schedules.core.schedule import Costs, Placement, ScheduleError
from megatron_vshape.schedules.core.simulator import simulate
from megatron_vshape.schedules.generators.adaptive import (
    candidate_blocks,
    evaluate_candidates,
    greedy_caps,
    lowest_reachable_limit,
    v_auto,
)
from megatron_vshape.schedules.generators.adaptive_blocks import GapPattern, _collision_free_joins, _leg_patterns
from megatron_vshape.schedules.generators.block import BuildingBlock
from megatron_vshape.schedules.generators.v_schedules import v_block, v_half_block, v_min_block
from megatron_vshape.schedules.generators.zero_bubble import v_zb
from megatron_vshape.schedules.lowering.validator import validate

EQUAL = Costs()
UNEQUAL = Costs(f=1, b=1.1, w=0.9, comm=0.05)
LIMITS = (0.34, 0.4, 0.5, 0.6, 0.75, 1.0)
QUICK = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _fb_starts(block):
    """Per device: [F chunk 0, F chunk 1, B chunk 1, B chunk 0] of a block."""
    out = []
    for chunk0, chunk1 in block.placement.stages_per_device:
        o = block.offsets
        out.append((o[(Kind.F, chunk0)], o[(Kind.F, chunk1)], o[(Kind.B, chunk1)], o[(Kind.B, chunk0)]))
    return out


# ---------------------------------------------------------------- the block family


@pytest.mark.parametrize("d", [2, 3, 4, 5, 6, 8, 9, 16])
def test_gap_patterns_reproduce_v_min_and_v_half(d):
    """V-Min is gaps 1/1/1/1 and V-Half 2/1/2/1, with the paper's extra slots at the loss turn."""
    n = d - 1
    v_min = GapPattern((1,) * n, (1,) * n, (1,) * n, (1,) * n, (0, 2 if d % 3 == 0 else 0, 0))
    v_half = GapPattern((2,) * n, (1,) * n, (2,) * n, (1,) * n, (0, 3 if d % 2 == 0 else 0, 1))
    assert v_min.starts() == _fb_starts(v_min_block(d))
    assert v_half.starts() == _fb_starts(v_half_block(d))


@QUICK
@given(d=st.integers(2, 12), pick=st.integers(0, 10**6))
def test_enumerated_blocks_are_collision_free_and_place_w_optimally(d, pick):
    """Every join the search yields gives a valid block, and the W placement (``fill_w``) reaches
    the lowest steady peak of every possible assignment of W to a device's free slots."""
    patterns = list(_leg_patterns(d))
    legs = patterns[pick % len(patterns)]
    placement = Placement.v_shape(d)
    for joins in list(_collision_free_joins(legs))[:3]:
        block = v_block(GapPattern(*legs, joins).starts())
        assert block.collisions() == []
        fb = {key: slot for key, slot in block.offsets.items() if key[0] is not Kind.W}
        for device, stages in enumerate(placement.stages_per_device):
            used = {fb[(k, s)] % 6 for s in stages for k in (Kind.F, Kind.B)}
            free = [r for r in range(6) if r not in used]
            alternatives = []
            for residues in itertools.permutations(free, len(stages)):
                w = {(Kind.W, s): next(t for t in range(fb[(Kind.B, s)] + 1, fb[(Kind.B, s)] + 7) if t % 6 == r)
                     for s, r in zip(stages, residues)}
                alternatives.append(BuildingBlock(placement, 6, {**block.offsets, **w}).steady_peak()[device])
            assert block.steady_peak()[device] <= min(alternatives) + 1e-9


@pytest.mark.parametrize("d", [4, 8])
def test_joins_search_finds_exactly_the_collision_free_ones(d):
    """Against brute force over all 6^3 joins, for a few gap patterns."""
    n = d - 1
    for gaps in ((1, 1, 1, 1), (2, 1, 2, 1), (1, 2, 1, 2), (3, 3, 3, 3), (2, 3, 1, 2)):
        legs = tuple((g,) * n for g in gaps)
        found = set(_collision_free_joins(legs))
        brute = set()
        for j in range(6**3):
            joins = (j // 36, j // 6 % 6, j % 6)
            starts = GapPattern(*legs, joins).starts()
            if all(len({s % 6 for s in device}) == 4 for device in starts):
                brute.add(joins)
        assert found == brute
        for joins in found:
            assert v_block(GapPattern(*legs, joins).starts()).collisions() == []


def test_candidate_blocks_fit_1f1b_memory_and_are_distinct():
    blocks = candidate_blocks(8)
    assert [c.label for c in blocks[:2]] == ["v-min", "v-half"]
    assert len(blocks) > 10
    orders = set()
    for candidate in blocks:
        assert candidate.memory_bound() == max(candidate.block.steady_peak()) <= 8
        orders.add(candidate.block.repeat(12, "x").programs)  # long enough for every pair of passes to meet
    assert len(orders) == len(blocks)


def test_greedy_caps_are_a_fixed_grid():
    assert greedy_caps(4) == [1.0, 3.0, 4.0]
    assert greedy_caps(16) == [4.0, 12.0, 16.0]
    assert greedy_caps(2) == [1.0, 1.5, 2.0]
    assert greedy_caps(5) == [1.0, 3.5, 5.0]


# ---------------------------------------------------------------- v-auto against the limit and the fixed schedules


def _reference_bubble(schedule, costs):
    return simulate(schedule, costs).bubble_rate


@pytest.mark.timeout(240)
@pytest.mark.parametrize("costs", [EQUAL, UNEQUAL], ids=["equal", "unequal"])
# d = 8: seconds, d = 16: minutes of CPU (the full run; the fast tier has d = 8 below, at the fixed schedules' limits)
@pytest.mark.parametrize("d", [4, pytest.param(8, marks=pytest.mark.slow), pytest.param(16, marks=pytest.mark.slow)])
def test_v_auto_keeps_each_limit_and_matches_v_half_and_zb_1p(d, costs):
    from megatron_vshape.schedules.generators.registry import get_schedule

    m = 4 * d
    bubbles = []
    for limit in LIMITS:
        schedule = v_auto(d, m, costs, limit)
        validate(schedule)
        result = simulate(schedule, costs)
        assert schedule.name == "v-auto" and schedule.num_microbatches == m
        assert schedule.meta["memory_limit"] == limit and schedule.meta["candidate"]
        assert max(result.peak_memory) <= limit * d + 1e-9, (limit, result.peak_memory)
        bubbles.append(result.bubble_rate)
    assert all(hi <= lo + 1e-12 for lo, hi in zip(bubbles, bubbles[1:])), bubbles

    v_half = simulate(get_schedule("v-half", d, m, costs), costs)
    at_v_half = simulate(v_auto(d, m, costs, v_half.peak_memory_max / d), costs)
    assert at_v_half.bubble_rate <= v_half.bubble_rate + 1e-12
    assert at_v_half.peak_memory_max <= v_half.peak_memory_max + 1e-9

    full = bubbles[-1]
    assert full <= _reference_bubble(v_zb(d, m, costs), costs) + 0.005
    assert full <= _reference_bubble(get_schedule("zb-1p", d, m, costs), costs) + 1e-12


@QUICK
@given(
    d=st.integers(2, 4),
    m_factor=st.integers(1, 2),
    costs=st.sampled_from([EQUAL, UNEQUAL, Costs(f=1, b=2, w=1, comm=0.1), Costs(f=1.5, b=1, w=0.5)]),
    fractions=st.lists(st.floats(0.0, 1.0), min_size=2, max_size=4),
)
def test_bubble_never_rises_with_the_limit(d, m_factor, costs, fractions):
    """Limits are drawn from the reachable range [lowest, 1], so every example compares them all
    (limits below the lowest reachable one are refused; tested below)."""
    m = m_factor * d
    lowest = lowest_reachable_limit(d, m, costs)
    previous = None
    for limit in sorted(min(1.0, lowest + x * (1.0 - lowest)) for x in fractions):
        schedule = v_auto(d, m, costs, limit)
        validate(schedule)
        result = simulate(schedule, costs)
        assert result.peak_memory_max <= limit * d + 1e-9
        if previous is not None:
            assert result.bubble_rate <= previous + 1e-12
        previous = result.bubble_rate


def test_every_candidate_is_valid_and_measured():
    for evaluated in evaluate_candidates(4, 8, UNEQUAL):
        assert evaluated.exact and evaluated.schedule is not None
        validate(evaluated.schedule)
        result = simulate(evaluated.schedule, UNEQUAL)
        assert result.peak_memory_max == pytest.approx(evaluated.peak)
        assert result.bubble_rate == pytest.approx(evaluated.bubble)
        assert evaluated.peak <= evaluated.candidate.memory_bound() + 1e-9


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("d", "m", "costs"), [
    (4, 16, EQUAL), (4, 16, UNEQUAL),
    # CPU-heavy (seconds to minutes each): the full run only
    *(pytest.param(d, m, costs, marks=pytest.mark.slow)
      for d, m, costs in ((8, 32, UNEQUAL), (8, 32, EQUAL), (8, 136, EQUAL), (8, 136, UNEQUAL), (12, 96, EQUAL), (12, 96, UNEQUAL))),
], ids=lambda value: "unequal" if value is UNEQUAL else "equal" if value is EQUAL else None)
def test_never_worse_than_a_fixed_v_schedule_that_fits(d, m, costs):
    """At the memory of V-Min, V-Half and V-ZB, v-auto is at least as good as each (exact search
    up to 1024 cells, the fixed-schedule shortlist above)."""
    from megatron_vshape.schedules.generators.registry import get_schedule

    for name in ("v-min", "v-half", "v-zb"):
        fixed = simulate(get_schedule(name, d, m, costs), costs)
        limit = fixed.peak_memory_max / d
        chosen = simulate(v_auto(d, m, costs, limit), costs)
        assert chosen.peak_memory_max <= limit * d + 1e-9
        assert chosen.bubble_rate <= fixed.bubble_rate + 1e-12, name


@pytest.mark.slow  # full-size builds: seconds; in the README's test command
@pytest.mark.timeout(120)
def test_long_runs_build_only_the_fixed_schedules_that_fit():
    d, m = 8, 136  # 1088 cells: past the exact-search size
    bubbles = []
    for limit in (0.5, 0.75, 1.0):
        schedule = v_auto(d, m, UNEQUAL, limit)
        validate(schedule)
        assert schedule.meta["exact_search"] is False
        result = simulate(schedule, UNEQUAL)
        assert result.peak_memory_max <= limit * d + 1e-9
        bubbles.append(result.bubble_rate)
    # The top two fitting fixed schedules are compared at full size; more memory never hurt here.
    assert bubbles == sorted(bubbles, reverse=True)


def test_results_are_cached_but_meta_is_per_call():
    first = v_auto(4, 8, EQUAL, 0.6)
    first.meta["candidate"] = "scribbled"
    second = v_auto(4, 8, EQUAL, 0.6)
    assert second.programs == first.programs
    assert second.meta["candidate"] != "scribbled"


def test_meta_records_the_block_offsets():
    schedule = v_auto(4, 8, EQUAL, 0.75)
    meta = schedule.meta
    assert meta["memory_limit_units"] == pytest.approx(3.0)
    if "offsets" in meta:
        assert meta["interval"] == 6 and len(meta["offsets"]) == 3 * 8
    else:
        assert meta["greedy_cap_units"] <= 3.0


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("limit", [0, -0.5, 1.01, 2.0])
def test_limit_outside_zero_one_is_refused(limit):
    with pytest.raises(ScheduleError, match=r"--memory-limit must be in \(0, 1\]"):
        v_auto(4, 8, EQUAL, limit)


def test_no_limit_means_1f1b_memory():
    default = v_auto(4, 8, EQUAL)
    assert default.meta["memory_limit"] == 1.0
    assert default.programs == v_auto(4, 8, EQUAL, 1.0).programs


@pytest.mark.parametrize("d", [2, 4, 8])
def test_too_low_limit_names_the_lowest_reachable_value(d):
    m = 2 * d
    lowest = lowest_reachable_limit(d, m, EQUAL)
    with pytest.raises(ScheduleError) as info:
        v_auto(d, m, EQUAL, lowest * 0.9)
    message = str(info.value)
    assert "\n" not in message and "--memory-limit" in message
    named = float(re.search(r"lowest reachable is ([0-9.]+)", message).group(1))
    assert lowest <= named <= lowest + 0.001
    schedule = v_auto(d, m, EQUAL, named)  # the value named in the message works
    assert simulate(schedule).peak_memory_max <= named * d + 1e-9


@pytest.mark.parametrize("d", [2, 3, 4, 6, 8])
def test_the_zero_bubble_shortcut_chooses_what_building_every_candidate_chooses(monkeypatch, d):
    """Where a candidate that fits has no bubble (uniform stages), ``choose`` builds only the candidates whose
    memory bound is not below d - 1/2 (the others keep device 0 idle before its first B, so they have a
    bubble); the choice is the one of building them all, and every candidate it skips has a bubble."""
    from megatron_vshape.schedules.generators import adaptive as module

    for m in (d, 2 * d, 4 * d):
        for costs in (Costs(), Costs(1, 1.1, 0.9, 0.05), Costs(1, 2.0, 0.5, 0.0)):
            listed = module.candidates(d, m, costs)
            for limit in (0.5, 0.75, 1.0):
                try:
                    fast = module.choose(d, m, costs, limit)
                except ScheduleError:
                    fast = None
                with monkeypatch.context() as patched:
                    patched.setattr(module, "_zero_bubble_choice", lambda *args: None)
                    try:
                        plain = module.choose(d, m, costs, limit)
                    except ScheduleError:
                        plain = None
                assert (fast is None) == (plain is None)
                if fast is not None:
                    assert fast.candidate == plain.candidate and fast.schedule.programs == plain.schedule.programs
            for i, candidate in enumerate(listed):
                if candidate.memory_bound(costs) <= d - 0.5:
                    assert module._evaluate(d, m, costs, i).bubble > 0
