"""The cyclic garbage collector is paused while schedules are built, simulated and validated, and the
caller's setting comes back afterwards: nested, on an exception, and with threads overlapping."""

import gc
import threading

import pytest

from megatron_vshape.schedules.core.gc_pause import gc_paused
from megatron_vshape.schedules.core.schedule import Costs
from megatron_vshape.schedules.core.simulator import simulate
from megatron_vshape.schedules.generators.registry import get_schedule
from megatron_vshape.schedules.lowering.validator import validate


@pytest.fixture(autouse=True)
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_paused_inside_and_back_on_after_nesting_and_errors():
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled(), "the inner pause must not turn collection back on"
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_caller_who_turned_collection_off_keeps_it_off():
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()


def test_overlapping_threads_turn_it_back_on_only_when_the_last_leaves():
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with gc_paused():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second():
        first_in.wait(5)
        with gc_paused():
            second_in.set()
            first_out.wait(5)
            seen["after the first left"] = gc.isenabled()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert seen == {"after the first left": False}
    assert gc.isenabled()


def _collections_during(work) -> int:
    started = []

    def count(phase, info):
        if phase == "start":
            started.append(info["generation"])

    gc.collect()  # counts back to zero: no collection falls due in the few allocations before the pause
    gc.callbacks.append(count)
    try:
        work()
    finally:
        gc.callbacks.remove(count)
    return len(started)


def test_building_simulating_and_validating_a_large_schedule_run_no_collection():
    """At most one collection each: the young generation's count, left over the threshold by the pause,
    is collected once just after it ends (without the pause: 138 while building, 39 while validating)."""
    costs = Costs.parse("f=1,b=1.1,w=0.9,comm=0.05")
    built = {}
    assert _collections_during(lambda: built.setdefault("s", get_schedule("v-zb", 16, 64, costs))) <= 1
    assert _collections_during(lambda: simulate(built["s"], costs)) <= 1
    assert _collections_during(lambda: validate(built["s"])) <= 1
    assert gc.isenabled()
