"""Step time of the balanced layer layout and of vocabulary parallelism vs the uniform layout, side by side
on CPU ranks (gloo).

    python scripts/bench_layout.py [--schedule v-half] [--pp 4] [--iters 10] [--json FILE]

A tiny GPT whose vocabulary makes the LM head worth several layers (default: 16 layers, hidden
256, vocabulary 12288, sequence 64, microbatch 2: by FLOPs the head is about 3.8 layers). Three
layouts are built in one process group: the uniform split; ``balanced``, the one
``--pipeline-layout balanced`` picks in training (the planner's FLOPs model,
:func:`megatron_vshape.planner.balance.choose_layout`); and ``balanced-measured``, chosen the same
way from per-stage pass times measured on the uniform layout first (``--calibration`` iterations:
on CPU small layers are overhead-bound while the head is one large GEMM, so FLOPs misjudge it).
A fourth row, ``vocab-parallel``, is the uniform layout with ``--pipeline-vocab-parallel`` (the
embedding, LM head and loss sharded over the pipeline ranks, run as the schedule's H and G passes), built
from the calibration run's costs. Its predicted ratio is the simulator's on the two schedules that ran
(vocab-parallel over uniform), each with the pass costs measured in the same timed iterations (per stage;
H from the last rank to arrive at each rendezvous, so the waits are the simulator's to predict) plus the
call's measured time outside its passes (the vocabulary prologue and epilogue); the ratio planned from the
calibration run alone is printed beside it.
Their iterations rotate (uniform, balanced, measured, vocab-parallel; balanced, ...), so that
load from other processes hits all alike. Each iteration's wall and CPU time is the slowest
rank's; the table reports medians after ``--warmup`` iterations, each layout / uniform both as the
ratio of the medians and as the median of each step's pair (runs of a step are back to back).

Ranks need a core each for a balanced pipeline to show: with more ranks than free cores, an idle
rank's core goes to another rank and the iteration time tends to total work / cores, which no
layout changes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, replace

from megatron_vshape.testing import spawn
from megatron_vshape.testing.tiny_gpt import ModelSettings, build_gpt, forward_step, make_config, microbatch

FLOPS, MEASURED, VOCAB = "balanced", "balanced-measured", "vocab-parallel"


def _worker(rank, world_size, model: ModelSettings, schedule: str, microbatches, warmup, iters, calibration,
            balanced=True, g_after_next_h=False):
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_vshape.megatron.cpu_mode import enable_cpu_mode

    torch.set_num_threads(1)
    enable_cpu_mode()
    _watch_collectives()
    parallel_state.initialize_model_parallel(1, world_size)
    model_parallel_cuda_manual_seed(model.seed)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    data = [dict(microbatch(model, i), index=i) for i in range(microbatches)]
    uniform, flops_choice = choose(model, schedule, world_size, microbatches)
    rows = {"uniform": _build(schedule, model, world_size, pp_rank, uniform, record_timeline=True)}
    # Calibration: per-stage F/B/W times of the uniform layout give the head's real cost in layers.
    stage_times = _stage_times(rows["uniform"], data, model, microbatches, len(uniform), calibration)
    costs, extras = measured_costs(stage_times, uniform, model.num_layers, world_size)
    measured_choice = choose_layout(_planner_model(model), schedule, world_size, microbatches, costs, extras=extras)
    counts = {"uniform": uniform, FLOPS: flops_choice.layers_per_stage, MEASURED: measured_choice.layers_per_stage}
    for name in (FLOPS, MEASURED) if balanced else ():  # --no-balanced: the uniform and vocabulary rows only
        rows[name] = _build(schedule, model, world_size, pp_rank, counts[name])
    counts[VOCAB] = uniform
    # Built, like the measured layout, from the calibration run's costs (its vocabulary passes timed on their
    # own, every rank in step): the schedule the prediction simulates.
    vocab_times = _vocab_pass_seconds(model, data, calibration)
    spread = _spread_costs(world_size, costs, vocab_times)
    rows[VOCAB] = _build(schedule, model, world_size, pp_rank, uniform, record_timeline=True, vocab_costs=spread,
                         g_after_next_h=g_after_next_h)
    names = list(rows)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    ran: dict[str, list] = {"uniform": [], VOCAB: []}  # this rank's passes of each timed iteration of these rows
    for step in range(warmup + iters):
        # Rotate which layout goes first, so none always follows another.
        for name in names[step % len(names):] + names[:step % len(names)]:
            wall, busy = _time_iteration(*rows[name], data, model, microbatches)
            if step >= warmup:
                times[name].append(wall)
                cpu[name].append(busy)
                if name in ran:
                    ran[name].append(list(rows[name][0].last_timeline))
    gathered = {name: _gathered(passes) for name, passes in ran.items()}
    vocab_passes = _pass_means([passes[-1] for passes in gathered[VOCAB]])  # the last timed call
    h_waits = _h_waits(gathered[VOCAB], _gathered(list(_COLLECTIVES)), _gathered(list(_SLOTS)))
    in_run = {name: _simulate_as_ran(rows[name][0].schedule(world_size, microbatches), by_rank, times[name])
              for name, by_rank in gathered.items()}
    # Each timed step on its own: its passes' costs, simulated, plus its time outside them (under a varying load
    # the mean costs of all steps predict the mean step, not the median one the table reports).
    per_step = {name: [_simulate_as_ran(rows[name][0].schedule(world_size, microbatches),
                                        [calls[i:i + 1] for calls in by_rank], times[name][i:i + 1]).seconds
                       for i in range(len(times[name]))] for name, by_rank in gathered.items()}
    parallel_state.destroy_model_parallel()
    predicted = {"uniform": 1.0, FLOPS: flops_choice.iteration_time / flops_choice.reference_time,
                 MEASURED: measured_choice.iteration_time / measured_choice.reference_time,
                 VOCAB: in_run[VOCAB].seconds / in_run["uniform"].seconds}
    planned = _spread_ratio(model, schedule, world_size, microbatches, uniform, costs, extras, spread, g_after_next_h)
    return {"times": times, "cpu": cpu, "counts": counts, "predicted": predicted, "stage_times": stage_times,
            "vocab_passes": vocab_passes, "in_run": {name: vars(row) for name, row in in_run.items()},
            "vocab_planned": planned, "h_waits": h_waits, "step_predicted": per_step,
            "vocab_predicted": _spread_pass_times(schedule, world_size, spread),
            "extras": {"embedding": extras.embedding, "head": extras.head}}


@dataclass(frozen=True)
class InRunPrediction:
    """One row's time as the simulator gives it from the pass costs measured in the timed iterations
    themselves (:func:`_simulate_as_ran`), seconds."""

    makespan: float  # the simulated schedule that ran, with those costs: first start to last end, any rank
    outside: float  # the median time of a call outside its passes (the vocabulary prologue and epilogue,
    #                 the gradient reduction, the executor's set-up): measured, serial by construction
    costs: dict  # the measured costs given to the simulator (F, B, W per stage; H, G per shard)

    @property
    def seconds(self) -> float:
        return self.makespan + self.outside


# This rank's host time in the collectives the vocabulary passes call through ``torch.distributed`` (broadcast,
# all_gather, all_reduce, reduce): (start, end, issued) per call (``issued``: a call's own time, True; the wait
# for an async call's work, False), perf_counter seconds like the executor's pass timeline.
_COLLECTIVES: list[tuple[float, float, bool]] = []
_SLOTS: list[tuple[float, float]] = []  # (start, end) of each embedding slot (runtime/vocab_embedding.py), if any


def _watch_collectives() -> None:
    """Time the host in every collective call and every wait for an async one (:data:`_COLLECTIVES`): a blocking
    call, an async call's post and its work's ``wait``. Any version of the executor calls them through the
    module, so the same watch measures any version."""
    import time

    import torch.distributed as dist

    class Watched:
        def __init__(self, work):
            self._work = work

        def wait(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return self._work.wait(*args, **kwargs)
            finally:
                _COLLECTIVES.append((start, time.perf_counter(), False))

        def __getattr__(self, name):
            return getattr(self._work, name)

    for name in ("broadcast", "all_gather", "all_reduce", "reduce"):
        def watched(*args, _call=getattr(dist, name), **kwargs):
            start = time.perf_counter()
            work = _call(*args, **kwargs)
            _COLLECTIVES.append((start, time.perf_counter(), True))
            return Watched(work) if work is not None and kwargs.get("async_op") else work

        setattr(dist, name, watched)
    try:  # the embedding's collectives, which later versions run at the start of an H (their slot)
        from megatron_vshape.runtime.vocab_embedding import EmbeddingPasses
    except ImportError:
        return

    def run_slot(self, slot, _run=EmbeddingPasses.run_slot):
        start = time.perf_counter()
        try:
            return _run(self, slot)
        finally:
            _SLOTS.append((start, time.perf_counter()))

    EmbeddingPasses.run_slot = run_slot


def _h_waits(by_rank: list, collectives: list, slots: list) -> list[dict[str, float]]:
    """Per rank, mean ms per microbatch over the timed calls: ``in H`` (its H pass, start to end),
    ``after last`` (from the last rank's arrival at that rendezvous to this rank's end of H: the
    collectives' own cost, without the skew of the arrivals, which the schedule sets), ``arrival`` (how
    long before the last rank it arrived) and ``in G`` (its G, which now also waits for the loss gradient);
    ``blocked`` (the host's time inside H in collective calls and waits, ``collectives``: :data:`_COLLECTIVES`
    of each rank: the skew and the collectives' own time), ``computing`` (``in H`` less ``blocked``),
    ``calls`` (collectives issued inside H, per microbatch) and ``blocked in G``; ``embedding`` (the
    embedding's slot inside H, where a version runs it there: ``slots``, :data:`_SLOTS` of each rank; its
    collectives and compute are left out of ``blocked``, ``computing`` and ``calls``).
    From the pass timeline and the collectives' watch alone, so the same script measures any version of the
    executor."""
    import bisect
    from collections import defaultdict

    from megatron_vshape.schedules.core.actions import VocabKind

    spans = defaultdict(dict)  # (iteration, microbatch) -> rank -> (start, end)
    g = defaultdict(list)
    own = defaultdict(lambda: defaultdict(list))  # rank -> kind -> (start, end) of its own passes
    for rank, calls in enumerate(by_rank):
        for i, passes in enumerate(calls):
            for action, start, end in passes:
                if action.kind is VocabKind.H:
                    spans[i, action.microbatch][rank] = (start, end)
                    own[rank]["H"].append((start, end))
                elif action.kind is VocabKind.G:
                    g[rank].append(end - start)
                    own[rank]["G"].append((start, end))

    ordered_slots = [sorted(spans) for spans in slots]
    ordered = [sorted(c for c in calls if not any(a <= c[0] <= b for a, b in ordered_slots[rank]))
               for rank, calls in enumerate(collectives)]

    def inside(rank, start, end):
        calls = ordered[rank]
        lo = bisect.bisect_left(calls, (start,))
        hi = bisect.bisect_right(calls, (end, float("inf")))
        chosen = calls[lo:hi]
        return sum(min(e, end) - s for s, e, _ in chosen), sum(1 for *_, issued in chosen if issued)

    def slot_time(rank, start, end):
        return sum(min(b, end) - max(a, start) for a, b in ordered_slots[rank] if a < end and b > start)

    out = []
    for rank in range(len(by_rank)):
        inside_h, after, early = [], [], []
        for ranks in spans.values():
            last = max(start for start, _ in ranks.values())
            start, end = ranks[rank]
            inside_h.append(end - start)
            after.append(end - last)
            early.append(last - start)
        blocked_h = [inside(rank, s, e) for s, e in own[rank]["H"]]
        blocked_g = [inside(rank, s, e)[0] for s, e in own[rank]["G"]]
        mean_h = statistics.fmean(inside_h)
        blocked = statistics.fmean(b for b, _ in blocked_h)
        embedding = statistics.fmean(slot_time(rank, s, e) for s, e in own[rank]["H"])
        out.append({"in H": 1e3 * mean_h, "after last": 1e3 * statistics.fmean(after),
                    "arrival": 1e3 * statistics.fmean(early), "in G": 1e3 * statistics.fmean(g[rank]),
                    "blocked": 1e3 * blocked, "computing": 1e3 * (mean_h - blocked - embedding),
                    "embedding": 1e3 * embedding,
                    "calls": statistics.fmean(n for _, n in blocked_h), "blocked in G": 1e3 * statistics.fmean(blocked_g)})
    return out


def _gathered(passes: list) -> list:
    """Every rank's ``passes`` (a list per timed iteration), by rank."""
    import torch

    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, passes)
    return out


