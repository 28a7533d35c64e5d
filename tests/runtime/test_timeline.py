"""runtime/timeline.py: a call's spans tile its wall time, and the idle prediction is the simulator's.

The spawned test runs the real executor (V-ZB, 2 gloo ranks, a tiny GPT) with ``record_timeline``
and compares the recorded wall time with a clock read outside the executor, around the call.
"""

from __future__ import annotations

import json
import time

import pytest

from megatron_vshape.runtime.timeline import (
    COMPUTE,
    Category,
    Timeline,
    chrome_trace,
    replay_idle,
    summarize,
)
from megatron_vshape.schedules.core.schedule import Costs
from megatron_vshape.schedules.core.simulator import simulate
from megatron_vshape.schedules.generators.registry import get_schedule
from megatron_vshape.schedules.lowering.messages import lower


@pytest.mark.parametrize("name", ["v-zb", "v-half", "zb-h1"])
def test_replaying_the_simulators_own_durations_gives_its_idle(name):
    """Split schedules (every pass its own step): the replay is the simulator's as-soon-as-possible run."""
    costs = Costs(f=1.0, b=1.3, w=0.6, comm=0.1)
    schedule = get_schedule(name, 4, 8, costs)
    plans = lower(schedule)
    durations = [[schedule.pass_cost(step.action, costs) for step in plan.steps] for plan in plans]
    result = simulate(schedule, costs)
    # the simulator's makespan is the longest device's own span; every rank of a call starts together
    intervals = list(result.timeline.values())
    makespan = max(i.end for i in intervals) - min(i.start for i in intervals)
    want = [1.0 - work / makespan for work in result.work_each]
    assert replay_idle(plans, durations, costs.comm) == pytest.approx(want, abs=1e-9)


def test_marks_tile_the_call_and_the_trace_keeps_every_span():
    ticks = iter([0.0, 1.0, 3.0, 3.5, 6.0])
    timeline = Timeline(clock=lambda: next(ticks))
    for category, label in ((Category.BOOKKEEPING, ""), (Category.F, "F0.0"), (Category.WAIT_RECV, "post"),
                            (Category.B, "B0.0")):
        timeline.mark(category, label)
    assert timeline.wall == 6.0 and sum(timeline.totals().values()) == 6.0
    assert [s.label for s in timeline.passes()] == ["F0.0", "B0.0"]
    events = [e for e in chrome_trace({"run": [timeline]})["traceEvents"] if e["ph"] == "X"]
    assert [(e["ts"], e["dur"]) for e in events] == [(0.0, 1e6), (1e6, 2e6), (3e6, 0.5e6), (3.5e6, 2.5e6)]


def _worker(rank, world_size, name, microbatches):
    import torch
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_vshape.megatron.cpu_mode import enable_cpu_mode
    from megatron_vshape.runtime import build_forward_backward_func, build_model_chunks
    from megatron_vshape.testing.tiny_gpt import ModelSettings, build_gpt, forward_step, make_config, microbatch

    enable_cpu_mode()
    parallel_state.initialize_model_parallel(1, world_size)
    model = ModelSettings()
    model_parallel_cuda_manual_seed(model.seed)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    func = build_forward_backward_func(name, record_timeline=True)
    placement = func.schedule(world_size, microbatches).placement
    config = make_config(model, world_size, 1, placement.chunks_per_device, False)
    config.finalize_model_grads_func = finalize_model_grads
    chunks = build_model_chunks(placement, pp_rank, lambda cs, pgs: build_gpt(
        config, model, cs.pre_process, cs.post_process, cs.vp_stage, pgs, placement.num_stages))
    ddp = [DistributedDataParallel(config, DistributedDataParallelConfig(), c) for c in chunks]
    data = [dict(microbatch(model, i), index=i) for i in range(microbatches)]
    out = []
    for _ in range(2):
        torch.distributed.barrier()
        before = time.perf_counter()
        func(forward_step_func=forward_step, data_iterator=[iter(data) for _ in ddp], model=ddp,
             num_microbatches=microbatches, seq_length=model.seq_length, micro_batch_size=model.micro_batch_size)
        after = time.perf_counter()
        out.append((before, after, func.last_spans))
    parallel_state.destroy_model_parallel()
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_recorded_categories_add_up_to_the_wall_time_of_a_real_call(tmp_path):
    from megatron_vshape.testing import spawn

    name, microbatches = "v-zb", 4
    per_rank = spawn(_worker, 2, (name, microbatches), timeout=200)
    plans = lower(get_schedule(name, 2, microbatches))
    for rank, calls in enumerate(per_rank):
        for before, after, timeline in calls:
            spans = timeline.spans
            assert all(a.end == b.start for a, b in zip(spans, spans[1:]))  # contiguous, no overlap
            assert before <= timeline.start and timeline.end <= after
            outside = after - before
            assert abs(sum(timeline.totals().values()) - timeline.wall) < 1e-9
            assert timeline.wall == pytest.approx(outside, abs=2e-3 + 0.01 * outside)
            assert [s.label for s in timeline.passes()] == [str(step.action) for step in plans[rank].steps]
            assert all(s.seconds >= 0 for s in spans)
            assert timeline.totals()[Category.GRAD_SYNC] > 0
            assert sum(timeline.totals()[c] for c in COMPUTE) > 0.3 * timeline.wall
    last = [calls[-1][2] for calls in per_rank]
    for summary in summarize(plans, last, comm=0.0):
        assert 0.0 <= summary.predicted_idle < 1.0 and 0.0 <= summary.measured_idle < 1.0
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(chrome_trace({name: last})))
    assert len(json.loads(path.read_text())["traceEvents"]) > sum(len(p.steps) for p in plans)


def test_the_table_header_has_a_column_for_each_value_of_a_row():
    """format_rows prints every compute category (F, B, W and the vocabulary's H and G), the waits,
    bookkeeping, gsync and outside: the header names as many columns."""
    from megatron_vshape.runtime.timeline import COMPUTE, HEADER, WAITS, Category, RankSummary, format_rows

    totals = dict.fromkeys(Category, 0.001)
    row = format_rows("v-zb", [RankSummary(0, 0.01, totals, 0.0, 0.01)], 0.02, 0.03)[0]
    assert len(row.split()) == len(HEADER.split()) - 1  # "wall ms" is one column in two words
    assert all(f" {c.value} " in HEADER for c in COMPUTE) and len(WAITS) == 2
