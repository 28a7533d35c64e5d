"""The CP-SAT model of an :class:`ExactProblem` and its solution (OR-Tools, imported lazily).

Model (times scaled to integers, see ``problem``):

* every pass is a fixed-size interval; the passes of one device do not overlap;
* a pass starts after its inputs end, plus the comm delay when an input comes from another device;
* memory is a reservoir per device: F adds its activation at its start, B and W release their
  shares (the MemoryModel's) at their end; the level stays within the cap;
* objective: the longest device span from the device's fixed origin (the simulator's makespan).

What makes it prove (measured in docs/optimize.md):

* symmetry: microbatches are interchangeable, so each stage runs each kind's microbatches in index
  order (the permutation schedules every generator here and the authors' ILP produce);
* bounds: every pass starts no earlier than its input chain allows (``head``) and no later than
  the incumbent's makespan minus the longest chain after it on each device (``tails``); the same
  chains are posted as redundant linear constraints on the makespan, so the LP sees them;
* a warm start: the best heuristic schedule that fits the cap is the first incumbent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .problem import ExactProblem, makespan_of, peak_of

__all__ = ["SolveOutcome", "solve", "solver_available"]


def solver_available() -> bool:
    """Whether OR-Tools is installed (``pip install -e ".[solver]"``)."""
    try:
        import ortools.sat.python.cp_model  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class SolveOutcome:
    starts: list[int] | None  # best schedule found (scaled starts), None if none
    objective: int | None  # its scaled makespan
    bound: int  # proven scaled lower bound on the makespan
    optimal: bool
    status: str
    wall_s: float


def solve(problem: ExactProblem, time_limit: float, workers: int = 2,
          hint: list[int] | None = None, seed: int = 0) -> SolveOutcome:
    """Minimise the makespan of ``problem`` within ``time_limit`` seconds on ``workers`` threads.

    ``hint``: scaled starts of a feasible schedule; when it fits the cap its makespan bounds the
    search (every start's domain is cut to it) and it is the first incumbent.
    """
    from ortools.sat.python import cp_model  # optional extra: imported only here

    began = time.perf_counter()
    hint_ok = hint is not None and (problem.cap_units is None or peak_of(problem, hint) <= problem.cap_units)
    bound = problem.lower_bound()
    best = list(hint) if hint_ok else None
    upper = makespan_of(problem, best) if best else _horizon(problem)
    status = "OPTIMAL (chain bound)"
    # Two phases: the default search (LNS, good at improving the incumbent) for a third of the time,
    # then set-times branching (good at closing the bound) from the improved incumbent.
    for set_times, share in ((False, 1 / 3), (True, 1.0)):
        if upper <= bound:  # the incumbent meets a proven bound: optimal
            break
        left = time_limit - (time.perf_counter() - began)
        if left <= 0.05:
            break
        model, starts, makespan = _model(problem, bound, upper, set_times)
        if best:
            for var, value in zip(starts, best):
                model.add_hint(var, value)
            model.add_hint(makespan, upper)
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(0.05, left * share)
        solver.parameters.num_workers = workers
        solver.parameters.random_seed = seed
        code = solver.solve(model)
        status = solver.status_name(code)
        if code in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            found = [solver.value(v) for v in starts]
            if makespan_of(problem, found) < upper or best is None:
                best, upper = found, makespan_of(problem, found)
            bound = max(bound, int(round(solver.best_objective_bound)))
        if code == cp_model.OPTIMAL:
            bound = upper
        if code == cp_model.INFEASIBLE:  # no schedule within the domain: with an incumbent, it is optimal
            bound = upper if best else _horizon(problem)
            break
    wall = time.perf_counter() - began
    if best is None:
        return SolveOutcome(None, None, bound, False, status, wall)
    return SolveOutcome(best, upper, min(bound, upper), bound >= upper, status, wall)


def _model(problem: ExactProblem, lower: int, upper: int, set_times: bool):
    """The model with the makespan in [lower, upper]; ``set_times`` adds the set-times branching."""
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    makespan = model.new_int_var(lower, upper, "makespan")
    starts, intervals = [], []
    for p, action in enumerate(problem.passes):
        # Latest start: every chain from p must end on its device within the incumbent's makespan.
        latest = min(problem.origin[j] + upper - length for j, length in problem.tails[p].items())
        start = model.new_int_var(problem.head[p], max(problem.head[p], latest), f"s_{action}")
        starts.append(start)
        intervals.append(model.new_fixed_size_interval_var(start, problem.duration[p], f"i_{action}"))
        for j, length in problem.tails[p].items():
            model.add(start + length - problem.origin[j] <= makespan)
    for p, preds in enumerate(problem.preds):
        for q, delay in preds:
            model.add(starts[p] >= starts[q] + problem.duration[q] + delay)
    m = problem.num_microbatches
    for first in range(0, len(problem.passes), m):  # microbatch order per (kind, stage)
        for p in range(first, first + m - 1):
            model.add(starts[p + 1] >= starts[p] + problem.duration[p])
    for j in range(problem.num_devices):
        on_device = [p for p in range(len(problem.passes)) if problem.device[p] == j]
        model.add_no_overlap([intervals[p] for p in on_device])
        if problem.cap_units is not None:
            times = [starts[p] if problem.memory_delta[p] > 0 else starts[p] + problem.duration[p] for p in on_device]
            model.add_reservoir_constraint(times, [problem.memory_delta[p] for p in on_device], 0, problem.cap_units)
            _lifetimes(model, problem, starts, j)
            _memory_lags(model, problem, starts, j)
    model.minimize(makespan)
    if set_times:  # start the earliest-startable pass at its earliest time (what closes the bounds here)
        model.add_decision_strategy(starts, cp_model.CHOOSE_LOWEST_MIN, cp_model.SELECT_MIN_VALUE)
    return model, starts, makespan


def _lifetimes(model, problem: ExactProblem, starts, device: int) -> None:
    """The reservoir again, as a cumulative over each activation's lifetimes (F start to B end for
    B's share, to W end for W's): redundant, but cumulative's energy reasoning is stronger."""
    m, stages = problem.num_microbatches, problem.placement.num_stages
    lives, demands = [], []
    for s in problem.placement.stages_per_device[device]:
        for k in range(m):
            f, b, w = [(kind * stages + s) * m + k for kind in range(3)]
            for end, share in ((b, -problem.memory_delta[b]), (w, -problem.memory_delta[w])):
                if share <= 0:
                    continue
                size = model.new_int_var(0, 1 << 40, "")
                model.add(size == starts[end] + problem.duration[end] - starts[f])
                lives.append(model.new_interval_var(starts[f], size, starts[end] + problem.duration[end], ""))
                demands.append(share)
    model.add_cumulative(lives, demands, problem.cap_units)