def _simulate_as_ran(schedule, by_rank: list, walls: list[float]) -> InRunPrediction:
    """The simulator's time for ``schedule`` (the one that ran) with the pass costs measured in the same
    iterations (``by_rank[r][i]``: rank r's (action, start, end) of timed iteration i; ``walls[i]``: that
    call's wall time, slowest rank): F, B and W the mean per stage; H per rank, the time from the LAST rank's
    arrival at each rendezvous to that rank's end (the pass's own work and collectives: the ranks that arrived
    earlier waited, which is the simulator's to predict), averaged, the last stage's rank's apart; G the last
    stage's rank's mean (the others' G waits for its loss gradient, which the simulator models). A call's time
    outside its passes (``walls[i]`` less the span from the first pass's start on any rank to the last one's
    end) is added."""
    from collections import defaultdict

    from megatron_vshape.runtime.replan import typical_chunk, with_measured_stages
    from megatron_vshape.schedules.core.actions import Kind, VocabKind
    from megatron_vshape.schedules.core.schedule import Costs, VocabWork
    from megatron_vshape.schedules.core.simulator import simulate

    layers = defaultdict(list)  # (kind, stage) -> seconds
    rendezvous = defaultdict(dict)  # (iteration, microbatch) -> rank -> (start, end) of its H
    g_times, outside = defaultdict(list), []
    for i, wall in enumerate(walls):
        spans = [passes[i] for passes in by_rank]
        for rank, rank_passes in enumerate(spans):
            for action, start, end in rank_passes:
                if action.kind is VocabKind.H:
                    rendezvous[i, action.microbatch][rank] = (start, end)
                elif action.kind is VocabKind.G:
                    g_times[rank].append(end - start)
                else:
                    layers[action.kind, action.stage].append(end - start)
        first = min(p[0][1] for p in spans if p)
        last = max(p[-1][2] for p in spans if p)
        outside.append(max(wall - (last - first), 0.0))
    # Each stage's mean F, B, W per V chunk's layers (-1: none ran), as the executor's re-plan reads them.
    scale = schedule.placement.layer_scale
    stage_seconds = [tuple(statistics.fmean(layers[kind, s]) / scale if layers[kind, s] else -1.0
                           for kind in (Kind.F, Kind.B, Kind.W)) for s in range(schedule.num_stages)]
    seconds = typical_chunk(stage_seconds)
    f, b, w = seconds["f"], seconds["b"], seconds["w"]
    costs = with_measured_stages(Costs(f, b, w), seconds, stage_seconds, Costs())
    measured = {"F": f, "B": b, "W": w}
    if schedule.vocab_parallel:
        # Per rank, as the simulator models H and G (VocabWork.holder): every rank's H from the last arrival
        # (the rendezvous) to its own end; the last stage's rank's H is longer (the loss function, the wait for
        # the reduce); G's compute from the last stage's rank (the others' G also waits for its loss gradient,
        # which the simulator times from that H's end).
        p = schedule.num_devices
        holder = schedule.placement.device_of(schedule.num_stages - 1)
        after = {rank: statistics.fmean(ranks[rank][1] - max(start for start, _ in ranks.values())
                                        for ranks in rendezvous.values()) for rank in range(p)}
        h = statistics.fmean(after[rank] for rank in range(p) if rank != holder)
        g = statistics.fmean(g_times[holder])
        try:
            # (a step's noise can make the last stage's rank's H the shorter: then it is taken as the others')
            work = VocabWork(f=p * h / f, b=0.0, w=p * g / w, holder=max(after[holder] - h, 0.0) / f)
        except TypeError:  # a checkout before the per-rank H (measured side by side): one H, the holder's
            work = VocabWork(f=p * after[holder] / f, b=0.0, w=p * g / w)
        costs = replace(costs, vocab=work)
        measured.update(H=h, H_holder=after[holder], G=g)
    return InRunPrediction(simulate(schedule, costs).makespan_total, statistics.median(outside), measured)


