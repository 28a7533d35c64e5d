"""The schedule watchdog on its own: it fires on a stalled record, only then, once, and says where."""

import io
import threading
import time

import pytest

from megatron_vshape.runtime.watchdog import EXIT_CODE, Progress, ScheduleWatchdog


def make(timeout=0.3):
    aborted, out = threading.Event(), io.StringIO()
    codes = []
    dog = ScheduleWatchdog(timeout, grace=0.0, poll=0.02, out=out,
                           abort=lambda code: (codes.append(code), aborted.set()))
    return dog, aborted, out, codes


def test_a_stalled_step_is_reported_with_where_and_what_it_waits_for():
    dog, aborted, out, codes = make()
    progress = Progress("v-zb", rank=2, pp_rank=1, pending=lambda: "receive of gradient 3 from pipeline rank 2")
    with dog.watch(progress):
        progress.finished("F1.2")
        progress.at("pass", step=7, action="B1.2")
        assert aborted.wait(5)
    assert codes == [EXIT_CODE]
    line = out.getvalue().strip()
    assert line.count("\n") == 0
    for part in ("rank 2 (pipeline rank 1)", "schedule v-zb", "step 7 (B1.2)",
                 "waiting for: receive of gradient 3 from pipeline rank 2", "last finished: F1.2"):
        assert part in line, line


def test_progress_keeps_it_quiet_and_disarming_stops_it():
    dog, aborted, out, codes = make(timeout=0.3)
    progress = Progress("v-half", rank=0, pp_rank=0)
    with dog.watch(progress):
        for step in range(20):
            progress.at("pass", step, f"F0.{step}")
            time.sleep(0.03)
            progress.finished(f"F0.{step}")
    time.sleep(0.6)  # disarmed: an idle executor between iterations is not a stall
    assert not aborted.is_set() and out.getvalue() == ""


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="--pipeline-watchdog must be > 0"):
        ScheduleWatchdog(0)


def test_the_first_rank_to_fire_makes_every_other_rank_report_where_it_is():
    """The flag goes through the job's store: a rank that is not stuck itself still says where it is."""
    import torch.distributed as dist

    store = dist.HashStore()
    dogs, events, outs = [], [], []
    for _ in range(2):
        event, out = threading.Event(), io.StringIO()
        dogs.append(ScheduleWatchdog(0.3, grace=0.0, poll=0.02, out=out, store=store,
                                     abort=lambda code, e=event: e.set()))
        events.append(event)
        outs.append(out)
    stuck = Progress("v-half", rank=0, pp_rank=0)
    moving = Progress("v-half", rank=1, pp_rank=1)
    with dogs[0].watch(stuck), dogs[1].watch(moving):
        stuck.at("pass", 3, "F0.1")
        for step in range(100):
            if events[1].is_set():
                break
            moving.at("pass", step, f"B1.{step}")
            time.sleep(0.02)
        assert events[0].wait(5) and events[1].wait(5)
    assert "made no progress for 0.3s" in outs[0].getvalue()
    assert "stopped: another rank's watchdog fired" in outs[1].getvalue()
    assert "rank 1 (pipeline rank 1)" in outs[1].getvalue()


def watchdog_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "vshape-watchdog"]


def test_no_watchdog_thread_outlives_the_call_it_watches():
    """A daemon thread still alive at interpreter exit, inside a C++ store call, aborts the process
    ("terminate called without an active exception"); so the thread lives only while a call runs,
    and ending the call does not wait out the poll interval."""
    dog = ScheduleWatchdog(30, grace=0.0, poll=60, out=io.StringIO(), abort=lambda code: None)
    progress = Progress("v-half", rank=0, pp_rank=0)
    started = time.monotonic()
    for step in range(5):
        with dog.watch(progress):
            assert len(watchdog_threads()) == 1
            progress.at("pass", step, f"F0.{step}")
        assert watchdog_threads() == []
    assert time.monotonic() - started < 30, "leaving a watch waited for the poll interval"
