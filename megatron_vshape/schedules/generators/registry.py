"""Schedules by name: the one place that knows every generator and its size rules.

Every entry has the same contract (:class:`ScheduleSpec`):

* ``check(d, m)``: what is wrong with ``d`` pipeline devices and ``m`` microbatches, in one line,
  or None. It is the only statement of a schedule's size rules; the CLI, ``vshape verify``, the
  training-flag checks and the Slurm generator all ask it.
* ``build(d, m, costs, memory_limit=None)``: the schedule, or :class:`ScheduleError` with
  ``check``'s line. Whether the backward is split into B and W is read from the built schedule
  (``Schedule.fused_backward``; :func:`fuses_backward` for a name).

A new schedule is one ``ScheduleSpec`` below, with a generator taking a :class:`Request`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, lru_cache

from ..core.gc_pause import without_gc
from ..core.inputs import EPS
from ..core.schedule import Costs, MemoryModel, PlacementKind, Schedule, ScheduleError, one_f_one_b_peak
from ..core.simulator import simulate
from . import adaptive, baselines, pairing, v_schedules, zero_bubble
from .simulated import simulated
from .vocab_passes import with_vocab_passes

# The order built for uniform stages replaces the stage-built one only when shorter by more than this share
# of the makespan: a smaller difference is within the cost rounding the planner generates orders with
# (simcache: within 0.02 of B/F), and there the stage-built order is what the stage costs ask for. At the
# 1024-GPU GPT-3 plan's V-ZB (PP 32, layout 2 x 32, 1 x 32) the uniform-built order was shorter under the
# rounded costs and 0.2 % longer under the real ones (MFU 55.04 -> 54.93 %).
UNIFORM_ORDER_MARGIN = 0.002

# Largest microbatch count searched for one that passes a check (inputs.MAX caps the CLI at 65536).
_MICROBATCH_SEARCH = 1 << 16


@dataclass(frozen=True)
class Request:
    """What a generator is asked to build: the same fields for every entry (each uses what it needs)."""

    num_devices: int
    num_microbatches: int
    costs: Costs
    memory_limit: float | None = None  # x 1F1B's peak; only entries with takes_memory_limit accept one
    chunks: int = 2  # model chunks per device, for interleaved-1f1b
    memory: MemoryModel = MemoryModel()  # the activation model the zero-bubble memory caps use


@dataclass(frozen=True)
class SizeRule:
    """A rule on (devices, microbatches) beyond d >= 1 and m >= 1, in words and as a check."""

    text: str  # for `vshape list`
    problem: Callable[[str, int, int], str | None]  # (name, d, m) -> one line, or None


def _whole_microbatch_groups(name: str, d: int, m: int) -> str | None:
    # Megatron's interleaved order runs microbatches in groups of d per chunk; a short last group
    # deadlocks it (in our p2p lowering too, e.g. d = 5, m = 7), so Megatron refuses it.
    if m < d or m % d:
        return f"{name} with {d} devices needs a multiple of {d} microbatches (Megatron's rule); got {m}"
    return None


WHOLE_GROUPS = SizeRule("m a multiple of d (Megatron's rule)", _whole_microbatch_groups)


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    placement: PlacementKind
    description: str
    generate: Callable[[Request], Schedule]  # called only with sizes check() accepts
    size_rule: SizeRule | None = None
    takes_memory_limit: bool = False  # build() accepts memory_limit (a fraction of 1F1B's peak)
    takes_chunks: bool = False  # build() honours chunks (model chunks per device on the looped placement)
    # With vocabulary passes: their G may wait for idle gaps (zero-bubble schedules) instead of running
    # right after the next H (see vocab_passes.py).
    vocab_g_in_gaps: bool = False
    # The order depends on the costs (greedy and block schedules): with unequal stages the order built
    # for uniform stages is a candidate too (``_not_slower_than_uniform``). Its memory bound: this many
    # x 1F1B's peak under the stages' memory (the zero-bubble caps; v-auto: its --memory-limit), or,
    # when None, the stage-built schedule's peak (V-Min and V-Half: the block's memory; per device when
    # the stages' memory differs).
    order_from_costs: bool = False
    memory_factor: float | None = None

    def chunks_per_device(self, chunks: int = 2) -> int:
        """Model chunks each device holds: 2 on the V, ``chunks`` where the schedule takes them, else 1."""
        if self.placement is PlacementKind.V:
            return 2
        return chunks if self.takes_chunks else 1

    def num_stages(self, num_devices: int, chunks: int = 2) -> int:
        """Global pipeline stages on ``num_devices`` devices (2d on the V, d x chunks where it takes them)."""
        return num_devices * self.chunks_per_device(chunks)

    @property
    def microbatch_rule(self) -> str:
        """The size rule in words, for `vshape list`."""
        return self.size_rule.text if self.size_rule else "m >= 1"

    def check(self, num_devices: int, num_microbatches: int) -> str | None:
        """What is wrong with these sizes (one line naming the fix), or None when ``build`` accepts them."""
        if num_devices < 1:
            # One device is allowed: both V chunks (or the one looped stage) on it, which is how the
            # B/W split is checked on a single GPU.
            return f"{self.name} needs at least 1 pipeline device; got {num_devices}"
        if num_microbatches < 1:
            return f"{self.name} needs at least 1 microbatch; got {num_microbatches}"
        return self.size_rule.problem(self.name, num_devices, num_microbatches) if self.size_rule else None

    @without_gc
    def build(self, num_devices: int, num_microbatches: int, costs: Costs = Costs(),
              memory_limit: float | None = None, *, chunks: int = 2, memory: MemoryModel | None = None) -> Schedule:
        """The schedule; :class:`ScheduleError` with a one-line fix for sizes or a limit it cannot take."""
        problem = self.check(num_devices, num_microbatches)
        if problem:
            raise ScheduleError(problem)
        if memory_limit is not None and not self.takes_memory_limit:
            raise ScheduleError(f"--memory-limit only applies to v-auto; {self.name} has a fixed memory footprint")
        costs.check_stages(num_devices * self.chunks_per_device(chunks), f"{self.name} on {num_devices} devices")
        # The generators schedule the layers; vocabulary passes (costs.vocab) and F&B pairs (costs.a2a) are
        # placed afterwards, in the family's own order.
        request = Request(num_devices, num_microbatches, dataclasses.replace(costs.without_vocab(), a2a=0.0),
                          memory_limit, chunks, memory if memory is not None else MemoryModel())
        if costs.vocab is not None:
            # The layers' order never depends on the vocabulary work: the planner asks for one order with many
            # vocabulary costs (its +vocab rows' layouts), so it is built once (``_layers_order``).
            return with_vocab_passes(_layers_order(self.name, request), costs, self.vocab_g_in_gaps)
        schedule = self.layers_order(request)
        if costs.a2a > 0:  # issue 43: F&B pairs hide the all-to-all (pairing.py), in the faster of two orders
            limit = request.memory_limit if self.takes_memory_limit else None
            factor = limit or self.memory_factor
            inside = dataclasses.replace(request, costs=pairing.a2a_inside(
                dataclasses.replace(request.costs, a2a=costs.a2a)))
            schedule = pairing.faster(pairing.paired(schedule, costs, request.memory, factor),
                                      pairing.paired(self.layers_order(inside), costs, request.memory, factor),
                                      costs, request.memory)
        return schedule

    def layers_order(self, request: Request) -> Schedule:
        """The generator's schedule of the layers for ``request`` (with unequal stages, never slower than the
        order built for uniform stages: ``_not_slower_than_uniform``)."""
        schedule = self.generate(request)
        if self.order_from_costs and not request.costs.uniform:
            schedule = self._not_slower_than_uniform(schedule, request)
        return schedule

    def _not_slower_than_uniform(self, own: Schedule, request: Request) -> Schedule:
        """``own`` (built for the stages' own costs), or the order built for uniform stages when that one,
        timed under the same stage costs, finishes sooner within the family's memory bound.

        The generators' choices (the greedy's variants, the block's squeeze and reorder, the warm-up's
        depth) are made from the stage costs, and each is a heuristic: under a head-heavy last stage or
        mixed F/B/W ratios a choice that is right for uniform stages sometimes wins (issue 44: 5 of 30
        random cells, up to 6.9 %). Both orders are real schedules of this family, so the faster wins.
        """
        costs, memory = request.costs, request.memory
        uniform = _uniform_built(self.name, dataclasses.replace(request, costs=costs.with_stages(())))
        if uniform is None:
            return own
        mine, theirs = simulated(own, costs, memory), simulate(uniform, costs, memory)
        if theirs.makespan >= mine.makespan * (1 - UNIFORM_ORDER_MARGIN):
            return own
        factor = self.memory_factor
        if self.takes_memory_limit:
            factor = request.memory_limit if request.memory_limit is not None else factor
        if factor is not None:
            caps = [factor * one_f_one_b_peak(request.num_devices, costs) + EPS] * request.num_devices
            caps = [max(cap, got) for cap, got in zip(caps, mine.peak_memory)]  # never below what own needs
        elif all(work.memory == 1.0 for work in costs.stages):  # the stages differ in time alone: the block's peak
            caps = [mine.peak_memory_max + EPS] * request.num_devices
        else:  # and in memory: each device's own (what v_schedules._memory_caps holds the alternatives to)
            caps = [got + EPS for got in mine.peak_memory]
        if any(got > cap for got, cap in zip(theirs.peak_memory, caps)):
            return own
        return dataclasses.replace(uniform, name=own.name, meta={**uniform.meta, "order_from": "uniform stages"})

    def min_microbatches(self, num_devices: int) -> int:
        """The fewest microbatches ``check`` accepts on ``num_devices`` (derived from it, never restated)."""
        return self.nearest_microbatches(num_devices, 1)

    def nearest_microbatches(self, num_devices: int, num_microbatches: int) -> int:
        """The largest count ``check`` accepts at or below ``num_microbatches``, else the smallest above
        (what to suggest to a user whose batch does not fit). ScheduleError when there is none."""
        for m in (*range(num_microbatches, 0, -1), *range(num_microbatches + 1, _MICROBATCH_SEARCH + 1)):
            if self.check(num_devices, m) is None:
                return m
        raise ScheduleError(self.check(num_devices, num_microbatches) or f"{self.name}: no microbatch count fits")


@lru_cache(maxsize=16)  # a few orders of up to tens of thousands of passes each
def _layers_order(name: str, request: Request) -> Schedule:
    """Schedule ``name``'s layers for ``request`` (no vocabulary work in it), shared by every build that adds
    vocabulary passes to it: each of those copies the schedule, so nobody holds this one."""
    return SCHEDULES[name].layers_order(request)


@lru_cache(maxsize=64)  # the planner asks for tens of (d, m, base costs) with many stage-cost sets each
def _uniform_built(name: str, request: Request) -> Schedule | None:
    """Schedule ``name`` built for uniform stages (shared by every stage-cost set with the same base costs:
    the planner asks for many), or None where the generator cannot build it."""
    try:
        return SCHEDULES[name].generate(request)
    except ScheduleError:
        return None


SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("gpipe", PlacementKind.LOOPED, "all forwards, then all backwards",
                     lambda r: baselines.gpipe(r.num_devices, r.num_microbatches)),
        ScheduleSpec("1f1b", PlacementKind.LOOPED, "one-forward-one-backward (Megatron's default)",
                     lambda r: baselines.one_f_one_b(r.num_devices, r.num_microbatches)),
        ScheduleSpec("interleaved-1f1b", PlacementKind.LOOPED,
                     "Megatron's virtual pipeline, --chunks model chunks per device",
                     lambda r: baselines.interleaved_one_f_one_b(r.num_devices, r.num_microbatches, r.chunks),
                     size_rule=WHOLE_GROUPS, takes_chunks=True),
        ScheduleSpec("zb-h1", PlacementKind.LOOPED, "zero bubble, 1F1B's memory, 1F1B's in-flight count",
                     lambda r: zero_bubble.zb_h1(r.num_devices, r.num_microbatches, r.costs, r.memory),
                     vocab_g_in_gaps=True, order_from_costs=True, memory_factor=1.0),
        ScheduleSpec("zb-1p", PlacementKind.LOOPED, "zero bubble, memory capped at 1F1B's peak",
                     lambda r: zero_bubble.zb_p(r.num_devices, r.num_microbatches, r.costs, 1, r.memory),
                     vocab_g_in_gaps=True, order_from_costs=True, memory_factor=1.0),
        ScheduleSpec("zb-2p", PlacementKind.LOOPED, "zero bubble, memory capped at 2x 1F1B's peak",
                     lambda r: zero_bubble.zb_p(r.num_devices, r.num_microbatches, r.costs, 2, r.memory),
                     vocab_g_in_gaps=True, order_from_costs=True, memory_factor=2.0),
        ScheduleSpec("v-min", PlacementKind.V, "V placement, about 1/3 of 1F1B's activation memory",
                     lambda r: v_schedules.v_min(r.num_devices, r.num_microbatches, r.costs),
                     order_from_costs=True),
        ScheduleSpec("v-half", PlacementKind.V, "V placement, about 1/2 of 1F1B's activation memory",
                     lambda r: v_schedules.v_half(r.num_devices, r.num_microbatches, r.costs),
                     order_from_costs=True),
        ScheduleSpec("v-zb", PlacementKind.V, "V placement, 1F1B's memory, near-zero bubble",
                     lambda r: zero_bubble.v_zb(r.num_devices, r.num_microbatches, r.costs, r.memory),
                     vocab_g_in_gaps=True, order_from_costs=True, memory_factor=1.0),
        ScheduleSpec("v-auto", PlacementKind.V,
                     "V placement, lowest bubble within --memory-limit X (x 1F1B's peak; default 1)",
                     lambda r: adaptive.v_auto(r.num_devices, r.num_microbatches, r.costs, r.memory_limit),
                     takes_memory_limit=True, vocab_g_in_gaps=True, order_from_costs=True, memory_factor=1.0),
    )
}


def schedule_names() -> list[str]:
    return list(SCHEDULES)


def get_spec(name: str) -> ScheduleSpec:
    """The registry entry of ``name``; ScheduleError naming the choices for an unknown one."""
    spec = SCHEDULES.get(name)
    if spec is None:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of: {', '.join(SCHEDULES)}")
    return spec


def get_schedule(
    name: str,
    num_devices: int,
    num_microbatches: int,
    costs: Costs = Costs(),
    chunks: int = 2,
    memory_limit: float | None = None,
    memory: MemoryModel | None = None,
) -> Schedule:
    """Build schedule ``name`` for ``num_devices`` pipeline devices and ``num_microbatches``.

    ``memory``: the activation model the schedule's memory cap is kept under (zero-bubble family;
    e.g. ``MemoryModel.for_gpt``, where B frees part, lets ZB-1P keep more forwards in flight).
    Other schedules have a fixed order and ignore it.

    Raises :class:`ScheduleError` with a one-line fix for unknown names and bad sizes.
    """
    return get_spec(name).build(num_devices, num_microbatches, costs, memory_limit, chunks=chunks, memory=memory)


@cache
def fuses_backward(name: str) -> bool:
    """Whether schedule ``name`` runs every W right after its B (a plain, unsplit backward).

    Read from the schedule itself, built at the smallest size its check accepts: the generator,
    not the size, decides it (tested over a grid in tests/test_registry_contract.py).
    """
    spec = get_spec(name)
    return spec.build(1, spec.min_microbatches(1)).fused_backward