def choose_layout(*args, **kwargs):
    from megatron_vshape.planner.balance import choose_layout as choose

    return choose(*args, **kwargs)


def _stage_times(row, data, model, microbatches, num_stages, iterations) -> list[list[float]]:
    """Mean seconds of one F, B and W pass per global stage (rows F, B, W), over all ranks."""
    import torch

    sums = torch.zeros(3, num_stages, dtype=torch.float64)
    counts = torch.zeros(3, num_stages, dtype=torch.float64)
    for _ in range(iterations):
        _time_iteration(*row, data, model, microbatches)
        for action, start, end in row[0].last_timeline:
            kind = "FBW".index(action.kind.value)
            sums[kind, action.stage] += end - start
            counts[kind, action.stage] += 1
    torch.distributed.all_reduce(sums)
    torch.distributed.all_reduce(counts)
    return (sums / counts.clamp(min=1)).tolist()


def measured_costs(stage_times, counts, num_layers: int, pp: int):
    """(Costs of one V chunk, StageExtras) from a uniform layout's per-stage pass times.

    A layer's F/B/W is the middle stages' mean per layer; the first and last stages' surplus over
    their layers is the embedding's and the head's work, in layers' worth."""
    from megatron_vshape.planner.balance import StageExtras
    from megatron_vshape.schedules.core.schedule import Costs

    middle = range(1, len(counts) - 1)
    per_layer = [sum(stage_times[k][s] / counts[s] for s in middle) / len(middle) for k in range(3)]

    def surplus(stage: int) -> tuple[float, float, float]:
        return tuple(max(stage_times[k][stage] / per_layer[k] - counts[stage], 0.0) for k in range(3))

    chunk = num_layers / (2 * pp)  # the schedule core's unit: one V chunk
    costs = Costs(*(chunk * t for t in per_layer))
    return costs, StageExtras(embedding=surplus(0), head=surplus(len(counts) - 1))


