"""Every registry entry keeps one contract: build(d, m, costs, memory_limit=None) with one signature,
check(d, m) as the only size rule (it agrees with what build accepts, and what it accepts really
runs), and the backward split read from the built schedule."""

import dataclasses

import pytest

from megatron_vshape.schedules.core.schedule import Costs, ScheduleError
from megatron_vshape.schedules.generators.registry import (
    SCHEDULES,
    ScheduleSpec,
    fuses_backward,
    get_schedule,
    get_spec,
)
from megatron_vshape.schedules.lowering.validator import validate

UNEQUAL = Costs(1.0, 1.1, 0.9, 0.05)
# Large enough that interleaved-1f1b's rule matters (its raw order deadlocks at d = 5, m = 7 and
# d = 6, m = 8); the generators that search (zero bubble, V) get a smaller grid for the fast tier.
GRID = [(d, m) for d in (1, 2, 3, 5, 6) for m in (1, 2, 3, 6, 7, 8)]
SEARCH_GRID = [(d, m) for d in (1, 2, 3, 4) for m in (1, 2, 3, 5, 8)]
AUTO_GRID = [(1, 1), (1, 3), (2, 1), (2, 3), (3, 2)]  # v-auto searches its candidates at every size
FIXED_ORDERS = ("gpipe", "1f1b", "interleaved-1f1b")


def contract_problems(spec: ScheduleSpec, grid) -> list[str]:
    """Where ``spec`` breaks the contract over ``grid``: check() and build() disagree, or build()
    accepts a size whose schedule is invalid (a p2p deadlock included: validate lowers the plan)."""
    found = []
    for d, m in grid:
        problem = spec.check(d, m)
        try:
            schedule = spec.build(d, m, UNEQUAL, None)
        except ScheduleError as err:
            if problem is None or str(err) != problem:
                found.append(f"d={d} m={m}: build raised {err!r}, check said {problem!r}")
            continue
        if problem is not None:
            found.append(f"d={d} m={m}: check said {problem!r} but build accepted it")
            continue
        try:
            validate(schedule)
        except ValueError as err:
            found.append(f"d={d} m={m}: accepted but invalid: {str(err)[:120]}")
            continue
        if (schedule.name, schedule.num_devices, schedule.num_microbatches) != (spec.name, d, m):
            found.append(f"d={d} m={m}: built {schedule.name} for d={schedule.num_devices} m={schedule.num_microbatches}")
    return found


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_check_agrees_with_build_and_accepted_sizes_run(name):
    grid = GRID if name in FIXED_ORDERS else AUTO_GRID if name == "v-auto" else SEARCH_GRID
    assert contract_problems(SCHEDULES[name], grid) == []


def test_the_contract_check_catches_a_missing_size_rule():
    """Without its rule, interleaved-1f1b accepts sizes whose p2p plan deadlocks: the contract test sees it."""
    unruled = dataclasses.replace(SCHEDULES["interleaved-1f1b"], size_rule=None)
    found = contract_problems(unruled, GRID)
    assert any(p.startswith("d=5 m=7: accepted but invalid: p2p plan deadlocks") for p in found), found


def test_bad_sizes_give_one_line_naming_the_fix():
    spec = get_spec("interleaved-1f1b")
    assert spec.check(4, 6) == "interleaved-1f1b with 4 devices needs a multiple of 4 microbatches (Megatron's rule); got 6"
    assert spec.check(4, 8) is None
    assert get_spec("v-half").check(0, 4) == "v-half needs at least 1 pipeline device; got 0"
    assert get_spec("gpipe").check(2, 0) == "gpipe needs at least 1 microbatch; got 0"
    with pytest.raises(ScheduleError, match="multiple of 4 microbatches"):
        get_schedule("interleaved-1f1b", 4, 6)
    with pytest.raises(ScheduleError, match="unknown schedule 'v-quarter'; choose one of: gpipe, 1f1b"):
        get_spec("v-quarter")


def test_microbatch_counts_are_derived_from_check():
    interleaved, v_half = get_spec("interleaved-1f1b"), get_spec("v-half")
    assert [interleaved.min_microbatches(d) for d in (1, 2, 4, 7)] == [1, 2, 4, 7]
    assert [v_half.min_microbatches(d) for d in (1, 2, 4, 7)] == [1, 1, 1, 1]
    assert interleaved.nearest_microbatches(4, 6) == 4  # the largest that fits at or below
    assert interleaved.nearest_microbatches(4, 2) == 4  # else the smallest above
    assert v_half.nearest_microbatches(4, 6) == 6


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_one_build_signature_for_every_entry(name):
    spec = SCHEDULES[name]
    schedule = spec.build(2, 4, Costs(), None)  # positional: (d, m, costs, memory_limit)
    assert (schedule.name, schedule.num_devices, schedule.num_microbatches) == (name, 2, 4)
    if spec.takes_memory_limit:
        assert spec.build(2, 4, Costs(), 0.9).meta["memory_limit"] == 0.9
    else:
        with pytest.raises(ScheduleError, match=f"--memory-limit only applies to v-auto; {name} has a fixed"):
            spec.build(2, 4, Costs(), 0.9)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_fused_backward_is_read_from_the_schedule_and_does_not_depend_on_size(name):
    spec = SCHEDULES[name]
    sizes = [(d, spec.nearest_microbatches(d, m)) for d, m in ((2, 4), (3, 6), (4, 8))]
    built = {get_schedule(name, d, m, UNEQUAL).fused_backward for d, m in sizes}
    assert built == {fuses_backward(name)}


def test_only_the_hand_ordered_baselines_fuse_the_backward():
    assert [name for name in SCHEDULES if fuses_backward(name)] == ["gpipe", "1f1b", "interleaved-1f1b"]


def test_chunks_per_device_follow_the_placement():
    assert get_spec("v-zb").chunks_per_device(4) == 2
    assert get_spec("interleaved-1f1b").chunks_per_device(3) == 3
    assert get_spec("zb-1p").chunks_per_device(3) == 1
    assert get_schedule("interleaved-1f1b", 2, 4, chunks=3).num_stages == 6
