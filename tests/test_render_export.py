"""Text forms, PyTorch CSV export/import (checked by PyTorch's own loader), chrome trace, pictures."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import types

import pytest

from megatron_vshape.schedules.core.actions import Action, Kind, parse_action
from megatron_vshape.schedules.core.schedule import Placement, Schedule, ScheduleError
from megatron_vshape.schedules.core.simulator import simulate
from megatron_vshape.schedules.export.torch_csv import from_torch_csv, parse_torch_csv, to_torch_csv
from megatron_vshape.schedules.export.trace import chrome_trace
from megatron_vshape.schedules.generators.registry import SCHEDULES, get_schedule
from megatron_vshape.schedules.lowering.validator import validate

ALL = list(SCHEDULES)
V_SCHEDULES = ["v-min", "v-half", "v-zb"]


@functools.cache
def _schedule(name: str, d: int = 4, m: int = 8) -> Schedule:
    return get_schedule(name, d, max(m, SCHEDULES[name].min_microbatches(d)))


# ---------------------------------------------------------------- text forms


def test_action_text_round_trip():
    for kind in Kind:
        for stage in (0, 7, 123):
            for mb in (0, 5, 511):
                action = Action(kind, stage, mb)
                assert parse_action(str(action)) == action
    with pytest.raises(ValueError):
        parse_action("X1.2")


@pytest.mark.parametrize("name", ALL)
def test_schedule_text_round_trip(name):
    schedule = _schedule(name)
    back = Schedule.from_text(schedule.to_text(), name, schedule.placement)
    assert back.programs == schedule.programs
    assert back.num_microbatches == schedule.num_microbatches


# ---------------------------------------------------------------- torch CSV


@pytest.mark.parametrize("merge", [None, False, True])
@pytest.mark.parametrize("name", ALL)
def test_torch_csv_round_trip(name, merge):
    schedule = _schedule(name)
    text = to_torch_csv(schedule, merge_backward=merge)
    assert len(text.strip().splitlines()) == schedule.num_devices
    back = from_torch_csv(text, name, schedule.placement)
    assert back.programs == schedule.programs
    assert back.num_microbatches == schedule.num_microbatches
    validate(back)
    if merge is None:  # the default export keeps the fused-backward timing model
        assert back.fused_backward == schedule.fused_backward
        assert simulate(back).makespan == simulate(schedule).makespan


def test_torch_csv_cells():
    schedule = get_schedule("1f1b", 2, 2)
    rows = to_torch_csv(schedule, merge_backward=False).strip().splitlines()
    assert rows[0] == "0F0,0F1,0I0,0W0,0I1,0W1"
    assert rows[1] == "1F0,1I0,1W0,1F1,1I1,1W1"
    assert schedule.fused_backward  # 1F1B never splits its backward: merged by default
    assert to_torch_csv(schedule).strip().splitlines()[1] == "1F0,1B0,1F1,1B1"
    split = get_schedule("v-half", 2, 2)
    assert "I" in to_torch_csv(split) and "B" not in to_torch_csv(split)


def test_torch_csv_import_variants():
    placement = Placement.looped(2)
    # Full backward B -> our B then W; blank cells (bubbles), comm/FSDP actions and a trailing
    # blank line are skipped; OVERLAP_F_B contributes its sub-actions in order.
    text = (
        "0UNSHARD,0F0,0SEND_F0,,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0I1,0W1,0REDUCE_GRAD\n"
        "1RECV_F0,1F0,(1F1;1B0)OVERLAP_F_B,1SEND_B0,1B1\n\n"
    )
    schedule = from_torch_csv(text, "t", placement)
    assert schedule.num_microbatches == 2
    assert schedule.to_text().splitlines() == [
        "F0.0 F0.1 B0.0 W0.0 B0.1 W0.1",
        "F1.0 F1.1 B1.0 W1.0 B1.1 W1.1",
    ]
    validate(schedule)
    assert not schedule.fused_backward  # I/W cells present: a split backward
    assert from_torch_csv(text, "t", placement, num_microbatches=2).num_microbatches == 2
    only_full = from_torch_csv("0F0,0B0\n1F0,1B0\n", "t", placement)
    assert only_full.fused_backward and only_full.to_text() == "F0.0 B0.0 W0.0\nF1.0 B1.0 W1.0"
    assert not from_torch_csv("0F0,0B0\n1F0,1B0\n", "t", placement, fused_backward=False).fused_backward


@pytest.mark.parametrize(
    "text, message",
    [
        ("0F0\n", "rows"),  # one row for two devices
        ("0F0,1F0\n1F0\n", "belongs to device 1"),  # stage 1 lives on device 1
        ("0F0,0Q1\n1F0\n", "cannot parse"),
        ("0F\n1F0\n", "no microbatch"),
        ("0F0\n5F0\n", "does not exist"),
    ],
)
def test_torch_csv_import_errors(text, message):
    with pytest.raises(ScheduleError, match=message):
        from_torch_csv(text, "bad", Placement.looped(2))


def test_parse_torch_csv_has_no_placement_checks():
    assert parse_torch_csv("0F0,3F0\n1F0,2F0\n") == (
        (Action(Kind.F, 0, 0), Action(Kind.F, 3, 0)),
        (Action(Kind.F, 1, 0), Action(Kind.F, 2, 0)),
    )


def _torch_load(tmp_path, schedule: Schedule, text: str):
    """Load ``text`` with PyTorch's own runtime loader and run PyTorch's own checks.

    ``_PipelineScheduleRuntime._load_csv`` runs ``_validate_schedule`` (counts, F before I/B,
    I before W, one rank per stage) and lowers the schedule with ``_add_send_recv`` (which
    raises on an order that cannot be given sends/receives); ``_simulate_comms_compute`` then
    dry-runs the compute + p2p program for deadlocks. The runtime's lowering also inserts
    UNSHARD/RESHARD/REDUCE_GRAD, which that dry run does not know, so we drop them first.
    """
    from torch.distributed.pipelining.schedules import (
        _ComputationType,
        _PipelineScheduleRuntime,
        _simulate_comms_compute,
    )

    path = tmp_path / f"{schedule.name}.csv"
    path.write_text(text)
    # The schedule constructor only reads these three fields of the first stage.
    fake_stage = types.SimpleNamespace(
        num_stages=schedule.num_stages, group_size=schedule.num_devices, group_rank=0
    )
    runtime = _PipelineScheduleRuntime([fake_stage], schedule.num_microbatches)
    runtime._load_csv(str(path))
    stage_to_rank = runtime.stage_index_to_group_rank
    assert stage_to_rank == {s: schedule.placement.device_of(s) for s in range(schedule.num_stages)}
    keep = {
        _ComputationType.FORWARD, _ComputationType.BACKWARD_INPUT, _ComputationType.BACKWARD_WEIGHT,
        _ComputationType.FULL_BACKWARD, _ComputationType.SEND_F, _ComputationType.RECV_F,
        _ComputationType.SEND_B, _ComputationType.RECV_B,
    }
    lowered = {
        rank: [a for a in actions if a.computation_type in keep]
        for rank, actions in runtime.pipeline_order_with_comms.items()
    }
    simulated = _simulate_comms_compute(lowered, lambda s: stage_to_rank[s], schedule.num_stages)
    return runtime, simulated


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("d", [2, 4])
@pytest.mark.parametrize("name", V_SCHEDULES)
def test_torch_loader_accepts_v_schedules(tmp_path, name, d, merge):
    schedule = get_schedule(name, d, 8)
    runtime, simulated = _torch_load(tmp_path, schedule, to_torch_csv(schedule, merge_backward=merge))
    computed = sum(1 for actions in simulated.values() for a in actions if a is not None and a.is_compute_op)
    expected = sum(len(p) for p in schedule.programs) - (
        sum(1 for p in schedule.programs for a, b in zip(p, p[1:])
            if a.kind is Kind.B and b == Action(Kind.W, a.stage, a.microbatch)) if merge else 0
    )
    assert computed == expected
    assert len(runtime.pipeline_order) == d


@pytest.mark.parametrize("name", [n for n in ALL if n not in V_SCHEDULES])
def test_torch_loader_accepts_looped_schedules(tmp_path, name):
    schedule = _schedule(name, 4, 8)
    _torch_load(tmp_path, schedule, to_torch_csv(schedule))


def test_torch_loader_rejects_a_schedule_without_w(tmp_path):
    """PyTorch needs every I's W: our W passes must be exported."""
    schedule = get_schedule("v-half", 2, 4)
    text = "\n".join(",".join(c for c in row.split(",") if "W" not in c)
                     for row in to_torch_csv(schedule).splitlines()) + "\n"
    with pytest.raises(AssertionError, match="I and W must have equal counts"):
        _torch_load(tmp_path, schedule, text)