def _pass_means(by_rank: list) -> dict[str, float]:
    """Mean seconds of each kind of pass (F, B, W, H, G) of one call, over all ranks (``by_rank``: each rank's
    (action, start, end) of that call)."""
    from collections import defaultdict

    seconds = defaultdict(list)
    for passes in by_rank:
        for action, start, end in passes:
            seconds[action.kind.value].append(end - start)
    return {kind: statistics.fmean(seconds[kind]) for kind in "FBWHG" if seconds[kind]}


def _spread_pass_times(schedule, pp, spread) -> dict[str, float]:
    """The simulator's seconds per pass of the vocabulary-parallel row (F, B, W of a V chunk's layers x the
    placement's layer scale; H and G of one shard), from the calibration run's costs."""
    from megatron_vshape.schedules.core.schedule import vocab_pass_times
    from megatron_vshape.schedules.generators.registry import SCHEDULES

    scale = 2.0 / SCHEDULES[schedule].chunks_per_device()
    h, g = vocab_pass_times(spread, pp)
    return {"F": spread.f * scale, "B": spread.b * scale, "W": spread.w * scale, "H": h, "G": g}


def _vocab_pass_seconds(model: ModelSettings, data, iterations: int) -> tuple[float, float]:
    """(H, G) seconds of one shard's vocabulary passes, timed on their own with every rank in step (their
    collectives included, no pipeline around them): the mean over ``iterations`` x microbatches after one
    warm-up round, max over ranks."""
    import time

    import torch
    from megatron.core import parallel_state

    from megatron_vshape.megatron.vocab_layers import VocabShardLayers

    layers = VocabShardLayers(model.vocab_size, model.hidden_size, tied=model.tied_embeddings,
                              tp_group=parallel_state.get_tensor_model_parallel_group(),
                              pp_group=parallel_state.get_pipeline_model_parallel_group())
    torch.nn.init.normal_(layers.output_weight, std=0.02)
    hidden = torch.randn(model.seq_length, model.micro_batch_size, model.hidden_size)
    h = g = 0.0
    count = 0
    for round_ in range(iterations + 1):  # round 0 warms up (first touch of the buffers)
        if round_ == 1:
            h = g = 0.0
            count = 0
        for batch in data:
            torch.distributed.barrier()
            start = time.perf_counter()
            out = layers.output_forward(hidden, batch["labels"])
            _, task = layers.output_backward(out, torch.ones_like(out.loss))
            middle = time.perf_counter()
            task()
            h, g, count = h + middle - start, g + time.perf_counter() - middle, count + 1
    times = torch.tensor([h / count, g / count], dtype=torch.float64)
    torch.distributed.all_reduce(times, op=torch.distributed.ReduceOp.MAX)
    return times[0].item(), times[1].item()


