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
* a warm start: the best heuristic schedule that fits the cap is the first incumbent;
* two searches at once (``solve``): CP-SAT's default search minimising the makespan for the whole
  time limit, and a bisection prover whose "a schedule with makespan <= T?" tests raise the bound
  even when the minimisation cannot finish.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass

from .problem import ExactProblem, makespan_of, peak_of

__all__ = ["SolveOutcome", "memory_precedences", "solve", "solver_available"]

_TRACE = bool(os.environ.get("VSHAPE_SOLVER_TRACE"))  # one stderr line per CP-SAT run


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


class _Search:
    """The incumbent and the proven bound, shared by the improving search and the prover."""

    def __init__(self, problem: ExactProblem, best: list[int] | None, bound: int, began: float, time_limit: float):
        self.problem, self.best, self.bound = problem, best, bound
        self.upper = makespan_of(problem, best) if best else _horizon(problem)
        self.began, self.time_limit = began, time_limit
        self.status = "OPTIMAL (chain bound)"
        self.lock = threading.Lock()
        self.running: set = set()  # the CP-SAT solvers at work, stopped once the bound meets the incumbent

    def left(self) -> float:
        return self.time_limit - (time.perf_counter() - self.began)

    def offer(self, starts: list[int]) -> None:
        span = makespan_of(self.problem, starts)
        with self.lock:
            if self.best is None or span < self.upper:
                self.best, self.upper = list(starts), span
        self._stop_if_closed()

    def raise_bound(self, value: int) -> None:
        with self.lock:
            self.bound = max(self.bound, value)
        self._stop_if_closed()

    def run(self, solver, model, callback=None):
        """``solver.solve(model)``, stopped early when the other search closes the gap."""
        with self.lock:
            if self.bound >= self.upper:
                return None  # nothing left to prove
            self.running.add(solver)
        try:
            return solver.solve(model, callback) if callback else solver.solve(model)
        finally:
            with self.lock:
                self.running.discard(solver)

    def _stop_if_closed(self) -> None:
        with self.lock:
            if self.bound >= self.upper:
                for solver in self.running:
                    solver.stop_search()

    def closed(self) -> bool:
        return self.bound >= self.upper

    def trace(self, what: str, solver, code) -> None:
        if _TRACE:
            print(f"[cpsat] {what}: {solver.status_name(code)} in {solver.wall_time:.1f} s "
                  f"(det {solver.deterministic_time:.1f}); best {self.upper} bound {self.bound}; "
                  f"at {time.perf_counter() - self.began:.1f} s", file=sys.stderr, flush=True)


def solve(problem: ExactProblem, time_limit: float, workers: int = 2,
          hint: list[int] | None = None, seed: int = 0) -> SolveOutcome:
    """Minimise the makespan of ``problem`` within ``time_limit`` seconds on ``workers`` threads.

    ``hint``: scaled starts of a feasible schedule; when it fits the cap its makespan bounds the
    search (every start's domain is cut to it) and it is the first incumbent.

    Two searches. The improver is CP-SAT's default search (LNS, good at improving the incumbent)
    minimising the makespan. The prover bisects on the makespan: "is there a schedule with
    makespan <= T?", a satisfaction model with every start's domain cut to T and set-times
    branching, on one worker. A proof of infeasibility raises the bound to T + 1; a schedule
    found lowers the incumbent. Such a test proves far more than the optimisation's own bound
    (d = 4, m = 8 at V-Half's memory: the optimisation's bound stays near 50 in a minute, one
    test proves "no schedule within 54.4" in about ten seconds of one core): with the domains cut
    to T, presolve's probing and the propagation of the chains and the memory decide it. With two
    workers or more the improver (workers - 1 threads) and the prover run at the same time; with
    one, the improver runs first for half of the time (also with more, when no heuristic schedule fits
    the cap: until it finds one).
    """
    began = time.perf_counter()
    hint_ok = hint is not None and (problem.cap_units is None or peak_of(problem, hint) <= problem.cap_units)
    search = _Search(problem, list(hint) if hint_ok else None, problem.lower_bound(), began, time_limit)
    if search.best is None or workers < 2:  # find a schedule first / one thread: one search at a time
        _improve(search, workers, seed, search.left() / 2)
    if not search.closed() and search.left() > 0.05:
        if workers >= 2:
            failed: list[BaseException] = []

            def improve() -> None:
                try:
                    _improve(search, workers - 1, seed, None)
                except BaseException as error:  # re-raised in the caller's thread
                    failed.append(error)

            improver = threading.Thread(target=improve, daemon=True)
            improver.start()
            _bisect(search, seed)
            improver.join()  # until it proves, the prover closes the gap, or the time is up
            if failed:
                raise failed[0]
        else:
            _bisect(search, seed)
    wall = time.perf_counter() - began
    best, upper, bound = search.best, search.upper, search.bound
    if best is None:
        return SolveOutcome(None, None, bound, False, search.status, wall)
    status = "OPTIMAL" if bound >= upper else search.status
    return SolveOutcome(best, upper, min(bound, upper), bound >= upper, status, wall)


