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
    chain_bound = problem.lower_bound()
    horizon = _horizon(problem)
    upper = makespan_of(problem, hint) if hint_ok else horizon
    if upper <= chain_bound:  # the warm start meets the chain bound: optimal without a search
        return SolveOutcome(list(hint), upper, upper, True, "OPTIMAL (chain bound)", time.perf_counter() - began)

    model, starts, makespan = _model(problem, chain_bound, upper, range(problem.num_devices))
    if hint_ok:
        for var, value in zip(starts, hint):
            model.add_hint(var, value)
        model.add_hint(makespan, upper)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.1, time_limit - (time.perf_counter() - began))
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = seed
    status = solver.solve(model)
    wall = time.perf_counter() - began
    name = solver.status_name(status)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        found = [solver.value(s) for s in starts]
        objective = makespan_of(problem, found)
        bound = max(chain_bound, int(round(solver.best_objective_bound)))
        if hint_ok and upper < objective:  # cannot happen with the domain cut; keep the better anyway
            found, objective = list(hint), upper
        return SolveOutcome(found, objective, min(bound, objective), status == cp_model.OPTIMAL, name, wall)
    if status == cp_model.INFEASIBLE:
        return SolveOutcome(None, None, horizon, False, name, wall)
    if hint_ok:  # no better schedule found in time: the warm start stands
        return SolveOutcome(list(hint), upper, chain_bound, False, name, wall)
    return SolveOutcome(None, None, chain_bound, False, name, wall)


def _model(problem: ExactProblem, lower: int, upper: int, devices):
    """The model with the devices in ``devices`` as resources (the rest run any number of passes at
    once: a relaxation unless all are given) and the makespan over those devices."""
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    makespan = model.new_int_var(lower, upper, "makespan")
    starts, intervals = [], []
    for p, action in enumerate(problem.passes):
        # Latest start: every chain from p must end on its device within the incumbent's makespan.
        latest = min(problem.origin[j] + upper - length for j, length in problem.tails[p].items() if j in devices) \
            if any(j in devices for j in problem.tails[p]) else upper + max(problem.origin)
        start = model.new_int_var(problem.head[p], max(problem.head[p], latest), f"s_{action}")
        starts.append(start)
        intervals.append(model.new_fixed_size_interval_var(start, problem.duration[p], f"i_{action}"))
        for j, length in problem.tails[p].items():
            if j in devices:
                model.add(start + length - problem.origin[j] <= makespan)
    for p, preds in enumerate(problem.preds):
        for q, delay in preds:
            model.add(starts[p] >= starts[q] + problem.duration[q] + delay)
    m = problem.num_microbatches
    for first in range(0, len(problem.passes), m):  # microbatch order per (kind, stage)
        for p in range(first, first + m - 1):
            model.add(starts[p + 1] >= starts[p] + problem.duration[p])
    for j in devices:
        on_device = [p for p in range(len(problem.passes)) if problem.device[p] == j]
        model.add_no_overlap([intervals[p] for p in on_device])
        if problem.cap_units is not None:
            times = [starts[p] if problem.memory_delta[p] > 0 else starts[p] + problem.duration[p] for p in on_device]
            model.add_reservoir_constraint(times, [problem.memory_delta[p] for p in on_device], 0, problem.cap_units)
            _lifetimes(model, problem, starts, j)
            _memory_lags(model, problem, starts, j)
    model.minimize(makespan)
    # Set times: start the earliest-startable pass at its earliest time (what proves these cells;
    # the default search alone leaves gaps, measured in docs/optimize.md).
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