def _spread_costs(pp: int, costs, vocab_seconds: tuple[float, float]):
    """The calibration run's costs with the vocabulary passes' measured seconds (per shard) as their work."""
    from megatron_vshape.schedules.core.schedule import VocabWork

    h, g = vocab_seconds
    return replace(costs, vocab=VocabWork(f=pp * h / costs.f, b=0.0, w=pp * g / costs.w))


def _spread_ratio(model, schedule, pp, microbatches, uniform, costs, extras, spread, g_after_next_h=False) -> float:
    """Simulated time with the measured head's work spread over the ranks (vocabulary passes) over the
    uniform layout's with the head on its stage, both from the calibration run's costs."""
    from megatron_vshape.megatron.pipeline_layout import layout_costs
    from megatron_vshape.planner.balance import stage_work
    from megatron_vshape.schedules.core.simulator import simulate
    from megatron_vshape.schedules.generators.registry import get_schedule

    plain = layout_costs(costs, uniform, stage_work(_planner_model(model), uniform, extras=extras))
    vocab = get_schedule(schedule, pp, microbatches, spread)
    if g_after_next_h:
        from megatron_vshape.testing.g_after_next_h import g_after_next_h as moved

        vocab = moved(vocab)
    return (simulate(vocab, spread).makespan
            / simulate(get_schedule(schedule, pp, microbatches, plain), plain).makespan)


