"""What runtime/p2p.py really issues is NCCL-safe: its torch.distributed calls, recorded and replayed.

``test_p2p_nccl_model.py`` checks the exchange *programs*. Here a recording stand-in replaces
``torch.distributed`` inside ``runtime/p2p.py``: every ``batch_isend_irecv`` becomes a POST (its
transfers labelled by the message each tensor carries), every first ``Work.wait()`` on a batch a
WAIT, and the driver (the executor's loop: advance, take the receives, compute, hand over the
sends; then finish) adds a COMPUTE per pass. Each rank's recording (warm-up, then one iteration)
is replayed through ``schedules.nccl_model`` under both queue settings. The driver runs each rank
alone: the stand-in's works complete at once, so nothing blocks and the recording is the order in
which the runtime issues, which is what NCCL's rules are about.

The mutation test posts the next step's receives before the step's compute (the old receive
window) inside ``PlanExchange.advance``: every program-level check still passes, this must not.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_vshape.runtime import p2p
from megatron_vshape.schedules.core.schedule import Costs
from megatron_vshape.schedules.generators.registry import get_schedule
from megatron_vshape.schedules.lowering.exchange import (
    Communicator,
    Op,
    OpKind,
    Transfer,
    exchange_programs,
    pipeline_pairs,
)
from megatron_vshape.schedules.lowering.messages import lower
from megatron_vshape.schedules.lowering.nccl_model import NcclDeadlock, run_nccl_model


@dataclasses.dataclass(frozen=True)
class _Group:
    lo: int
    hi: int


class _Work:
    def __init__(self, recorder, position):
        self._recorder, self._position = recorder, position

    def wait(self):
        self._recorder.waited(self._position)

    def is_completed(self):
        return True


class _Recorder:
    """Stands in for ``torch.distributed`` in runtime/p2p.py on one rank (pipeline rank = global rank)."""

    isend, irecv = "isend", "irecv"

    def __init__(self, rank: int, labels: dict):
        self.rank, self._labels = rank, labels
        self.segments: list[list[Op]] = []
        self._waited: set[int] = set()

    def segment(self) -> None:
        self.segments.append([])
        self._waited = set()

    @property
    def ops(self) -> list[Op]:
        return self.segments[-1]

    @staticmethod
    def P2POp(fn, tensor, peer, group):  # noqa: N802 (torch's name)
        return fn, tensor, peer, group

    def batch_isend_irecv(self, ops):
        transfers, comm = [], None
        for fn, tensor, peer, group in ops:
            comm = Communicator("pair", group.lo, group.hi)
            msg = self._labels.get(tensor.data_ptr())
            transfers.append(Transfer(self.rank, peer, msg) if fn == self.isend else Transfer(peer, self.rank, msg))
        self.ops.append(Op(OpKind.POST, comm, tuple(transfers)))
        return [_Work(self, len(self.ops) - 1) for _ in ops]

    def waited(self, position: int) -> None:
        if position not in self._waited:  # the first wait on a batch is the one that orders anything
            self._waited.add(position)
            self.ops.append(Op(OpKind.WAIT, index=position))

    def compute(self, index: int) -> None:
        self.ops.append(Op(OpKind.COMPUTE, index=index))


def _record(plans, programs, exchange_type=p2p.PlanExchange) -> list[list[list[Op]]]:
    """Each rank's recorded (warm-up, iteration), driven the way Iteration._execute drives PlanExchange."""
    d = len(plans)
    recorded = []
    for rank in range(d):
        labels, keep = {}, []  # tensor storage -> message; keep every tensor alive (no address reuse)

        def make_buffer(msg, labels=labels, keep=keep):
            tensor = torch.empty(1)
            labels[tensor.data_ptr()] = msg
            keep.append(tensor)
            return tensor

        recorder = _Recorder(rank, labels)
        groups = {pair: _Group(*pair) for pair in pipeline_pairs(d) if rank in pair}
        saved, p2p.dist = p2p.dist, recorder
        try:
            pair_groups = p2p.PairGroups(tuple(range(d)), rank, groups)
            recorder.segment()
            pair_groups._warm_up()
            recorder.segment()
            exchange = exchange_type(programs[rank], pair_groups, make_buffer)
            for index, step in enumerate(plans[rank].steps):
                exchange.advance(index)
                for msg in step.recvs:
                    exchange.recv(msg)
                recorder.compute(index)
                for msg in step.sends:
                    exchange.send(msg, make_buffer(msg))
            exchange.finish()
        finally:
            p2p.dist = saved
        recorded.append(recorder.segments)
    return recorded


class _EarlyReceives(p2p.PlanExchange):
    """The mutation: when a step's compute is reached, post the next step's receives before it."""

    def __init__(self, program, *args):
        super().__init__(list(program), *args)

    def advance(self, step: int) -> None:
        super().advance(step)  # consumed COMPUTE(step): move the next step's receiving POSTs before it
        program, here = self._program, self._next - 1
        end = next((i for i in range(here + 1, len(program)) if program[i].kind is OpKind.COMPUTE), len(program))
        early = [i for i in range(here + 1, end) if program[i].kind is OpKind.POST  # receive-only batches
                 and all(t.dst == self._groups.rank for t in program[i].transfers)]
        if not early:
            return
        order = list(range(here)) + early + [i for i in range(here, len(program)) if i not in early]
        where = {old: new for new, old in enumerate(order)}
        self._program = [op._replace(index=where[op.index]) if op.kind is OpKind.WAIT else op
                         for op in (program[i] for i in order)]
        self._next = here
        for _ in early:
            self._issue(self._program[self._next])
        self._next += 1  # COMPUTE(step)


def _replay(recorded, single_queue):
    run_nccl_model(recorded, single_queue)


MEASURED = Costs(f=1.0, b=1.45, w=0.55, comm=0.08)  # a CPU run's measured ratios, not F = B = W


@pytest.mark.parametrize("costs", [Costs(), MEASURED], ids=["unit", "measured"])
@pytest.mark.parametrize("name,d,m", [("1f1b", 2, 3), ("1f1b", 4, 8), ("zb-h1", 4, 8), ("v-half", 4, 8),
                                      ("v-zb", 2, 8), ("v-zb", 4, 8), ("v-min", 4, 8), ("zb-2p", 4, 5),
                                      ("interleaved-1f1b", 4, 8)])
def test_recorded_runtime_calls_are_nccl_safe(name, d, m, costs):
    plans = lower(get_schedule(name, d, m, costs))
    recorded = _record(plans, exchange_programs(plans, costs))
    for single_queue in (True, False):
        _replay(recorded, single_queue)
    # the recording is the program: nothing issued that the program-level model did not check
    for rank, program in enumerate(exchange_programs(plans, costs)):
        assert recorded[rank][1] == list(program), rank


@pytest.mark.parametrize("name,d,m", [("v-half", 4, 8), ("1f1b", 2, 3), ("zb-2p", 4, 5)])
def test_posting_the_next_steps_receives_early_hangs_on_one_queue(name, d, m):
    plans = lower(get_schedule(name, d, m))
    recorded = _record(plans, exchange_programs(plans), _EarlyReceives)
    assert any(seg != list(prog) for seg, prog in zip((r[1] for r in recorded), exchange_programs(plans)))
    with pytest.raises(NcclDeadlock):
        _replay(recorded, single_queue=True)
