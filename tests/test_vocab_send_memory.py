"""The simulator's memory timeline holds the hidden gradient's send buffers of the vocabulary passes
(``VocabWork.send``, schedules/core/vocab_embedding.send_events), as the runtime holds them (runtime/vocab_h.py):
every device but the last stage's makes one at each H and lets it go at its next H or its G(k), so it holds one
at most, and none is left at the call's end. Pure Python."""

from __future__ import annotations

import pytest

from megatron_vshape.schedules.core.schedule import Costs, VocabWork
from megatron_vshape.schedules.core.simulator import simulate
from megatron_vshape.schedules.generators.registry import get_schedule, schedule_names

WITHOUT = Costs(f=1.0, b=1.3, w=0.8, vocab=VocabWork(1.0, 1.0, 1.0, 0.5, embedding=0.1, tokens=0.01))
SEND = 0.7  # units of one V chunk F's activation, like ``embedding``; the timeline counts half (one microbatch / L/d)


@pytest.mark.parametrize("name", schedule_names())
def test_each_device_but_the_last_stages_holds_one_send_buffer_at_its_peak_and_none_at_the_end(name):
    schedule = get_schedule(name, 4, 8, WITHOUT)
    with_send = Costs(f=1.0, b=1.3, w=0.8, vocab=VocabWork(1.0, 1.0, 1.0, 0.5, embedding=0.1, tokens=0.01, send=SEND))
    before, after = simulate(schedule, WITHOUT), simulate(schedule, with_send)
    assert after.makespan == before.makespan  # memory only
    last = schedule.placement.device_of(schedule.num_stages - 1)
    for device, (old, new) in enumerate(zip(before.peak_memory, after.peak_memory)):
        assert new - old == pytest.approx(0.0 if device == last else SEND / 2), (name, device)
        assert after.memory_timeline[device][-1][1] == pytest.approx(0.0), (name, device)
