"""Re-planning from measured costs: time F, B, W and p2p during the first iterations, then rebuild.

Schedules are built from costs (F, B, W per V chunk, and one message). At start the executor only
knows the idealised F = B = W = 1, comm = 0; real layers are not like that, and zero-bubble schedules
earn their keep by knowing the real ratios. With ``--pipeline-costs auto`` the executor:

1. runs one warm-up iteration unmeasured (allocations, first-call overheads), then times every pass of
   the next ``iterations`` training iterations (:class:`PassClock`: CUDA events on GPU, because a host
   clock only sees kernel launches there; ``perf_counter`` on CPU);
2. reduces them on each rank to one median time per kind, per V chunk of layers (a looped stage holds
   two chunks' worth of layers: its times are halved), and measures one message (a ring exchange of
   an activation over the pipeline group);
3. takes the **maximum over all ranks** (an all-reduce over the default group), so every rank holds
   the same costs and builds the identical schedule at the same iteration;
4. rebuilds the schedule under those costs and keeps it only if its predicted bubble is lower than the
   current schedule's under the same costs (both numbers are reported).

Only B passes whose W was deferred say what B alone costs; a B with its W right after it computed the
whole backward and is left out (as is its empty W).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_vshape.schedules import Costs, Kind, Schedule, simulate


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

    def __init__(self, cuda: bool):
        self._cuda = cuda
        self._marks: list[tuple[Kind, float, object, object]] = []

    def start(self):
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, kind: Kind, scale: float, started) -> None:
        if self._cuda:
            ended = torch.cuda.Event(enable_timing=True)
            ended.record()
        else:
            ended = time.perf_counter()
        self._marks.append((kind, scale, started, ended))

    def seconds(self) -> dict[Kind, list[float]]:
        """Seconds per pass and kind, per V chunk of layers (synchronises on CUDA)."""
        if self._cuda and self._marks:
            torch.cuda.synchronize()
        out: dict[Kind, list[float]] = {kind: [] for kind in Kind}
        for kind, scale, start, end in self._marks:
            elapsed = start.elapsed_time(end) / 1e3 if self._cuda else end - start
            out[kind].append(elapsed / scale)
        self._marks.clear()
        return out


@dataclass(frozen=True)
class Replan:
    """What one re-planning decided (identical on every rank)."""

    after_iteration: int
    measured_seconds: dict[str, float]  # f, b, w, comm: max over ranks
    costs: Costs  # relative to f = 1
    bubble_before: float  # the running schedule, under the measured costs
    bubble_after: float  # the rebuilt schedule, under the measured costs
    switched: bool
    fingerprint: str  # of the schedule that runs from now on

    def line(self, schedule_name: str) -> str:
        c = self.costs
        verb = "switched to the rebuilt schedule" if self.switched else "kept the running schedule"
        return (f"re-planned {schedule_name} after iteration {self.after_iteration} from measured costs "
                f"f={c.f:.3g},b={c.b:.3g},w={c.w:.3g},comm={c.comm:.3g}: predicted bubble "
                f"{100 * self.bubble_before:.1f}% -> {100 * self.bubble_after:.1f}%, {verb} "
                f"(schedule {self.fingerprint})")

    def to_json(self) -> dict:
        return {"f": self.costs.f, "b": self.costs.b, "w": self.costs.w, "comm": self.costs.comm,
                "seconds": self.measured_seconds, "after_iteration": self.after_iteration,
                "bubble_before": self.bubble_before, "bubble_after": self.bubble_after,
                "switched": self.switched, "fingerprint": self.fingerprint}


def fingerprint(schedule: Schedule) -> str:
    return hashlib.sha1(schedule.to_text().encode()).hexdigest()[:12]


@dataclass
class CostProfile:
    """Collects pass times over the measured iterations of one executor."""

    policy: ReplanPolicy
    training_calls: int = 0
    samples: dict[Kind, list[float]] = field(default_factory=lambda: {kind: [] for kind in Kind})
    done: bool = False

    def measuring(self) -> bool:
        """Whether the training call about to run is timed (the first one is the warm-up)."""
        return not self.done and 1 <= self.training_calls <= self.policy.iterations

    def add(self, seconds: dict[Kind, list[float]]) -> None:
        for kind, values in seconds.items():
            self.samples[kind].extend(values)

    def due(self) -> bool:
        return not self.done and self.training_calls == self.policy.iterations + 1

    def local_medians(self) -> list[float]:
        """[f, b, w] medians on this rank; -1 where this rank saw no such pass (max() ignores it)."""
        return [statistics.median(self.samples[k]) if self.samples[k] else -1.0 for k in (Kind.F, Kind.B, Kind.W)]


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


def agree_on_costs(local: list[float], comm: float, device) -> dict[str, float]:
    """Max over every rank of the world (one all-reduce), so all ranks decide the same thing."""
    values = torch.tensor([*local, comm], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
    f, b, w, c = values.tolist()
    return {"f": f, "b": b, "w": w, "comm": c}


def relative_costs(seconds: dict[str, float], fallback: Costs) -> Costs:
    """Costs with f = 1; B or W unseen everywhere (no deferred W ran) keep ``fallback``'s ratio."""
    f = seconds["f"]
    if f <= 0:
        return fallback
    b = seconds["b"] / f if seconds["b"] > 0 else fallback.b / fallback.f
    w = seconds["w"] / f if seconds["w"] > 0 else fallback.w / fallback.f
    return Costs(f=1.0, b=b, w=w, comm=max(seconds["comm"], 0.0) / f)


def decide(current: Schedule, rebuilt: Schedule, costs: Costs, after_iteration: int,
           seconds: dict[str, float]) -> tuple[Replan, Schedule]:
    """Keep whichever of the two schedules has the lower predicted bubble under the measured costs."""
    before = simulate(current, costs).bubble_rate
    after = simulate(rebuilt, costs).bubble_rate
    switched = after < before - 1e-9
    chosen = rebuilt if switched else current
    return Replan(after_iteration, seconds, costs, before, after, switched, fingerprint(chosen)), chosen


def write_costs(path: Path, replan: Replan, schedule_name: str, num_devices: int, num_microbatches: int) -> None:
    record = {"schedule": schedule_name, "pipeline_size": num_devices, "microbatches": num_microbatches,
              **replan.to_json()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
