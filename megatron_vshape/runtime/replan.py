"""Re-planning from measured costs: time F, B, W and p2p during the first iterations, then rebuild.

Schedules are built from costs (F, B, W per V chunk, and one message). At start the executor only
knows the idealised F = B = W = 1, comm = 0; real layers are not like that, and zero-bubble schedules
earn their keep by knowing the real ratios. With ``--pipeline-costs auto`` the executor:

1. runs one warm-up iteration unmeasured (allocations, first-call overheads), then times every pass of
   the next ``iterations`` training iterations (:class:`PassClock`: CUDA events on GPU, because a host
   clock only sees kernel launches there; ``perf_counter`` on CPU);
2. reduces them on each rank to one median time per kind **and stage**, per V chunk of layers (a
   looped stage holds two chunks' worth of layers: its times are halved), and measures one message
   (a ring exchange of an activation over the pipeline group);
3. shares the per-stage table with every rank (an all-reduce, MAX, over the default group: each
   stage is measured by the rank that holds it; data-parallel replicas take the slowest), so every
   rank holds the same costs and builds the identical schedule at the same iteration;
4. takes f, b and w as the medians over the stages that measured all three (:func:`typical_chunk`):
   the ratios of a typical chunk, each from the same stages. The first stage (embedding) and the last
   (LM head and loss) are heavier; a maximum over ranks per kind (the rule before) took F from the LM
   head's stage and B from plain layers, and built schedules for B at a quarter of F;
5. rebuilds the schedule under those costs and keeps it only if its predicted bubble is lower than the
   current schedule's under the same costs (both numbers are reported).

Each stage's own measured work (:func:`with_measured_stages`) is what the benchmarks simulate to tell
stage imbalance from executor idle. The schedule is still built for the typical chunk: the generators
given those per-stage costs built no faster schedule for them (V-ZB at d = 4, m = 8 with a heavy
embedding and LM head: 3.3 % slower under the same costs; V-Min at d = 2: 1.8 %; equal elsewhere).

What each cost includes: F is megatron's ``forward_step`` (the model chunk's forward; on the last
stage also the loss) and handing the output to the p2p outbox, **less the time spent in
``next(data_iterator)``** (batch loading, timed separately and reported as ``load``: it is not part
of a chunk's layers and only the stages that read data pay it). B is ``backward_step`` with the
weight gradients deferred (input gradients only, plus norms, embeddings and biases), W the deferred
weight gradients. Only B passes whose W was deferred say what B alone costs; a B with its W right
after it computed the whole backward and is left out (as is its empty W). No wait for a message
is inside any of them (receives are waited for before the clock starts). ``comm`` is one
activation message.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from megatron_vshape.schedules.core.actions import Kind
from megatron_vshape.schedules.core.schedule import Costs, Schedule, StageWork
from megatron_vshape.schedules.core.simulator import simulate


@dataclass(frozen=True)
class ReplanPolicy:
    """``iterations`` measured training iterations (after one warm-up); ``output``: where to write the costs."""

    iterations: int = 3
    output: Path | None = None

    def __post_init__(self):
        if self.iterations < 1:
            raise ValueError(f"--pipeline-costs-iters must be >= 1; got {self.iterations}")


class PassClock:
    """Times passes without stalling the GPU: events are read once, at the end of the iteration."""

    def __init__(self, cuda: bool, loaders: list[TimedIterator] = ()):
        self._cuda = cuda
        self._loaders = list(loaders)  # the call's data iterators: their next() is batch loading
        self._marks: list[tuple] = []

    def _loaded(self) -> float:
        return sum(loader.seconds for loader in self._loaders)

    def start(self):
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event, self._loaded()
        return time.perf_counter(), self._loaded()

    def stop(self, kind: Kind, scale: float, started, stage: int = -1) -> None:
        """Close the pass begun by :meth:`start`; the host seconds it spent loading batches are taken out."""
        if self._cuda:
            ended = torch.cuda.Event(enable_timing=True)
            ended.record()
        else:
            ended = time.perf_counter()
        started, loaded = started
        self._marks.append((kind, stage, scale, started, ended, self._loaded() - loaded))

    def seconds(self) -> dict[tuple[Kind, int], list[float]]:
        """Seconds per pass, by (kind, stage), per V chunk of layers (synchronises on CUDA)."""
        if self._cuda and self._marks:
            torch.cuda.synchronize()
        out: dict[tuple[Kind, int], list[float]] = {}
        for kind, stage, scale, start, end, loading in self._marks:
            elapsed = start.elapsed_time(end) / 1e3 if self._cuda else end - start
            out.setdefault((kind, stage), []).append(max(elapsed - loading, 0.0) / scale)
            if loading:
                out.setdefault((LOAD, stage), []).append(loading)
        self._marks.clear()
        return out


LOAD = "load"  # the key of batch-loading seconds in PassClock.seconds (per F pass that loaded)


class TimedIterator:
    """Wraps a data iterator and adds the seconds spent in ``next()`` to :attr:`seconds`."""

    def __init__(self, iterator):
        self._iterator = iterator
        self.seconds = 0.0

    def __iter__(self):
        return self

    def __next__(self):
        start = time.perf_counter()
        try:
            return next(self._iterator)
        finally:
            self.seconds += time.perf_counter() - start

    def __getattr__(self, name):  # megatron's RerunDataIterator and friends have more than __next__
        return getattr(self._iterator, name)


def timed_iterators(data_iterator) -> tuple[object, list[TimedIterator]]:
    """``data_iterator`` (one, a list, or None) with every iterator wrapped; and the wrappers."""
    if data_iterator is None:
        return None, []
    if isinstance(data_iterator, list):
        wrapped = [TimedIterator(it) if it is not None else None for it in data_iterator]
        return wrapped, [w for w in wrapped if w is not None]
    wrapped = TimedIterator(data_iterator)
    return wrapped, [wrapped]


@dataclass(frozen=True)
class Replan:
    """What one re-planning decided (identical on every rank)."""

    after_iteration: int
    measured_seconds: dict[str, float]  # f, b, w (typical_chunk), comm, load (per loading F)
    costs: Costs  # relative to f = 1
    bubble_before: float  # the running schedule, under the measured costs
    bubble_after: float  # the rebuilt schedule, under the measured costs
    switched: bool
    fingerprint: str  # of the schedule that runs from now on
    stage_seconds: tuple[tuple[float, float, float], ...] = ()  # (f, b, w) per stage; -1: not measured

    def line(self, schedule_name: str) -> str:
        c = self.costs
        verb = "switched to the rebuilt schedule" if self.switched else "kept the running schedule"
        load = self.measured_seconds.get("load", -1.0)
        loading = f" (batch loading {1000 * load:.3g} ms per F, not in f)" if load > 0 else ""
        a2a = f",a2a={c.a2a:.3g}" if c.a2a > 0 else ""  # not measured: the pairs are placed for the given one
        return (f"re-planned {schedule_name} after iteration {self.after_iteration} from measured costs "
                f"f={c.f:.3g},b={c.b:.3g},w={c.w:.3g},comm={c.comm:.3g}{a2a}: predicted bubble "
                f"{100 * self.bubble_before:.1f}% -> {100 * self.bubble_after:.1f}%, {verb} "
                f"(schedule {self.fingerprint}){loading}")

    def to_json(self) -> dict:
        return {"f": self.costs.f, "b": self.costs.b, "w": self.costs.w, "comm": self.costs.comm,
                "seconds": self.measured_seconds, "after_iteration": self.after_iteration,
                "bubble_before": self.bubble_before, "bubble_after": self.bubble_after,
                "switched": self.switched, "fingerprint": self.fingerprint,
                "stage_seconds": [list(row) for row in self.stage_seconds]}


def fingerprint(schedule: Schedule) -> str:
    return hashlib.sha1(schedule.to_text().encode()).hexdigest()[:12]


@dataclass
class CostProfile:
    """Collects pass times over the measured iterations of one executor."""

    policy: ReplanPolicy
    training_calls: int = 0
    samples: dict[tuple, list[float]] = field(default_factory=dict)  # (kind or LOAD, stage) -> seconds
    done: bool = False

    def measuring(self) -> bool:
        """Whether the training call about to run is timed (the first one is the warm-up)."""
        return not self.done and 1 <= self.training_calls <= self.policy.iterations

    def add(self, seconds: dict[tuple, list[float]]) -> None:
        for key, values in seconds.items():
            self.samples.setdefault(key, []).extend(values)

    def due(self) -> bool:
        return not self.done and self.training_calls == self.policy.iterations + 1

    def local_table(self, num_stages: int) -> list[float]:
        """(f, b, w) medians per stage, flat, then the median batch loading; -1 where this rank saw none."""
        def median(key):
            values = self.samples.get(key)
            return statistics.median(values) if values else -1.0
        loads = [v for (kind, _), values in self.samples.items() if kind == LOAD for v in values]
        table = [median((kind, stage)) for stage in range(num_stages) for kind in (Kind.F, Kind.B, Kind.W)]
        return [*table, statistics.median(loads) if loads else -1.0]


def measure_comm(pp_group, shape, dtype, device, repeats: int = 5) -> float:
    """Seconds for one activation message: a ring exchange over the pipeline group (every rank sends
    to the next and receives from the previous in one batch, so no pair waits for another)."""
    size = pp_group.size()
    if size == 1:
        return 0.0
    ranks = torch.distributed.get_process_group_ranks(pp_group)
    me = pp_group.rank()
    send, recv = torch.zeros(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        ops = [torch.distributed.P2POp(torch.distributed.isend, send, ranks[(me + 1) % size], pp_group),
               torch.distributed.P2POp(torch.distributed.irecv, recv, ranks[(me - 1) % size], pp_group)]
        for work in torch.distributed.batch_isend_irecv(ops):
            work.wait()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def agree_on_costs(local: list[float], comm: float, device) -> tuple[dict[str, float], tuple]:
    """The per-stage table of every rank, merged by one all-reduce (MAX: a stage's own rank measured
    it, the others sent -1), so all ranks decide the same thing; then :func:`typical_chunk`."""
    values = torch.tensor([*local, comm], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
    *flat, load, c = values.tolist()
    stages = tuple(tuple(flat[i:i + 3]) for i in range(0, len(flat), 3))
    return {**typical_chunk(stages), "comm": c, "load": load}, stages


def typical_chunk(stages) -> dict[str, float]:
    """f, b, w seconds: medians over the stages that measured all three (ratios from the same stages);
    when none did (no deferred W ran), each kind's median over the stages that measured it."""
    complete = [row for row in stages if min(row) > 0]
    rows = complete or stages

    def median(i):
        values = [row[i] for row in rows if row[i] > 0]
        return statistics.median(values) if values else -1.0
    return {"f": median(0), "b": median(1), "w": median(2)}


