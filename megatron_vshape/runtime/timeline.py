"""Where one executor call's wall time goes, per rank: compute, waiting, bookkeeping.

With ``build_forward_backward_func(..., record_timeline=True)`` each call records a
:class:`Timeline`: contiguous spans from the call's entry to its return, each in one
:class:`Category`. A span is closed by the next :meth:`Timeline.mark`, so the spans tile the call
with no gap and no overlap, and their sum is the call's wall time (the test checks this against a
clock outside the executor). What each category holds:

* ``F``, ``B``, ``W``: one pass (megatron's ``forward_step`` / ``backward_step`` / the stored weight
  gradients), including handing its output to the p2p outbox;
* ``wait-recv``: ``Work.wait()`` on a batch that receives (with or without a send in it);
* ``wait-send``: ``Work.wait()`` on a batch that only sends;
* ``grad-sync``: ``finalize_model_grads`` (data-parallel and embedding reductions);
* ``bookkeeping``: everything else: building the iteration (plan lookup, chunk state), posting
  batches (``batch_isend_irecv``), per-pass progress/stage bookkeeping, hooks, the return.

On CPU (gloo) a wait blocks the host, so the waits are the idle time. On GPU the host clock sees
launches, not kernels: there these numbers say where the *host* spent its time.

:func:`replay_idle` predicts each rank's idle from the measured pass durations of the same call,
replaying each rank's program of the lowering chain (``schedules/lowering/program.py``, the program the
executor ran; every pass starts as soon as its rank is free and its messages have arrived, ``comm`` seconds
after their sender's pass ended): what an executor without overhead would reach with exactly these
passes. :func:`summary_rows` puts it next to the measured idle; :func:`chrome_trace` writes the
spans for ``chrome://tracing`` / Perfetto.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_vshape.schedules.lowering.drive import drive
from megatron_vshape.schedules.lowering.program import RankProgram


class Category(enum.Enum):
    F = "F"
    B = "B"
    W = "W"
    H = "H"  # a vocabulary-parallel output pass (with its collectives)
    G = "G"  # a vocabulary shard's weight gradient
    WAIT_RECV = "wait-recv"
    WAIT_SEND = "wait-send"
    GRAD_SYNC = "grad-sync"
    BOOKKEEPING = "bookkeeping"

    __hash__ = object.__hash__


COMPUTE = (Category.F, Category.B, Category.W, Category.H, Category.G)
WAITS = (Category.WAIT_RECV, Category.WAIT_SEND)


@dataclass(frozen=True, slots=True)
class Span:
    category: Category
    start: float  # perf_counter seconds (one monotonic clock for every process of a host)
    end: float
    label: str = ""  # the action of a pass, the operation of a wait

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Timeline:
    """The spans of one call on one rank; each :meth:`mark` closes the span since the previous mark."""

    def __init__(self, clock=time.perf_counter):
        self._clock = clock
        self.start = self._last = clock()
        self.spans: list[Span] = []

    def mark(self, category: Category, label: str = "") -> None:
        now = self._clock()
        self.spans.append(Span(category, self._last, now, label))
        self._last = now

    @property
    def end(self) -> float:
        return self._last

    @property
    def wall(self) -> float:
        return self._last - self.start

    def totals(self) -> dict[Category, float]:
        out = dict.fromkeys(Category, 0.0)
        for span in self.spans:
            out[span.category] += span.seconds
        return out

    def passes(self) -> list[Span]:
        """The compute spans, in the order they ran (one per plan step)."""
        return [span for span in self.spans if span.category in COMPUTE]


def replay_idle(plans: Sequence[RankProgram], durations: Sequence[Sequence[float]], comm: float) -> list[float]:
    """Each rank's idle share of the makespan when every program step takes its measured duration.

    ``plans``: every rank's program (only each step's receives and sends are read, so a messages-level
    ``DevicePlan`` replays the same).

    ``durations[rank][i]`` is step ``i``'s seconds on that rank; a message arrives ``comm`` seconds
    after the pass that sends it ends. Pure arithmetic: an as-soon-as-possible run of the plans.
    """
    end: dict = {}  # message -> arrival time
    free = [0.0] * len(plans)

    def needs(device, index):
        return plans[device].steps[index].recvs

    def run(device, index):
        step = plans[device].steps[index]
        start = max([free[device]] + [end[msg] for msg in step.recvs])
        free[device] = start + durations[device][index]
        for msg in step.sends:
            end[msg] = free[device] + comm
        return step.sends

    cursor = drive([range(len(plan.steps)) for plan in plans], needs, run)
    if any(c < len(plan.steps) for c, plan in zip(cursor, plans)):
        raise ValueError("replay_idle: the plans deadlock")
    makespan = max(free)
    return [1.0 - sum(durations[r]) / makespan if makespan > 0 else 0.0 for r in range(len(plans))]


def simulated_idle(result) -> list[float]:
    """Each device's idle share in a :func:`~megatron_vshape.schedules.simulate` result, counted like a
    real call: from the first pass of any device to the last (the simulator's own bubble rate divides
    by the longest device's span, which leaves out a late device's wait before its first pass)."""
    intervals = list(result.timeline.values())
    makespan = max(i.end for i in intervals) - min(i.start for i in intervals)
    return [1.0 - work / makespan for work in result.work_each]


@dataclass(frozen=True)
class RankSummary:
    """One rank's measured call, and the idle the replay predicts for it.

    Shares are of the *pipeline's* time: from the first rank's entry to the last rank's return (one
    clock for every process of a host), less the gradient reduction. A rank that returns early
    idles until the last one is done (``outside``: its time outside the call, before and after), as
    the replay's and the simulator's idle count it.
    """

    rank: int
    wall: float
    totals: dict[Category, float]
    predicted_idle: float  # from replay_idle
    span: float  # first entry to last return, over every rank

    @property
    def pipeline(self) -> float:
        """The pipeline's span less this rank's gradient reduction: what the bubble is a share of."""
        return self.span - self.totals[Category.GRAD_SYNC]

    @property
    def outside(self) -> float:
        return self.span - self.wall

    def share(self, *categories: Category) -> float:
        return sum(self.totals[c] for c in categories) / self.pipeline if self.pipeline > 0 else 0.0

    @property
    def measured_idle(self) -> float:
        """Waits, bookkeeping and time outside the call: the pipeline time this rank computed nothing."""
        return self.share(*WAITS, Category.BOOKKEEPING) + (self.outside / self.pipeline if self.pipeline > 0 else 0.0)


def summarize(plans: Sequence[RankProgram], timelines: Sequence[Timeline], comm: float) -> list[RankSummary]:
    """Per-rank summaries of one call (``timelines[rank]`` ran ``plans[rank]``, all on one host's clock)."""
    durations = [[span.seconds for span in tl.passes()] for tl in timelines]
    for rank, (plan, steps) in enumerate(zip(plans, durations)):
        if len(steps) != len(plan.steps):
            raise ValueError(f"rank {rank}: timeline has {len(steps)} passes, plan {len(plan.steps)} steps")
    predicted = replay_idle(plans, durations, comm)
    span = max(tl.end for tl in timelines) - min(tl.start for tl in timelines)
    return [RankSummary(rank, tl.wall, tl.totals(), predicted[rank], span) for rank, tl in enumerate(timelines)]


# One column per category of format_rows, in its order (the compute categories include the vocabulary's H and G).
HEADER = (f"{'schedule':14s} {'rank':>4s} {'wall ms':>8s} "
          + " ".join(f"{c.value:>6s}" for c in COMPUTE) + f" {'w-recv':>6s} "
          f"{'w-send':>6s} {'bookk':>6s} {'gsync':>6s} {'outsd':>6s} {'idle%':>6s} {'pred%':>6s} {'sim%':>6s} "
          f"{'stg%':>6s}")


def format_rows(name: str, summaries: Sequence[RankSummary], simulated: float | None = None,
                staged: float | None = None) -> list[str]:
    """Table lines (see :data:`HEADER`): ms per category and outside the call; idle% measured, pred%
    replayed, sim% the simulator under the typical chunk's costs, stg% under each stage's measured costs."""
    lines = []
    for s in summaries:
        ms = [1000 * s.totals[c] for c in (*COMPUTE, *WAITS, Category.BOOKKEEPING, Category.GRAD_SYNC)]
        ms.append(1000 * s.outside)
        sims = " ".join("" if value is None else f"{100 * value:6.1f}" for value in (simulated, staged))
        lines.append(f"{name:14s} {s.rank:4d} {1000 * s.wall:8.1f} " + " ".join(f"{v:6.1f}" for v in ms)
                     + f" {100 * s.measured_idle:6.1f} {100 * s.predicted_idle:6.1f} {sims}".rstrip())
    return lines


def chrome_trace(runs: dict[str, Sequence[Timeline]]) -> dict:
    """Chrome trace events: one process per run, one thread per rank, one complete event per span
    (microseconds from the run's earliest start, so the runs line up side by side)."""
    events = []
    for pid, (name, timelines) in enumerate(runs.items()):
        origin = min((tl.start for tl in timelines), default=0.0)
        for rank, tl in enumerate(timelines):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": rank,
                           "args": {"name": f"rank {rank}"}})
            for span in tl.spans:
                events.append({"ph": "X", "pid": pid, "tid": rank, "cat": span.category.value,
                               "name": span.label or span.category.value,
                               "ts": (span.start - origin) * 1e6, "dur": span.seconds * 1e6})
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