# ---------------------------------------------------------------- chrome trace


def test_chrome_trace_structure():
    result = simulate(get_schedule("v-half", 4, 8))
    trace = json.loads(json.dumps(chrome_trace(result, us_per_unit=10.0)))
    events = trace["traceEvents"]
    passes = [e for e in events if e["ph"] == "X"]
    assert len(passes) == len(result.timeline) == 3 * 8 * 8
    names = {e["name"] for e in passes}
    assert names == {str(a) for a in result.timeline}
    for event in passes:
        action = parse_action(event["name"])
        interval = result.timeline[action]
        assert event["pid"] == 0 and event["tid"] == interval.device
        assert event["ts"] == pytest.approx(interval.start * 10.0)
        assert event["dur"] == pytest.approx((interval.end - interval.start) * 10.0)
        assert event["args"] == {
            "kind": action.kind.value, "stage": action.stage, "microbatch": action.microbatch,
            "chunk": result.schedule.placement.chunk_of(action.stage),
        }
    thread_names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert thread_names == {d: f"device {d}" for d in range(4)}
    counters = [e for e in events if e["ph"] == "C"]
    assert max(e["args"]["activations"] for e in counters) == pytest.approx(result.peak_memory_max)
    assert not [e for e in chrome_trace(result, memory=False)["traceEvents"] if e["ph"] == "C"]


