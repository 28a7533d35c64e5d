"""Issue 44's speed work keeps the orders: the idle filling's and the vocabulary H placement's faster
searches against the plain ones they replace."""

from __future__ import annotations

import dataclasses
import heapq
import random

import pytest

from megatron_vshape.schedules.core.actions import Action
from megatron_vshape.schedules.core.inputs import EPS as _EPS
from megatron_vshape.schedules.core.ledger import MemoryLedger
from megatron_vshape.schedules.core.ready import ready_rule
from megatron_vshape.schedules.core.schedule import Costs, MemoryModel, Schedule, StageWork, VocabWork
from megatron_vshape.schedules.core.simulator import simulate
from megatron_vshape.schedules.core.timing import UNSET, PassIds
from megatron_vshape.schedules.generators import reorder, vocab_passes
from megatron_vshape.schedules.generators.registry import SCHEDULES, get_schedule
from megatron_vshape.schedules.generators.v_schedules import v_half_block, v_min_block


# The idle filling as it was before issue 44: every idle device scans its look-ahead at every event.
def _reference_fill_idle(
    schedule: Schedule, costs: Costs, peaks: list[float], lookahead: int, memory: MemoryModel = MemoryModel()
) -> tuple[Schedule, float, list[float]]:
    """A new order for ``schedule`` (same passes) that fills waits with ready passes, keeping
    each device within ``peaks`` counted under ``memory``.

    Returns the new schedule with the makespan and per-device peak of the replay that built it
    (the replay starts every pass as soon as its device and inputs allow, like the simulator; the
    peak is what ``simulate(..., memory=memory)`` reports).
    """
    placement = schedule.placement
    num_stages = schedule.num_stages
    ledger = MemoryLedger(placement, costs, memory)
    delta, level = ledger.delta, ledger.level
    ids = PassIds(num_stages, schedule.num_microbatches)
    stage_device = [placement.device_of(s) for s in range(num_stages)]
    remaining = [list(program) for program in schedule.programs]
    end_time = [UNSET] * (3 * ids.per_kind)
    ready_of = ready_rule(stage_device, schedule.num_microbatches, costs.comm)
    free_at = [0.0] * schedule.num_devices
    order: list[list[Action]] = [[] for _ in schedule.programs]
    first_start: list[float | None] = [None] * schedule.num_devices
    events = [0.0]
    now = 0.0
    left = sum(len(p) for p in remaining)

    def pick(device: int) -> int | None:
        todo = remaining[device]
        running = 0.0  # cumulative memory change of the passes a pulled pass would jump over
        worst = 0.0
        for index, action in enumerate(todo[: lookahead + 1]):
            ready = ready_of(ids.of(action), end_time)  # < 0: an input is missing
            change = delta(action.kind, action.stage)
            if 0 <= ready <= now + _EPS:
                if index == 0 or level[device] + change + worst <= peaks[device] + _EPS:
                    return index
            elif ready >= 0:
                heapq.heappush(events, ready)
            running += change
            worst = max(worst, running)
        return None

    while left:
        for device in range(schedule.num_devices):
            if free_at[device] > now + _EPS or not remaining[device]:
                continue
            index = pick(device)
            if index is None:
                continue
            action = remaining[device].pop(index)
            end = now + schedule.pass_cost(action, costs)
            end_time[ids.of(action)] = end
            free_at[device] = end
            ledger.apply(device, action.kind, action.stage)
            if first_start[device] is None:
                first_start[device] = now
            order[device].append(action)
            heapq.heappush(events, end)
            heapq.heappush(events, end + costs.comm)
            left -= 1
        while events and events[0] <= now + _EPS:
            heapq.heappop(events)
        if left and not events:  # cannot happen for a valid input order; fail loudly if it does
            raise RuntimeError(f"{schedule.name}: reorder stalled")
        if events:
            now = events[0]
    reordered = Schedule(schedule.name, placement, schedule.num_microbatches, tuple(map(tuple, order)),
                         dict(schedule.meta), schedule.fused_backward)
    makespan = max(free_at[d] - (first_start[d] or 0.0) for d in range(schedule.num_devices))
    return reordered, makespan, list(ledger.peak)


def _stage_mix(rng: random.Random, count: int) -> tuple[StageWork, ...]:
    return tuple(StageWork(rng.choice((0.7, 1.0, 1.3)), rng.choice((0.8, 1.0, 1.4)), rng.choice((0.5, 1.0, 1.5)))
                 for _ in range(count))


