"""Issue 44 (the 1024-GPU GPT-3 plan under a minute): the faster paths build and time exactly what they did.

The pinned digests are the programs that 81bb8b7 (before these changes) built for a few cells that run every
changed path: the greedy list scheduler (V-ZB, ZB-1P and v-auto with unequal stages), the idle filling
(V-Min / V-Half's blocks), the H placement's rendezvous (the +vocab builds) and the simulator's memory count.
"""

import hashlib

import pytest

from megatron_vshape.planner import balance
from megatron_vshape.planner.model import GPTModel
from megatron_vshape.schedules.core.schedule import Costs, StageWork, VocabWork
from megatron_vshape.schedules.core.simulator import simulate
from megatron_vshape.schedules.core.timing import Interval
from megatron_vshape.schedules.generators.registry import get_schedule


def _stages(n: int) -> tuple[StageWork, ...]:
    return tuple(StageWork(1.0 + 0.3 * (s == 0) + 0.5 * (s == n - 1), 1.0 + 0.1 * (s % 3), 0.9 + 0.05 * (s % 2),
                           1.0 + 0.2 * (s == n - 1)) for s in range(n))


def _costs(num_stages: int, vocab: VocabWork | None = None) -> Costs:
    return Costs(1.0, 1.1, 0.9, 0.05, _stages(num_stages), vocab)


_VOCAB = VocabWork(0.9, 0.9, 0.9, 2.0)

# (name, d, m, costs, programs digest, makespan, per-device peak), as 81bb8b7 built and simulated them.
PINNED = [
    ("v-zb", 4, 8, _costs(8), "6787d00ad26cc9bc", 56.07, (4.0, 4.0, 4.0, 4.0)),
    ("zb-1p", 4, 12, _costs(4), "49bbff1158eaa10c", 93.57, (4.0, 4.0, 3.0, 3.6)),
    ("v-min", 6, 12, _costs(12), "862a8a2016020408", 108.345, (3.1, 3.0, 3.0, 3.0, 3.0, 3.0)),
    ("v-half", 4, 8, _costs(8), "7590a98cf209854f", 59.21, (3.1, 3.0, 3.0, 3.0)),
    ("v-min", 4, 8, _costs(8, _VOCAB), "ac6b36013c92739e", 76.085, (2.6, 2.5, 2.5, 2.5)),
    ("v-zb", 4, 8, _costs(8, _VOCAB), "f5e82d1493b1783c", 63.99, (4.75, 4.5, 4.75, 4.5)),
    ("v-auto", 4, 8, _costs(8), "6787d00ad26cc9bc", 56.07, (4.0, 4.0, 4.0, 4.0)),
]


@pytest.mark.parametrize("name, d, m, costs, digest, makespan, peaks", PINNED,
                         ids=[f"{p[0]}-d{p[1]}-m{p[2]}{'-vocab' if p[3].vocab else ''}" for p in PINNED])
def test_builds_and_simulations_are_those_before_the_speed_up(name, d, m, costs, digest, makespan, peaks):
    schedule = get_schedule(name, d, m, costs)
    result = simulate(schedule, costs)
    assert hashlib.sha256(repr(schedule.programs).encode()).hexdigest()[:16] == digest
    assert round(result.makespan, 9) == makespan
    assert tuple(round(p, 9) for p in result.peak_memory) == peaks


def _merged_levels(times, program, deltas, extra=()):
    """The memory timeline as the simulator computed it before (a two-way merge loop, releases first)."""
    per_kind, m = times.ids.per_kind, times.ids.num_microbatches

    def allocates(x):
        return x < per_kind or 3 * per_kind <= x < 4 * per_kind

    allocs = [(times.start[x], deltas[x // m]) for x in program if allocates(x)]
    releases = [e for e in ((times.end[x], deltas[x // m]) for x in program if not allocates(x)) if e[1]]
    if extra:
        allocs = sorted(allocs + [e for e in extra if e[1] > 0], key=lambda e: e[0])
        releases = sorted(releases + [e for e in extra if e[1] < 0], key=lambda e: e[0])
    merged, i, j = [], 0, 0
    while i < len(allocs) and j < len(releases):
        if releases[j][0] <= allocs[i][0]:
            merged.append(releases[j])
            j += 1
        else:
            merged.append(allocs[i])
            i += 1
    merged += allocs[i:] + releases[j:]
    out, level = [(0.0, 0.0)], 0.0
    for time, delta in merged:
        level += delta
        out.append((time, round(level, 9)))
    return tuple(out)


@pytest.mark.parametrize("name, vocab", [("v-zb", None), ("v-min", _VOCAB), ("zb-1p", None)])
def test_memory_timeline_is_the_merge_it_replaced(name, vocab):
    from megatron_vshape.schedules.core import simulator

    d = 4
    costs = _costs(2 * d if name.startswith("v-") else d, vocab)
    schedule = get_schedule(name, d, 2 * d, costs)
    times = simulator._run_programs(schedule, costs, {})
    deltas = simulator.pass_deltas(schedule.placement, costs, simulator.MemoryModel())
    buffers = simulator._vocab_buffer_events(schedule, costs, times)
    for program, extra in zip(times.programs, buffers):
        assert simulator._memory_timeline(times, program, deltas, extra) == _merged_levels(times, program, deltas,
                                                                                              extra)


def test_interval_reads_as_before():
    interval = Interval(1, 2.0, 3.5)
    assert (interval.device, interval.start, interval.end) == (1, 2.0, 3.5)
    result = simulate(get_schedule("1f1b", 2, 4))
    assert all(isinstance(iv, Interval) for iv in result.timeline.values())
    action, interval = result.timeline.items()[0]
    assert result.timeline[action] == interval


def test_stage_work_cache_hit_is_a_fresh_build_and_bounded(monkeypatch):
    model = GPTModel("cache", 16, 64, 4, 32, 2048)
    terms = balance._StageTerms(model, False, None, False)
    layers = (2, 3, 3, 4, 2, 2)
    first = terms.works(layers)
    assert terms.works(layers) is first  # kept
    assert first == balance._StageTerms(model, False, None, False).works(layers)  # equal to a fresh build
    assert balance.stage_work(model, layers) == first
    monkeypatch.setattr(balance, "WORKS_KEPT", 3)
    for extra in range(5):
        terms.works((2, 3, 3, 4, 2 + extra, 2))
        assert len(terms._works) <= 3