def _improve(search: _Search, workers: int, seed: int, seconds: float | None) -> None:
    """CP-SAT's default search minimising the makespan below the incumbent; every schedule it finds
    is offered at once. ``seconds`` None: until the time limit (or until the prover closes the gap)."""
    from ortools.sat.python import cp_model  # optional extra: imported only here

    problem = search.problem
    model, starts, makespan = _model(problem, search.bound, search.upper, False)
    if search.best is not None:
        for var, value in zip(starts, search.best):
            model.add_hint(var, value)
        model.add_hint(makespan, search.upper)

    class Offer(cp_model.CpSolverSolutionCallback):
        def on_solution_callback(self) -> None:
            search.offer([self.value(v) for v in starts])

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.05, search.left() if seconds is None else seconds)
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = seed
    code = search.run(solver, model, Offer())
    if code is None:
        return
    if code == cp_model.OPTIMAL:  # the optimum within [bound, incumbent]: the cell's
        search.raise_bound(int(round(solver.objective_value)))
    elif code == cp_model.FEASIBLE:
        search.raise_bound(int(round(solver.best_objective_bound)))
    elif code == cp_model.INFEASIBLE:  # nothing within the domain: with an incumbent, it is optimal
        search.raise_bound(search.upper if search.best else _horizon(problem) + 1)
    search.status = solver.status_name(code)
    search.trace("improve", solver, code)


def _bisect(search: _Search, seed: int) -> None:
    """The prover: "a schedule with makespan <= T?" for T halving [bound, incumbent). A test that
    ends undecided is run once more with presolve's probing switched (on <-> off); undecided again,
    that target and those above are not tested again: the next one aims lower, where proofs come
    cheaper. Probing decides some cells and stalls others (measured in docs/optimize.md: d = 4,
    m = 8 at V-Half's memory, f=1,b=1.1,w=0.9,comm=0.05 needs it; equal costs, time unit 1, spend
    the whole budget in it), so the level that last decided a test is kept."""
    from ortools.sat.python import cp_model  # optional extra: imported only here

    problem = search.problem
    ceiling = search.upper - 1  # the largest target still worth testing
    probing, retried = True, False
    while not search.closed() and search.bound <= ceiling and search.left() > 0.05:
        target = (search.bound + ceiling) // 2
        model, starts, _ = _model(problem, search.bound, target, True)
        model.clear_objective()
        solver = cp_model.CpSolver()
        left = search.left()
        solver.parameters.max_time_in_seconds = max(0.05, left / 2 if left > 1 else left)
        solver.parameters.num_workers = 1
        solver.parameters.random_seed = seed
        if not probing:
            solver.parameters.cp_model_probing_level = 0
        code = search.run(solver, model)
        if code is None:
            return
        if code in (cp_model.OPTIMAL, cp_model.FEASIBLE):  # a schedule within the target
            search.offer([solver.value(v) for v in starts])
        elif code == cp_model.INFEASIBLE:
            search.raise_bound(target + 1)
        if code in (cp_model.OPTIMAL, cp_model.FEASIBLE, cp_model.INFEASIBLE):
            retried = False
        elif not retried:  # the same target once more, probing switched
            probing, retried = not probing, True
        else:
            ceiling, retried = target - 1, False
            search.status = solver.status_name(code)
        ceiling = min(ceiling, search.upper - 1)
        search.trace(f"test makespan <= {target} (probing {'on' if solver.parameters.cp_model_probing_level else 'off'})",
                     solver, code)


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
    """Post :func:`memory_precedences` of ``device``: plain precedences, which the chains' bounds
    and the LP see (redundant with the reservoir)."""
    for before, after in memory_precedences(problem, device):
        model.add(starts[after] >= starts[before] + problem.duration[before])


def memory_precedences(problem: ExactProblem, device: int) -> list[tuple[int, int]]:
    """(p, q) pass pairs: q starts after p ends in every schedule within the cap, when W frees all
    of F's activation (microbatches run in order per stage). Pure Python (tested on every schedule
    the oracle tier knows, tests/test_optimize_oracle.py).

    When F(s, n) starts, stage s holds n + 1 - (its W's ended) activations, so with room for c of
    them W(s, n - c) has ended. On the V, F(s0, n) of the device's first stage precedes F(s1, n) by
    the F chain, so when F(s1, n) starts, s0 also holds n + 1 - (its W's ended): W(s0, n - c') has
    ended, c' the s0 activations that fit beside one of s1.

    The other way round: the device's first stage cannot run more than c' microbatches ahead of
    its later stage. If F(s0, k + c') started before F(s1, k), then when F(s1, k) starts s0 holds
    k + c' + 1 - (its W's ended) activations, and only W(s0, i) with i < k can have ended (W(s0, i)
    waits for B(s1, i), so for F(s1, i)): at least c' + 1 of s0 beside F(s1, k) itself, over the
    cap. So F(s0, k + c') starts after F(s1, k) (one device: after it ends). This is the throttle
    that idles a device at the start (d = 4, m = 8 at V-Half's memory: device 0 runs 5 F of stage 0,
    then waits for F of stage 7).
    """
    if problem.cap_units is None:
        return []
    m, stages = problem.num_microbatches, problem.placement.num_stages
    own = sorted(problem.placement.stages_per_device[device])  # a later stage's B chain comes back through an earlier one
    if any(problem.memory_delta[(stages + s) * m] for s in own):  # B frees a share: W's count is not the level
        return []
    size = {s: problem.memory_delta[s * m] for s in own}
    out = []
    for s in own:
        room = problem.cap_units // size[s]
        out += [((2 * stages + s) * m + n - room, s * m + n) for n in range(room, m)]
    for i, first in enumerate(own):
        for later in own[i + 1:]:
            room = (problem.cap_units - size[later]) // size[first]
            if room < 0:  # not even one activation of the later stage fits: the reservoir says so
                continue
            out += [((2 * stages + first) * m + n - room, later * m + n) for n in range(room, m)]
            out += [(later * m + k, first * m + k + room) for k in range(m - room)]
    return out


def _horizon(problem: ExactProblem) -> int:
    """A makespan every feasible cell meets: all passes one after another, comm included."""
    comm = max((delay for preds in problem.preds for _, delay in preds), default=0)
    return sum(problem.duration) + comm * len(problem.passes) + max(problem.origin)