def _memory_lags(model, problem: ExactProblem, starts, device: int) -> None:
    """Precedences the cap implies when W frees all of F's activation (microbatches run in order).

    When F(s, n) starts, stage s holds n + 1 - (its W's ended) activations, so with room for c of
    them W(s, n - c) has ended. On the V, F(s0, n) of the device's first stage precedes F(s1, n) by
    the F chain, so when F(s1, n) starts, s0 also holds n + 1 - (its W's ended): W(s0, n - c') has
    ended, c' the s0 activations that fit beside one of s1. Redundant with the reservoir, but they
    are plain precedences, which the chains' bounds and the LP see.
    """
    m, stages = problem.num_microbatches, problem.placement.num_stages
    own = problem.placement.stages_per_device[device]
    if any(problem.memory_delta[(stages + s) * m] for s in own):  # B frees a share: W's count is not the level
        return
    size = {s: problem.memory_delta[s * m] for s in own}
    pairs = [(s, s, problem.cap_units // size[s]) for s in own]  # (F's stage, W's stage, room)
    pairs += [(later, first, (problem.cap_units - size[later]) // size[first])
              for i, first in enumerate(own) for later in own[i + 1:]]
    for f_stage, w_stage, room in pairs:
        for n in range(room, m):
            w = (2 * stages + w_stage) * m + n - room
            model.add(starts[f_stage * m + n] >= starts[w] + problem.duration[w])


def _horizon(problem: ExactProblem) -> int:
    """A makespan every feasible cell meets: all passes one after another, comm included."""
    comm = max((delay for preds in problem.preds for _, delay in preds), default=0)
    return sum(problem.duration) + comm * len(problem.passes) + max(problem.origin)