def _build(schedule, model, world_size, pp_rank, counts, record_timeline=False, vocab_costs=None,
           g_after_next_h=False):
    """(forward-backward function, DDP chunks) of ``schedule`` with ``counts`` layers per stage; ``vocab_costs``:
    the costs (with the vocabulary passes') to build the schedule from, to run ``--pipeline-vocab-parallel``;
    ``g_after_next_h``: each G moved after the next H (``--g-after-next-h``)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from megatron_vshape.megatron.pipeline_layout import layout_costs
    from megatron_vshape.planner.balance import stage_work
    from megatron_vshape.runtime import build_forward_backward_func, build_model_chunks
    from megatron_vshape.runtime.layer_layout import megatron_layout
    from megatron_vshape.schedules.core.schedule import Costs

    planner = _planner_model(model)
    uneven = len(set(counts)) > 1
    # As training builds it: per-stage work (LM head included) only for an uneven layout.
    costs = layout_costs(Costs(), counts, stage_work(planner, counts)) if uneven else Costs()
    if vocab_costs is not None:
        costs = vocab_costs
    extra = {}
    if g_after_next_h:
        from megatron_vshape.testing.g_after_next_h import GAfterNextHExecutor

        extra["executor_type"] = GAfterNextHExecutor
    func = build_forward_backward_func(schedule, costs=costs, record_timeline=record_timeline, **extra)
    placement = func.schedule(world_size, 8).placement
    vp = None if placement.chunks_per_device == 1 else placement.chunks_per_device
    layout = megatron_layout(counts, placement) if uneven else None
    config = make_config(model, world_size, 1, vp, False, layout)
    config.finalize_model_grads_func = finalize_model_grads
    chunks = build_model_chunks(placement, pp_rank, lambda cs, pgs: build_gpt(
        config, model, cs.pre_process, cs.post_process, cs.vp_stage, pgs, placement.num_stages))
    if vocab_costs is not None:
        try:
            from megatron_vshape.megatron.vocab_surgery import install_vocab_parallel
        except ImportError:  # a checkout before issue 42 (the script measures it side by side)
            from megatron_vshape.megatron.vocab_layers import install_vocab_parallel

        install_vocab_parallel(chunks, placement)
    return func, [DistributedDataParallel(config, DistributedDataParallelConfig(), c) for c in chunks]


def _time_iteration(func, ddp, data, model, microbatches) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one iteration, each the slowest rank's. The busiest rank's
    CPU time is the work of the device that sets the pace, and is less sensitive than wall time
    to other processes sharing the cores."""
    import time

    import torch

    for m in ddp:
        m.zero_grad_buffer()
    iterators = [iter(data) for _ in ddp]
    torch.distributed.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    func(forward_step_func=forward_step, data_iterator=iterators if len(ddp) > 1 else iterators[0],
               model=ddp if len(ddp) > 1 else ddp[0], num_microbatches=microbatches,
               seq_length=model.seq_length, micro_batch_size=model.micro_batch_size)
    elapsed = torch.tensor([time.perf_counter() - start, time.process_time() - cpu_start], dtype=torch.float64)
    torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
    return elapsed[0].item(), elapsed[1].item()