@pytest.mark.parametrize("d", [2, 3, 5, 8, 12])
def test_idle_filling_keeps_its_orders(d):
    rng = random.Random(d)
    for m in (d, 2 * d + 1):
        for block in (v_min_block(d), v_half_block(d)):
            for costs in (Costs(), Costs(1, 1.1, 0.9, 0.05), Costs(1, 1.3, 0.7, 0.2, _stage_mix(rng, 2 * d))):
                repeated = block.repeat(m, "plain")
                peaks = list(simulate(repeated, costs).peak_memory)
                want = _reference_fill_idle(repeated, costs, peaks, 2 * d)
                got = reorder.fill_idle(repeated, costs, peaks, 2 * d)
                assert got[0].programs == want[0].programs and got[1:] == want[1:]


@pytest.mark.parametrize("name", ["1f1b", "zb-1p", "v-min", "v-zb"])
def test_the_h_placements_bound_skips_nothing_it_should_not(monkeypatch, name):
    """The look-ahead skips trials by a bound; with the bound off (every trial looked ahead from, as
    before issue 44) the placement is the same."""
    rng = random.Random(44)
    for d, m in ((3, 7), (6, 12)):
        stages = _stage_mix(rng, SCHEDULES[name].num_stages(d))
        for costs in (Costs(1, 1.1, 0.9, 0.05, (), VocabWork(0.9, 0.9, 0.9, 0.5)),
                      Costs(1, 1.4, 0.8, 0.2, stages, VocabWork(2.5, 2.0, 1.5, 1.0))):
            fast = get_schedule(name, d, m, costs)
            monkeypatch.setattr(vocab_passes, "_BOUND_MARGIN", float("inf"))
            plain = get_schedule(name, d, m, costs)
            monkeypatch.undo()
            assert fast.programs == plain.programs


@pytest.mark.parametrize("name", ["1f1b", "zb-1p", "v-half", "v-zb"])
def test_the_h_placements_bounds_are_below_every_places_pace(name):
    """The placement passes over a place whose bound is later than what it must beat: each bound (the cheap one,
    and the better one made when asked) is at most the place's pace once timed, at every rendezvous (the
    last one's pace is the makespan), with unequal stages and per-device H times too."""
    rng = random.Random(7)
    checked = 0
    for d, m in ((3, 7), (4, 8), (6, 9)):
        stages = _stage_mix(rng, SCHEDULES[name].num_stages(d))
        for costs in (Costs(1, 1.1, 0.9, 0.05, (), VocabWork(0.9, 0.9, 0.9, 0.5)),
                      Costs(1, 1.4, 0.8, 0.2, stages, VocabWork(2.5, 2.0, 1.5, 1.0))):
            schedule = get_schedule(name, d, m, costs.without_vocab())
            placer = vocab_passes._HPlacer(schedule, costs)
            programs = [[placer.ids.of(action) for action in program] for program in schedule.programs]
            times, prefix = placer.run(programs, None), None
            for n in range(len(placer.forwards)):
                places = placer.trials(programs, times, prefix, n)
                for place in places:
                    trial = place.timed()
                    if trial is not None:
                        assert place.cheap <= place.bound() <= trial.pace + 1e-9
                        checked += 1
                chosen, _ = placer.best(places, n)
                trial = chosen.timed()
                programs, times, prefix = trial.programs, trial.times, chosen.prefix_after()
    assert checked > 100


def test_a_shared_proxy_ranking_builds_what_a_fresh_one_builds():
    """best_of's proxy ranking is shared between sizes with the same proxy (d >= 16, m >= 64) and costs;
    each size built after another equals its build from a fresh ranking."""
    from megatron_vshape.schedules.generators import zero_bubble

    costs = Costs(1, 1.04, 0.92, 0.088)
    cells = [("zb-1p", 16, 136), ("zb-1p", 17, 144), ("v-zb", 16, 140)]
    zero_bubble._PROXY_RANKS.clear()
    shared = [get_schedule(name, d, m, costs).programs for name, d, m in cells]
    assert len(zero_bubble._PROXY_RANKS) == 2  # one ranking per family: the second ZB-1P size reused it
    for (name, d, m), programs in zip(cells, shared):
        zero_bubble._PROXY_RANKS.clear()
        assert get_schedule(name, d, m, costs).programs == programs


