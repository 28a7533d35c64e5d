"""The schedule a run will train with, as the start-up checks see it: built once per process.

Two start-up checks need the run's schedule at the run's size: whether it builds at all
(``checks.check_schedule_builds``) and whether every stage runs its W passes in B's order
(``feature_checks.split_route``: Transformer Engine's deferred-W queue needs that order). Both must
judge the schedule the executor will run, which is built from the run's costs (``--pipeline-costs``,
plus each stage's work under an uneven ``--pipeline-layout``) and, for v-auto, its memory limit; a
schedule built from default costs can run its W passes in another order. Building a large schedule
takes seconds, so it is built once here and both checks read it.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from . import moe_overlap, pipeline_layout
from .flags import AUTO_SCHEDULE, parse_pipeline_costs, schedule_of
from .sizes import Sizes


def costs_for_run(args):
    """The costs iteration 1's schedule is built from, by the checks and by ``install`` alike
    (``--pipeline-costs auto`` starts from the default costs and re-plans from measured ones later)."""
    from ..schedules.core.schedule import Costs

    spec = getattr(args, "pipeline_costs", None)
    pairs = moe_overlap.wants_pairs(args)
    base = parse_pipeline_costs(spec, pairs) if spec and spec.strip().lower() != "auto" else Costs()
    costs = pipeline_layout.schedule_costs(args, base)
    if getattr(args, "pipeline_vocab_parallel", False):
        costs = replace(costs, vocab=pipeline_layout.vocab_work(args))
    if pairs and not costs.a2a:  # overlapped F&B pairs (issue 43), at the default all-to-all unless given
        costs = replace(costs, a2a=moe_overlap.DEFAULT_A2A)
    return costs


def memory_limit_for_run(args) -> float | None:
    """``--pipeline-memory-limit`` where the schedule takes one (v-auto), else None."""
    return getattr(args, "pipeline_memory_limit", None) if schedule_of(args) == AUTO_SCHEDULE else None


def schedule_for_run(args, sizes: Sizes):
    """The schedule iteration 1 runs; raises what building raises (ScheduleError, InputError: ValueError)."""
    return _build(schedule_of(args), sizes.pp, sizes.num_microbatches, costs_for_run(args), memory_limit_for_run(args))


def clear() -> None:
    """Forget the schedules built so far (tests that count builds start from here)."""
    _build.cache_clear()


# A memo of a pure function of its key (no other state): the few schedules of this process's runs.
@functools.lru_cache(maxsize=4)
def _build(name: str, pp: int, num_microbatches: int, costs, memory_limit: float | None):
    from ..schedules.generators import registry  # looked up per call: tests may wrap get_schedule

    extra = {} if memory_limit is None else {"memory_limit": memory_limit}
    return registry.get_schedule(name, pp, num_microbatches, costs, **extra)
