"""Blocking point-to-point exchanges of Megatron's own pipeline schedules (1F1B, interleaved 1F1B).

Megatron-LM's ``forward_backward_pipelining_*`` functions exchange activations and gradients with
blocking calls (``send_forward_recv_backward`` and friends: ``batch_isend_irecv``, then wait on
every request before the next pass). A device therefore sits idle while its own message crosses
the link after every F (to the next stage) and every backward (to the previous stage), and the
receiver cannot start before the transfer ends. The paper's 1F1B and 1F1B-R baselines ran these
functions.

The authors' runtime for the V schedules (and ZB) issues sends and receives as separate nodes at
their planned times and waits only right before the pass that needs the data, so there a message
delays only the dependent pass on the other device: the simulator's ``comm`` latency.

So for Megatron's schedules each stage's F and B pass is lengthened by the transfer time of the
message it sends (per link: NVLink inside a node, the inter-node network across nodes), and the
simulator's edge latency drops to 0 (the whole transfer is already in the sender's pass). In steady state the device next to a slow link then paces the whole pipeline,
as it does on a real cluster.
"""

from __future__ import annotations

from collections.abc import Callable

from ..schedules.core.schedule import Costs, Placement, StageWork
from ..schedules.generators.registry import SCHEDULES

# Schedules that Megatron-LM itself runs (blocking p2p); every other one runs on an
# asynchronous-p2p runtime (the authors' fork for the paper's V and ZB schedules, this project's
# executor otherwise).
MEGATRON_SCHEDULES = frozenset({"1f1b", "interleaved-1f1b"})


def blocks_on_p2p(base: str) -> bool:
    return base in MEGATRON_SCHEDULES


def blocking_costs(base: str, costs: Costs, pp: int, send_time: Callable[[int, int], float]) -> Costs:
    """``costs`` with each stage's F and B lengthened by the message it sends (``send_time(a, b)``:
    seconds from pipeline device a to b, latency included) and no separate edge latency."""
    chunks = SCHEDULES[base].chunks_per_device()
    placement = Placement.looped(pp, chunks)
    scale = placement.layer_scale
    f_stage, b_stage = costs.f * scale, costs.b * scale
    stages = []
    for stage in range(placement.num_stages):
        device = placement.device_of(stage)
        send_f = send_time(device, placement.device_of(stage + 1)) if stage + 1 < placement.num_stages else 0.0
        send_b = send_time(device, placement.device_of(stage - 1)) if stage > 0 else 0.0
        # a message between two stages of one device (never the case on a looped placement with
        # pp > 1) is a local hand-over: no transfer
        send_f = 0.0 if stage + 1 < placement.num_stages and placement.device_of(stage + 1) == device else send_f
        send_b = 0.0 if stage > 0 and placement.device_of(stage - 1) == device else send_b
        # on top of the stage's own work (per-stage costs of an uneven layout), if any
        own = costs.stages[stage] if costs.stages else StageWork()
        stages.append(StageWork(f=own.f + send_f / f_stage, b=own.b + send_b / b_stage, w=own.w, memory=own.memory))
    return Costs(costs.f, costs.b, costs.w, 0.0, tuple(stages))