def _planner_model(model: ModelSettings):
    from megatron_vshape.planner.model import GPTModel

    return GPTModel("bench", model.num_layers, model.hidden_size, model.num_heads, model.seq_length,
                    model.vocab_size)


def choose(model: ModelSettings, schedule: str, pp: int, microbatches: int):
    """(uniform counts, LayoutChoice) as ``--pipeline-layout uniform`` / ``balanced`` pick them."""
    from megatron_vshape.layout_flag import uniform_layout
    from megatron_vshape.planner.balance import placement_for

    stages = placement_for(schedule, pp).num_stages
    return uniform_layout(model.num_layers, stages), choose_layout(_planner_model(model), schedule, pp, microbatches)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", default="v-half")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=12288)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--calibration", type=int, default=2,
                        help="iterations of the uniform layout timed per pass to measure the head's cost")
    parser.add_argument("--no-balanced", action="store_true",
                        help="time only the uniform and the vocabulary-parallel rows (half the time)")
    parser.add_argument("--g-after-next-h", action="store_true",
                        help="the vocab-parallel row with each G after the next H on the last stage's rank too (the "
                             "generators already run it there on every other rank, so that every loss gradient but "
                             "the last rides in the next H's broadcast; testing/g_after_next_h.py)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    if args.pp < 2:
        parser.error("--pp must be >= 2 (a pipeline)")
    if args.iters < 1 or args.warmup < 0 or args.calibration < 1:
        parser.error("--iters and --calibration must be >= 1 and --warmup >= 0")
    model = replace(ModelSettings(), num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                    seq_length=args.seq, vocab_size=args.vocab, micro_batch_size=args.micro_batch)
    try:
        choose(model, args.schedule, args.pp, args.microbatches)  # bad sizes fail here, in one line
    except ValueError as error:
        parser.error(" ".join(str(error).split()))
    (result, *_) = spawn(_worker, args.pp, (model, args.schedule, args.microbatches, args.warmup, args.iters,
                                             args.calibration, not args.no_balanced, args.g_after_next_h),
                         timeout=args.timeout)
    report = _report(args, result)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    return 0


def _report(args, result) -> dict:
    times, counts, predicted = result["times"], result["counts"], result["predicted"]
    median = {name: statistics.median(t) for name, t in times.items()}
    cpu = {name: statistics.median(t) for name, t in result["cpu"].items()}
    # The runs of one step ran back to back, under the same outside load: their ratio is the
    # steadier statistic on a shared machine.
    paired = {name: statistics.median(x / u for u, x in zip(times["uniform"], t)) for name, t in times.items()}
    extras = result["extras"]
    print(f"{args.schedule}, pp={args.pp}, m={args.microbatches}: {args.layers} layers, hidden {args.hidden}, "
          f"vocab {args.vocab}, seq {args.seq}, microbatch {args.micro_batch} "
          f"(median of {args.iters} rotating iterations after {args.warmup} warm-up; slowest rank)")
    print("  measured on the uniform layout, in layers' worth of F/B/W: head "
          + "/".join(f"{x:.2f}" for x in extras["head"]) + ", embedding "
          + "/".join(f"{x:.2f}" for x in extras["embedding"]))
    print(f"  {'layout':18s} {'layers per stage':24s} {'median ms':>10s}  {'/ uniform':>9s}  {'paired':>7s}  "
          f"{'busiest CPU ms':>14s}  {'/ uniform':>9s}  {'predicted':>9s}")
    for name in times:
        layers = ",".join(str(c) for c in counts[name])
        print(f"  {name:18s} {layers:24s} {median[name] * 1e3:10.1f}  {median[name] / median['uniform']:9.3f}  "
              f"{paired[name]:7.3f}  {cpu[name] * 1e3:14.1f}  {cpu[name] / cpu['uniform']:9.3f}  "
              f"{predicted[name]:9.3f}")
    measured, want = result["vocab_passes"], result["vocab_predicted"]
    print("  vocab-parallel row, mean ms per pass measured (planned from the calibration): "
          + ", ".join(f"{k} {measured[k] * 1e3:.1f} ({want[k] * 1e3:.1f})" for k in "FBWHG" if k in measured))
    print("  H waits of the vocab-parallel row, mean ms per microbatch, per pipeline rank (in H; of which from the "
          "last rank's arrival to the end; before it; and in G; H's host time in collective calls and waits, "
          "the rest, and the embedding's slot where it runs in H):")
    for rank, row in enumerate(result["h_waits"]):
        print(f"    rank {rank}: in H {row['in H']:.2f}, after the last arrival {row['after last']:.2f}, "
              f"arrival {row['arrival']:.2f}, in G {row['in G']:.2f}; in H blocked in collectives "
              f"{row['blocked']:.2f} ({row['calls']:.1f} calls), computing {row['computing']:.2f}, the embedding's "
              f"slot {row['embedding']:.2f}; in G blocked {row['blocked in G']:.2f}")
    in_run = result["in_run"]
    print(f"  predicted {VOCAB} ratio: the simulator on the schedules that ran, with the passes' costs measured in "
          "the same iterations (H: from the last rank's arrival), plus each call's time outside its passes")
    for name, row in in_run.items():
        print(f"    {name:16s} simulated {row['makespan'] * 1e3:8.1f} ms + outside the passes {row['outside'] * 1e3:6.1f} ms"
              f" = {(row['makespan'] + row['outside']) * 1e3:8.1f} ms (measured {median[name] * 1e3:8.1f}); costs ms: "
              + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in row["costs"].items()))
    steps = result["step_predicted"]
    step_ratio = [(v / u) / (pv / pu) for u, v, pu, pv in zip(times["uniform"], times[VOCAB], steps["uniform"],
                                                              steps[VOCAB])]
    step_each = {name: statistics.median(t / p for t, p in zip(times[name], steps[name])) for name in steps}
    print(f"    per step (each step's own passes simulated, plus its time outside them): measured / predicted, median "
          f"over the steps: uniform {step_each['uniform']:.3f}, {VOCAB} {step_each[VOCAB]:.3f}; the ratio "
          f"{statistics.median(step_ratio):.3f} (predicted ratio {statistics.median(pv / pu for pu, pv in zip(steps['uniform'], steps[VOCAB])):.3f})")
    print(f"    measured ratio / predicted: {paired[VOCAB] / predicted[VOCAB]:.3f} (paired), "
          f"{median[VOCAB] / median['uniform'] / predicted[VOCAB]:.3f} (medians); passes alone predicted "
          f"{in_run[VOCAB]['makespan'] / in_run['uniform']['makespan']:.3f}; planned from the calibration run "
          f"{result['vocab_planned']:.3f}")
    return {"config": vars(args), "vocab_pass_s": measured, "h_waits_ms": result["h_waits"],
            "step_predicted_s": steps, "step_measured_over_predicted": step_each,
            "step_ratio_measured_over_predicted": statistics.median(step_ratio), "vocab_pass_predicted_s": want, "in_run": in_run,
            "vocab_planned_ratio": result["vocab_planned"], "layouts": {k: list(v) for k, v in counts.items()}, "times_s": times,
            "median_s": median, "cpu_s": result["cpu"], "median_cpu_s": cpu, "paired_ratio": paired, "predicted_ratio": predicted, "extras": extras,
            "stage_times_s": result["stage_times"]}


if __name__ == "__main__":
    sys.exit(main())
