"""Data-parallel gradient buckets launched at their last W (``--overlap-grad-reduce`` with a split backward).

Megatron's DDP launches a bucket group's all-reduce (or, with the distributed optimizer, its
reduce-scatter) from a per-parameter backward hook, once every parameter of the group has received
its gradient in the last microbatch. With a split backward that moment is wrong for the weights of
megatron's linear layers: their B leaves the gradient to a W that runs later (sometimes much later,
in the cool-down), so a launch at B would reduce a bucket that W still adds to.

:class:`BucketLauncher` launches each bucket group itself, when the last pass that adds to any of
its parameters has run:

* a parameter whose gradient B computes (norms, embeddings, biases, the MoE router, and every weight
  of a B that runs fused with its W) is ready after the chunk's **last B** of the iteration;
* a weight whose gradient a W task adds is ready when **its last W task** has run (the store counts
  the tasks still holding each weight), so within the chunk's last W the buckets of the layers done
  first launch while the W GEMMs of the other layers still run: the overlap Megatron gets from its
  hook in the last microbatch's backward.

The executor keeps Megatron's hooks from registering anything (``no_sync`` for the whole
iteration, as for fused schedules) and silences their ``overlap_grad_reduce`` assertion during a
deferred B (:meth:`BucketLauncher.deferred_b`): that assertion demands a gradient in ``param.grad``
at B, which a deferred weight does not have on purpose. ``finalize_model_grads`` waits for every
bucket as usual (``finish_grad_sync``). A chunk whose W tasks do not name their weight (none today)
launches at its last backward pass, all at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_vshape.schedules.core.actions import Kind
from megatron_vshape.schedules.lowering.messages import DevicePlan


@dataclass
class _BucketGroup:
    """One Megatron bucket group and the parameters it still waits for."""

    group: object  # megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup
    waiting: set[int] = field(default_factory=set)  # id() of parameters not ready yet
    launched: bool = False


@dataclass
class _ChunkGroups:
    params: list  # the chunk's parameters that Megatron reduces
    groups: list[_BucketGroup]
    by_param: dict[int, _BucketGroup]
    last_b_done: bool = False


class BucketLauncher:
    """Launches the overlapped reductions of one iteration's chunks (see the module docstring).

    ``launches`` records, in order, ``(chunk index, bucket group)`` for each launch it made (the
    tests read it). ``split``: the iteration defers W (else nothing here applies); ``launch_early``:
    launch buckets during the pass loop (off when tied copies on one rank are summed after it, so the
    executor's end-of-iteration start launches everything); ``held``: parameters that passes outside
    the layers add to until the call's end (the vocabulary shard's rows: G, and the embedding's gradient
    in the epilogue), never ready in the loop, so their buckets launch with the chunk's rest at its
    start after the loop (:meth:`launch_rest`) and the chunk's other buckets still launch at their last W.
    ``store_of`` returns the weight-gradient
    store *now*: it is created on the first deferred B of the executor's first call, so a store read
    once before the pass loop is None for that whole call, and every weight W still owed would
    count as ready at its chunk's last B (the regression of 86de5c4: the first iteration's buckets
    reduced before their W had added to them).
    """

    def __init__(self, models, plan: DevicePlan, chunk_of_stage: Callable[[int], int], split: bool,
                 store_of: Callable[[], object | None], launch_early: bool = True, held=()):
        self.models = models
        self._held = {id(param) for param in held}
        self._store_of = store_of
        self.chunks: dict[int, _ChunkGroups] = {}
        self.launches: list[tuple[int, object]] = []
        self._last_b: dict[int, int] = {}  # stage -> step index of its last B
        # The DDP configs whose hook asserts under a deferred B (overlap on).
        self._overlapped = {id(c): c for m in models if split and (c := getattr(m, "ddp_config", None)) is not None
                            and c.overlap_grad_reduce}
        if not (split and launch_early):
            return
        for index, step in enumerate(plan.steps):
            if step.action.kind is Kind.B:
                self._last_b[step.action.stage] = index
        self._chunk_of = chunk_of_stage
        for chunk_index, model in enumerate(models):
            groups = _overlapped_bucket_groups(model)
            if groups:
                self.chunks[chunk_index] = _index(model, groups)

    @contextlib.contextmanager
    def deferred_b(self, deferred: bool):
        """Around a B pass: if it defers W, Megatron's hooks run as without overlap (add what came,
        register nothing) instead of asserting on the gradient W has not computed yet."""
        if not deferred or not self._overlapped:
            yield
            return
        for config in self._overlapped.values():
            config.overlap_grad_reduce = False
        try:
            yield
        finally:
            for config in self._overlapped.values():
                config.overlap_grad_reduce = True

    def after_pass(self, step_index: int, stage: int, kind: Kind) -> None:
        """After a pass: at the chunk's last B, everything but the weights W still owes is ready."""
        if kind is not Kind.B or self._last_b.get(stage) != step_index:
            return
        chunk_index = self._chunk_of(stage)
        chunk = self.chunks.get(chunk_index)
        if chunk is None:
            return
        chunk.last_b_done = True
        store = self._store_of()  # None: no B of this rank has deferred anything yet, so nothing is owed
        owed = store.weights_owed(lambda key: key[0] == chunk_index) if store is not None else set()
        if owed is None:  # a pending task that does not name its weight: launch at the chunk's end
            return
        for param in chunk.params:
            if id(param) not in owed:
                self._ready(chunk_index, chunk, param)

    def weight_done(self, chunk_index: int) -> Callable[[object], None]:
        """The callback for one W's tasks: a weight no pending task holds any more is ready."""
        chunk = self.chunks.get(chunk_index)
        if chunk is None:
            return lambda task: None
        store = self._store_of()  # a W runs tasks, so the store exists

        def done(task) -> None:
            weight = getattr(task, "weight", None)
            if weight is not None and chunk.last_b_done and store.holds(weight) == 0:
                self._ready(chunk_index, chunk, weight)

        return done

    def launch_rest(self, chunk_index: int) -> bool:
        """The chunk's last backward pass has run: launch what is left. False if this launcher
        does not handle the chunk (the caller starts Megatron's reduction itself)."""
        chunk = self.chunks.get(chunk_index)
        if chunk is None:
            return False
        for group in chunk.groups:
            self._launch(chunk_index, group)
        return True

    def _ready(self, chunk_index: int, chunk: _ChunkGroups, param) -> None:
        group = chunk.by_param.get(id(param))
        if group is None or id(param) in self._held:
            return
        group.waiting.discard(id(param))
        if not group.waiting:
            self._launch(chunk_index, group)

    def _launch(self, chunk_index: int, group: _BucketGroup) -> None:
        if group.launched:
            return
        group.launched = True
        self.launches.append((chunk_index, group.group))
        group.group.start_grad_sync()


def _overlapped_bucket_groups(model) -> list:
    ddp_config = getattr(model, "ddp_config", None)
    if ddp_config is None or not ddp_config.overlap_grad_reduce:
        return []
    return list(getattr(model, "bucket_groups", [])) + list(getattr(model, "expert_parallel_bucket_groups", []))


def _index(model, groups) -> _ChunkGroups:
    by_param: dict[int, _BucketGroup] = {}
    entries, params = [], []
    for group in groups:
        entry = _BucketGroup(group, {id(p) for p in group.params})
        entries.append(entry)
        for param in group.params:
            by_param[id(param)] = entry
            params.append(param)
    return _ChunkGroups(params, entries, by_param)