def relative_costs(seconds: dict[str, float], fallback: Costs) -> Costs:
    """``fallback`` with the measured f (= 1), b, w and comm; B or W unseen everywhere (no deferred W ran) keep
    ``fallback``'s ratio. What the clock does not measure stays ``fallback``'s, all of it relative to F: the
    layout's per-stage multipliers, the vocabulary passes' work (``--pipeline-vocab-parallel``: a schedule
    rebuilt without it has no H or G to run) and the all-to-all the pairs hide
    (``--overlap-moe-expert-parallel-comm``: without it the rebuilt schedule would drop its pairs)."""
    f = seconds["f"]
    if f <= 0:
        return fallback
    b = seconds["b"] / f if seconds["b"] > 0 else fallback.b / fallback.f
    w = seconds["w"] / f if seconds["w"] > 0 else fallback.w / fallback.f
    return replace(fallback, f=1.0, b=b, w=w, comm=max(seconds["comm"], 0.0) / f)


def with_measured_stages(costs: Costs, seconds: dict[str, float], stage_seconds, base: Costs) -> Costs:
    """``costs`` (the typical chunk, f = 1) with each stage's measured f, b, w as multipliers of it.

    ``stage_seconds``: (f, b, w) seconds per stage, -1 where no pass of that kind was measured (a stage
    whose every W ran fused with its B): B and W then take the stage's F ratio. Activation memory keeps
    ``base``'s per-stage multipliers (the layout's), which timing does not measure."""
    if not stage_seconds or min(seconds["f"], seconds["b"], seconds["w"]) <= 0:
        return costs
    memory = [work.memory for work in base.stages] if len(base.stages) == len(stage_seconds) else None
    works = []
    for stage, (f, b, w) in enumerate(stage_seconds):
        f_ratio = f / seconds["f"] if f > 0 else 1.0
        works.append(StageWork(f=f_ratio, b=b / seconds["b"] if b > 0 else f_ratio,
                               w=w / seconds["w"] if w > 0 else f_ratio,
                               memory=memory[stage] if memory else 1.0))
    return costs.with_stages(works)


