"""The W-after-B order property (validator.w_order_breaks) over every registry schedule, d = 2..16.

Transformer Engine's deferred weight gradients sit in a first-in first-out queue per module and
``backward_dw()`` pops the oldest, so a split schedule can use TE's deferral only if every stage runs
its W passes in the order of its B passes. Every registry generator keeps that order today; this
test says so and catches a generator that stops keeping it.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from megatron_vshape.schedules.core.actions import Kind
from megatron_vshape.schedules.core.schedule import Costs, Schedule
from megatron_vshape.schedules.generators.registry import SCHEDULES, get_spec
from megatron_vshape.schedules.lowering.validator import keeps_w_order, validate, w_order_breaks

# Which registry schedules keep the order (all of them; a generator that stops must be moved out
# of this set, and then a split run with TE falls back to the split layer spec for it).
KEEPS_W_ORDER = frozenset(SCHEDULES)
COSTS = (Costs(), Costs(f=1, b=1.1, w=0.9, comm=0.05), Costs(f=1, b=2, w=1), Costs(f=1, b=1, w=3, comm=0.5))
FEW = settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# v-auto searches its candidates at every size (about a second each at d = 16 here): fewer draws.
AUTO_FEW = settings(FEW, max_examples=1)


def _build(name: str, d: int, m: int, costs: Costs, memory_limit: float | None = None) -> Schedule:
    spec = get_spec(name)
    return spec.build(d, spec.nearest_microbatches(d, m), costs, memory_limit)


def test_the_set_of_schedules_that_keep_the_order_is_the_registry():
    assert KEEPS_W_ORDER == set(SCHEDULES), "a new schedule: add it here once the test below passes for it"


@pytest.mark.slow  # full-size builds at d = 2..16 for every schedule: seconds; in the README's test command
@pytest.mark.parametrize("name", sorted(set(SCHEDULES) - {"v-auto"}))
@FEW
@given(d=st.integers(2, 16), factor=st.integers(1, 4), costs=st.sampled_from(COSTS))
@example(d=2, factor=1, costs=Costs()).via("smallest pipeline")
@example(d=16, factor=2, costs=COSTS[1]).via("largest pipeline")
def test_registry_schedules_keep_w_order_at_2_to_16_devices(name, d, factor, costs):
    schedule = _build(name, d, factor * d, costs)
    assert keeps_w_order(schedule) is (name in KEEPS_W_ORDER), w_order_breaks(schedule)


@pytest.mark.slow  # v-auto builds every candidate at d = 2..16: seconds; in the README's test command
@AUTO_FEW
@given(d=st.integers(2, 16), factor=st.integers(1, 3), limit=st.sampled_from((None, 0.6, 0.8)))
@example(d=16, factor=2, limit=None).via("largest pipeline")
def test_v_auto_keeps_w_order_at_2_to_16_devices(d, factor, limit):
    schedule = _build("v-auto", d, factor * d, Costs(), limit)
    assert w_order_breaks(schedule) == []


def _delay_first_w(schedule: Schedule, device: int) -> Schedule:
    """``schedule`` with the first W pass on ``device`` moved to just after the next W of its stage.

    Delaying a W keeps the schedule valid (nothing waits for a W) but runs two W passes out of B order.
    """
    program = list(schedule.programs[device])
    first = next(i for i, a in enumerate(program) if a.kind is Kind.W)
    moved = program.pop(first)
    second = next(i for i, a in enumerate(program) if a.kind is Kind.W and a.stage == moved.stage)
    program.insert(second + 1, moved)
    programs = tuple(tuple(program) if i == device else p for i, p in enumerate(schedule.programs))
    return Schedule(schedule.name, schedule.placement, schedule.num_microbatches, programs, schedule.meta,
                    schedule.fused_backward)


def test_a_delayed_w_breaks_the_order_and_is_named():
    schedule = get_spec("v-zb").build(4, 8)
    swapped = _delay_first_w(schedule, 3)
    validate(swapped)  # W after its own B still holds: the order property is separate from validity
    breaks = w_order_breaks(swapped)
    assert len(breaks) == 1 and breaks[0].startswith("stage ") and "of W microbatch" in breaks[0], breaks
    assert not keeps_w_order(swapped) and keeps_w_order(schedule)


def test_vshape_simulate_reports_the_w_order(capsys):
    from megatron_vshape.cli import main

    assert main(["simulate", "--schedule", "v-half", "--stages", "4", "--microbatches", "8"]) == 0
    assert "W order       kept on every stage (TE's deferred W can serve it)" in capsys.readouterr().out