def test_kept_slot_reorders_are_the_reorders_of_a_fresh_run():
    """The slot reorder's programs are kept per (block, size, cool-down start, memory model) and shared by every
    build with other costs; each equals the reorder run afresh, and a build under other costs reuses them."""
    from megatron_vshape.schedules.generators import slot_reorder
    from megatron_vshape.schedules.generators.slot_reorder import cooldown_starts, slot_schedule

    for d, m in ((4, 9), (6, 12), (9, 40)):
        block = v_min_block(d)
        kept = {start: slot_schedule(block, m, "v-min", 99.0, cooldown_after=start) for start in cooldown_starts(block, m)}
        for start, schedule in kept.items():
            slot_reorder._REORDERED.clear()
            assert slot_schedule(block, m, "v-min", 99.0, cooldown_after=start).programs == schedule.programs
    slot_reorder._REORDERED.clear()
    first = get_schedule("v-half", 6, 12, Costs(1, 1.1, 0.9, 0.05))
    kept_count = len(slot_reorder._REORDERED)
    again = get_schedule("v-half", 6, 12, Costs(1, 1.3, 0.7, 0.2))
    assert kept_count and len(slot_reorder._REORDERED) == kept_count  # the second build reordered nothing anew
    assert {a for program in first.programs for a in program} == {a for program in again.programs for a in program}


def test_an_over_budget_replay_that_stops_early_rejects_what_a_full_one_rejects():
    """The lazy slot memory stops a replay at the first level over its budget (the move is rejected either way);
    the reorders with the full replay are the same."""
    from megatron_vshape.schedules.generators import slot_memory, slot_reorder
    from megatron_vshape.schedules.generators.slot_reorder import cooldown_starts, slot_schedule

    full = slot_memory.LazyMemory._replay
    for d, m in ((5, 10), (8, 16), (12, 12)):
        for block in (v_min_block(d), v_half_block(d)):
            for start in cooldown_starts(block, m):
                slot_reorder._REORDERED.clear()
                fast = slot_schedule(block, m, "x", 99.0, cooldown_after=start).programs
                slot_memory.LazyMemory._replay = lambda self, start_slot, stop_above=None: full(self, start_slot)
                try:
                    slot_reorder._REORDERED.clear()
                    plain = slot_schedule(block, m, "x", 99.0, cooldown_after=start).programs
                finally:
                    slot_memory.LazyMemory._replay = full
                assert fast == plain


def test_builds_with_other_vocabulary_work_share_the_layers_order():
    """The layers' order never depends on the vocabulary work: a build with other vocabulary costs reuses it,
    and each build equals its build from a fresh cache."""
    from megatron_vshape.schedules.generators import registry

    base = Costs(1, 1.1, 0.9, 0.05, _stage_mix(random.Random(3), 12))
    builds = [dataclasses.replace(base, vocab=VocabWork(f, 0.22, 0.22, 1.0)) for f in (0.4, 0.44, 0.52)]
    registry._layers_order.cache_clear()
    shared = [get_schedule("v-half", 6, 12, costs).programs for costs in builds]
    assert registry._layers_order.cache_info().misses == 1 and registry._layers_order.cache_info().hits == 2
    for costs, programs in zip(builds, shared):
        registry._layers_order.cache_clear()
        assert get_schedule("v-half", 6, 12, costs).programs == programs


def test_kept_simulations_are_the_simulations_of_that_schedule():
    """A build's comparisons keep their simulations by the schedule object: the same object under the same
    costs gets the kept result, which equals a fresh simulation; other costs or another object, its own."""
    from megatron_vshape.schedules.generators.simulated import simulated

    costs, other = Costs(1, 1.1, 0.9, 0.05), Costs(1, 1.3, 0.7, 0.2)
    schedule = get_schedule("v-half", 6, 12, costs)
    kept = simulated(schedule, costs)
    assert simulated(schedule, costs) is kept
    fresh = simulate(schedule, costs)
    assert (kept.makespan, kept.bubble_rate, kept.peak_memory) == (fresh.makespan, fresh.bubble_rate, fresh.peak_memory)
    assert simulated(schedule, other).makespan == simulate(schedule, other).makespan != kept.makespan
    copy = dataclasses.replace(schedule)
    assert simulated(copy, costs) is not kept and simulated(copy, costs).schedule is copy
