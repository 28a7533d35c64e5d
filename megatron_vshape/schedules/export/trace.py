"""Chrome trace-event JSON of a simulated schedule (open in chrome://tracing or ui.perfetto.dev).

One process (pid 0), one thread per device (tid = device), one complete ("X") event per pass
named like the action (``F3.7``), with its kind, stage, microbatch and chunk in ``args``.
Times are the simulator's cost units times ``us_per_unit`` microseconds. With ``memory=True``
each device also gets a counter ("C") track of its activation memory.
"""

from __future__ import annotations

import json

from ..core.simulator import SimulationResult


def chrome_trace(result: SimulationResult, us_per_unit: float = 1000.0, memory: bool = True) -> dict:
    schedule = result.schedule
    placement = schedule.placement
    events: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
         "args": {"name": f"{schedule.name} (d={schedule.num_devices}, m={schedule.num_microbatches})"}},
    ]
    for device in range(schedule.num_devices):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": device,
                       "args": {"name": f"device {device}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": device,
                       "args": {"sort_index": device}})
    passes = sorted(result.timeline.items(), key=lambda item: (item[1].device, item[1].start))
    for action, interval in passes:
        events.append({
            "name": str(action),
            "cat": action.kind.value,
            "ph": "X",
            "pid": 0,
            "tid": interval.device,
            "ts": interval.start * us_per_unit,
            "dur": (interval.end - interval.start) * us_per_unit,
            "args": {
                "kind": action.kind.value,
                "stage": action.stage,
                "microbatch": action.microbatch,
                "chunk": placement.chunk_of(action.stage),
            },
        })
    if memory:
        for device, timeline in enumerate(result.memory_timeline):
            for time, level in timeline:
                events.append({"name": f"activation memory d{device}", "ph": "C", "pid": 0, "tid": device,
                               "ts": time * us_per_unit, "args": {"activations": level}})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {**result.to_json(), "us_per_unit": us_per_unit},
    }


def chrome_trace_json(result: SimulationResult, us_per_unit: float = 1000.0, memory: bool = True) -> str:
    return json.dumps(chrome_trace(result, us_per_unit, memory))