def fold_stages(costs: Costs, num_stages: int) -> Costs:
    """Per-stage costs of a V (2d stages of L/2d layers) for a looped placement of ``num_stages`` = d
    stages: looped stage i holds the layers of V stages 2i and 2i + 1, so its work is their mean (costs
    stay per V chunk of layers). Unchanged unless ``costs`` has exactly 2 x ``num_stages`` stages."""
    if len(costs.stages) != 2 * num_stages:
        return costs
    pairs = [(costs.stages[2 * i], costs.stages[2 * i + 1]) for i in range(num_stages)]
    return costs.with_stages(StageWork(*((getattr(a, n) + getattr(b, n)) / 2 for n in ("f", "b", "w", "memory")))
                             for a, b in pairs)


def decide(current: Schedule, rebuilt: Schedule, costs: Costs, after_iteration: int,
           seconds: dict[str, float], stage_seconds: tuple = ()) -> tuple[Replan, Schedule]:
    """Keep whichever of the two schedules has the lower predicted bubble under the measured costs."""
    before = simulate(current, costs).bubble_rate
    after = simulate(rebuilt, costs).bubble_rate
    switched = after < before - 1e-9
    chosen = rebuilt if switched else current
    replan = Replan(after_iteration, seconds, costs, before, after, switched, fingerprint(chosen), stage_seconds)
    return replan, chosen


def write_costs(path: Path, replan: Replan, schedule_name: str, num_devices: int, num_microbatches: int) -> None:
    record = {"schedule": schedule_name, "pipeline_size": num_devices, "microbatches": num_microbatches,
              **replan.to_json()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