# ---------------------------------------------------------------- pictures


def _colours(path) -> set[tuple[int, int, int]]:
    from matplotlib.image import imread

    pixels = imread(str(path))
    rgb = (pixels[..., :3] * 255).round().astype(int).reshape(-1, 3)
    return {tuple(p) for p in rgb.tolist()}


@pytest.mark.slow  # matplotlib: seconds per picture; in the README's test command
def test_plot_schedule_png(tmp_path):
    from megatron_vshape.schedules.export import render_plot

    result = simulate(get_schedule("v-half", 4, 8))
    path = render_plot.plot_schedule(result, tmp_path / "v.png")
    assert path.stat().st_size > 20_000
    colours = _colours(path)
    # Every kind x chunk fill colour is on the picture (they are solid boxes, so exact pixels).
    for kind in Kind:
        for chunk in range(2):
            rgb = tuple(round(c * 255) for c in render_plot._colour(kind, chunk, 2))
            assert any(sum(abs(a - b) for a, b in zip(rgb, c)) <= 3 for c in colours), (kind, chunk)
    assert (255, 255, 255) in colours  # idle time is white
    assert len(colours) > 50


@pytest.mark.slow  # matplotlib: seconds per picture; in the README's test command
def test_plot_schedule_svg_and_looped(tmp_path):
    from megatron_vshape.schedules.export.render_plot import plot_schedule

    result = simulate(get_schedule("1f1b", 3, 5))
    path = plot_schedule(result, tmp_path / "a.svg", title="1F1B")
    text = path.read_text()
    assert text.lstrip().startswith("<?xml") and "1F1B" in text


@pytest.mark.slow  # matplotlib: seconds per picture; in the README's test command
def test_plot_memory(tmp_path):
    from megatron_vshape.schedules.export.render_plot import plot_memory

    path = plot_memory(simulate(get_schedule("v-min", 4, 8)), tmp_path / "m.png")
    assert path.stat().st_size > 10_000 and len(_colours(path)) > 20


def test_plot_rejects_unknown_suffix(tmp_path):
    from megatron_vshape.schedules.export.render_plot import plot_schedule

    with pytest.raises(ValueError, match=r"\.png"):
        plot_schedule(simulate(get_schedule("1f1b", 2, 2)), tmp_path / "x.jpg")


@pytest.mark.slow
def test_schedules_import_without_torch_and_matplotlib():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "sys.modules['matplotlib'] = None\n"
        "import megatron_vshape.schedules.export.render_plot, megatron_vshape.schedules.export.trace\n"
        "import megatron_vshape.schedules.export.torch_csv, megatron_vshape.schedules.export.render_text\n"
        "import megatron_vshape.cli\n"
        "from megatron_vshape.schedules.generators.registry import get_schedule\n"
        "from megatron_vshape.schedules.core.simulator import simulate\n"
        "from megatron_vshape.schedules.export.trace import chrome_trace\n"
        "chrome_trace(simulate(get_schedule('v-half', 2, 2)))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
