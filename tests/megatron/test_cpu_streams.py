"""The CPU stand-ins for CUDA streams and events (megatron_vshape.megatron.cpu_streams), and Megatron's own
schedule node (the unit of its combined 1F1B) running on them: the call that stopped the issue's probe
(``record_stream`` on a node's inputs) and the stream and event calls around it.

The 4-rank run of Megatron's combined interleaved 1F1B through pretrain_gpt.py is in test_recipes.py
(``-m extended``)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_vshape.megatron import cpu_streams
from megatron_vshape.megatron.cpu_mode import enable_cpu_mode
from megatron_vshape.megatron.cpu_streams import CpuEvent, CpuStream


def test_the_current_stream_is_the_one_entered_per_thread_and_restored():
    side, inner = CpuStream(), CpuStream(priority=CpuStream.priority_range()[1])
    default = cpu_streams.current_stream()
    assert default is cpu_streams.default_stream() and inner.priority == -1
    seen_by_other_thread = []
    with cpu_streams.stream(side):
        assert cpu_streams.current_stream() is side
        worker = threading.Thread(target=lambda: seen_by_other_thread.append(cpu_streams.current_stream()))
        worker.start()
        worker.join()
        with pytest.raises(ValueError), cpu_streams.stream(inner):
            assert cpu_streams.current_stream() is inner
            raise ValueError("leaves the context")
        assert cpu_streams.current_stream() is side  # restored on the way out of the inner context
        with cpu_streams.stream(None):  # torch: no change
            assert cpu_streams.current_stream() is side
    assert cpu_streams.current_stream() is default
    assert seen_by_other_thread == [default]


def test_events_record_their_stream_and_time_like_cuda_events():
    side = CpuStream()
    start, end = CpuEvent(enable_timing=True), CpuEvent(enable_timing=True)
    start.record()
    time.sleep(0.02)
    side.record_event(end)
    assert start.stream is cpu_streams.default_stream() and end.stream is side
    assert start.query() and end.query()
    assert 15.0 <= start.elapsed_time(end) < 5000.0  # milliseconds, as torch.cuda.Event reports
    with pytest.raises(RuntimeError, match="enable_timing"):
        CpuEvent().elapsed_time(end)
    with pytest.raises(RuntimeError, match="recorded"):
        CpuEvent(enable_timing=True).elapsed_time(end)
    side.wait_event(end)
    side.wait_stream(cpu_streams.default_stream())
    with pytest.raises(TypeError, match="wait_stream"):
        side.wait_stream("not a stream")


def test_record_stream_is_a_no_op_for_cpu_tensors_and_checks_its_stream():
    tensor = torch.ones(3)
    cpu_streams.record_stream(tensor, CpuStream())
    assert tensor.tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(TypeError, match="record_stream"):
        cpu_streams.record_stream(tensor, object())


def test_megatron_schedule_node_runs_on_the_cpu_stand_ins():
    """Megatron's ScheduleNode on its communication stream, with an event and free_input, as its combined
    1F1B runs each MoE dispatch/combine: forward and backward give the right values and gradients, and
    the freed input really is freed."""
    enable_cpu_mode()  # installs the stand-ins (idempotent; the process-wide CPU mode the runtime tests use)
    from megatron.core.pipeline_parallel import utils

    assert torch.cuda.Stream is CpuStream and torch.Tensor.record_stream is cpu_streams.record_stream
    comm = CpuStream(priority=-1)
    ran_on = []

    def forward(x):
        ran_on.append(torch.cuda.current_stream())
        return x * 3.0

    node = utils.ScheduleNode(forward, comm, torch.cuda.Event(), free_input=True, name="dispatch")
    source = torch.tensor([1.0, 2.0], requires_grad=True)
    given = source * 1.0  # a non-leaf input, as a layer's output would be
    out = node.forward(given)
    assert out.tolist() == [3.0, 6.0] and ran_on == [comm]
    assert given.untyped_storage().size() == 0  # free_input: record_stream, then the storage is released
    grad = node.backward(torch.tensor([1.0, -1.0]))
    assert grad.tolist() == [3.0, -3.0]
    assert node.event.stream is comm and torch.cuda.current_stream() is cpu_streams.default_stream()
