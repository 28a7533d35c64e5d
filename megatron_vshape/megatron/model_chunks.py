"""V placement in megatron.training's model construction, and stage questions answered for the V.

``get_model``'s model provider and the config-container ``GPTModelBuilder`` both go through
:class:`ChunkBuilder` (installed by :func:`wrap_model_construction`): chunk 1 of rank i becomes V stage
2d-1-i with its layer offsets, pre/post-process and tied embeddings on rank 0, every layer optionally
initialised from a (seed, global layer) stream. :func:`v_stage_predicates` makes
``parallel_state.is_pipeline_first/last_stage`` answer for the V chunk that is running.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

from ..runtime.placement import _unwrap
from . import hybrid_pattern, pipeline_layout
from .flags import V_SCHEDULE_NAMES, ConfigError


class ChunkBuilder:
    """Builds megatron model chunks for the chosen schedule, whichever way megatron.training builds them.

    * V placement: chunk ``vp_stage`` of pipeline rank i is built as V stage i (chunk 0) or 2d-1-i
      (chunk 1): its pre/post-process flags and a process-group collection whose pipeline view gives
      megatron's layer offsets for that stage (:mod:`megatron_vshape.runtime.placement`); once both chunks
      exist, a tied output layer gets the embedding's weights (both live on rank 0).
    * ``--schedule-invariant-init``: each chunk is built under :func:`dropout_seed.invariant_init`.
    """

    def __init__(self, args):
        self.args = args
        self.is_v = args.pipeline_schedule in V_SCHEDULE_NAMES
        self._chunks: list = []

    def build(self, make, pre_process, post_process, vp_stage, pg_collection, config=None):
        """``make(pre_process, post_process, vp_stage, pg_collection)`` builds one megatron module;
        ``config``: the TransformerConfig it builds from, when built beforehand (config containers)."""
        import contextlib

        from megatron.core import parallel_state

        if self.is_v:
            pre_process, post_process, vp_stage, pg_collection = self._v_chunk(vp_stage, pg_collection)
        context = contextlib.nullcontext()
        if self.args.schedule_invariant_init:
            from .dropout_seed import invariant_init

            context = invariant_init(self.args.seed, parallel_state.get_tensor_model_parallel_rank())
        with context, self._layout_for_build(config):
            model = make(pre_process, post_process, vp_stage, pg_collection)
        self._check_layers(model, vp_stage)
        if self.is_v:
            self._chunks.append(model)
            if len(self._chunks) == 2:
                from megatron_vshape.runtime.placement import tie_output_to_embedding

                tie_output_to_embedding(self._chunks)
                self._chunks = []
        if getattr(self.args, "pipeline_vocab_parallel", False):
            from .vocab_surgery import add_built_chunk

            add_built_chunk(self, model)  # after the rank's last chunk: vocabulary shards (vocab_surgery.py)
        return model

    @contextlib.contextmanager
    def _layout_for_build(self, config=None):
        """On a V with an uneven --pipeline-layout, the model gets megatron's layout class that answers
        for V chunks (runtime.layer_layout): a ``config`` built beforehand (config containers) keeps it
        for good (its sharded_state_dict asks later); a config the provider builds from args gets it
        because args carry it while the provider runs. Args keep the text otherwise: checkpoints
        store args and reload them with only safe classes."""
        layers = pipeline_layout.counts(self.args)
        if not self.is_v or layers is None:
            yield
            return
        from megatron.core import parallel_state

        from megatron_vshape.runtime.layer_layout import megatron_layout
        from megatron_vshape.schedules.core.schedule import Placement

        placement = Placement.v_shape(parallel_state.get_pipeline_model_parallel_world_size())
        if config is not None and getattr(config, "pipeline_model_parallel_layout", None) is not None:
            config.pipeline_model_parallel_layout = megatron_layout(layers, placement)
        text = self.args.pipeline_model_parallel_layout
        self.args.pipeline_model_parallel_layout = megatron_layout(layers, placement)
        try:
            yield
        finally:
            self.args.pipeline_model_parallel_layout = text

    def _check_layers(self, model, vp_stage) -> None:
        """The chunk holds its stage's layers, numbered globally (a model path that bypassed the
        layout would silently train another split, with wrong checkpoint keys)."""
        layers = pipeline_layout.counts(self.args)
        if layers is None:
            return
        from megatron.core import parallel_state

        from megatron_vshape.runtime.placement import chunk_specs
        from megatron_vshape.schedules.core.schedule import Placement

        d, rank = parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_rank()
        placement = Placement.v_shape(d) if self.is_v else Placement.looped(d, len(layers) // d)
        stage = chunk_specs(placement, rank)[vp_stage or 0].stage
        want = list(range(sum(layers[:stage]) + 1, sum(layers[:stage + 1]) + 1))
        decoder = getattr(_unwrap(model), "decoder", None)
        got = [int(layer.layer_number) for layer in getattr(decoder, "layers", [])]
        if got != want:
            raise ConfigError(f"--pipeline-layout: stage {stage} was built with layers {got}, not {want}; the model "
                              "provider must build GPTModel from the config megatron.training gives it")

    def _v_chunk(self, vp_stage, pg_collection):
        from megatron.core import parallel_state
        from megatron.core.process_groups_config import ProcessGroupCollection

        from megatron_vshape.runtime.placement import chunk_pg_collection, chunk_specs
        from megatron_vshape.schedules.core.schedule import Placement

        if vp_stage is None:
            raise ConfigError("--pipeline-schedule: a V schedule needs two model chunks per rank but megatron "
                              "built one; do not override --num-virtual-stages-per-pipeline-rank")
        placement = Placement.v_shape(parallel_state.get_pipeline_model_parallel_world_size())
        spec = chunk_specs(placement, parallel_state.get_pipeline_model_parallel_rank())[vp_stage]
        base = pg_collection if pg_collection is not None else ProcessGroupCollection.use_mpu_process_groups()
        return spec.pre_process, spec.post_process, spec.vp_stage, chunk_pg_collection(spec, placement, base)


def wrap_model_construction(args) -> None:
    """Route both of megatron.training's model paths through one :class:`ChunkBuilder`.

    ``get_model(model_provider_func)`` (entry scripts with a model provider) and the config-container
    path (``pretrain_cfg_container_from_args(args, model_cfg)``: ``GPTModelBuilder.build_model``).
    """
    import megatron.training.training as training

    install_checkpoint_fixes(args)  # what the V's chunks (and Megatron's bucket layout) need of a torch_dist save
    builder = ChunkBuilder(args)
    original_get_model = training.get_model
    if not getattr(original_get_model, "_vshape", False):

        @functools.wraps(original_get_model)
        def get_model(model_provider_func, *a, **kw):
            return original_get_model(_provider_through(builder, model_provider_func), *a, **kw)

        get_model._vshape = True
        training.get_model = get_model
    try:
        from megatron.training.models.gpt import GPTModelBuilder
    except ImportError:  # older megatron.training: no config-container builders
        return
    _wrap_builder(GPTModelBuilder, builder)
    if hybrid_pattern.is_hybrid(args):  # pretrain_hybrid.py (imports TE-spec modules: only when needed)
        from megatron.training.models.hybrid import HybridModelBuilder

        _wrap_builder(HybridModelBuilder, builder)


def _wrap_builder(cls, builder: ChunkBuilder) -> None:
    """``cls.build_model`` (a megatron.training ``ModelBuilder``) through ``builder``."""
    original_build = cls.build_model
    if getattr(original_build, "_vshape", False):
        return

    @functools.wraps(original_build)
    def build_model(self, pg_collection, pre_process=None, post_process=None, vp_stage=None):
        return builder.build(lambda pre, post, vp, pgs: original_build(self, pgs, pre, post, vp),
                             pre_process, post_process, vp_stage, pg_collection,
                             config=getattr(getattr(self, "_model_config", None), "transformer", None))

    build_model._vshape = True
    cls.build_model = build_model


def _provider_through(builder: ChunkBuilder, model_provider_func):
    @functools.wraps(model_provider_func)
    def provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None, **kw):
        def make(pre, post, vp, pgs):
            return model_provider_func(pre_process=pre, post_process=post, vp_stage=vp, config=config,
                                       pg_collection=pgs, **kw)

        return builder.build(make, pre_process, post_process, vp_stage, pg_collection)

    return provider


def v_stage_predicates() -> None:
    """parallel_state's first/last-stage questions answer for the V placement's chunks.

    On a V, chunk 0 of pipeline rank 0 is the first stage and chunk 1 of rank 0 the last.

    * About a chunk (``vp_stage`` given, ``ignore_virtual=False``): the answer for that chunk.
    * Any other form *during a pass* (a forward, backward or W of one chunk; the executor names it in
      :mod:`megatron_vshape.runtime.active_stage`): the answer for the stage being run, as Megatron's
      interleaved schedule gives with its current virtual rank. Megatron-LM's ``get_batch`` asks
      ``mpu.is_pipeline_last_stage()`` without ``vp_stage`` to decide whether to load labels and the
      loss mask; on rank 0 that must be True while the loss chunk runs.
    * Between passes: Megatron's rank-level answers. The training loop reads the losses on the last
      pipeline rank, where :func:`relay_losses` puts them.
    """
    from megatron.core import parallel_state

    from megatron_vshape.runtime.active_stage import active_stage

    if getattr(parallel_state.is_pipeline_first_stage, "_vshape", False):
        return
    first, last = parallel_state.is_pipeline_first_stage, parallel_state.is_pipeline_last_stage

    def v_answer(megatron_answer, ignore_virtual, vp_stage, chunk: int, of_active) -> bool:
        if not ignore_virtual and vp_stage is not None:
            return parallel_state.get_pipeline_model_parallel_rank() == 0 and vp_stage == chunk
        running = active_stage()
        if running is not None:
            return of_active(running)
        return megatron_answer(ignore_virtual=ignore_virtual, vp_stage=vp_stage)

    @functools.wraps(first)
    def is_pipeline_first_stage(ignore_virtual=True, vp_stage=None):
        return v_answer(first, ignore_virtual, vp_stage, 0, lambda running: running.is_first)

    @functools.wraps(last)
    def is_pipeline_last_stage(ignore_virtual=True, vp_stage=None):
        return v_answer(last, ignore_virtual, vp_stage, 1, lambda running: running.is_last)

    is_pipeline_first_stage._vshape = is_pipeline_last_stage._vshape = True
    parallel_state.is_pipeline_first_stage = is_pipeline_first_stage
    parallel_state.is_pipeline_last_stage = is_pipeline_last_stage


# --- torch_dist checkpoints of a V's chunks ---------------------------------------------------------

def install_checkpoint_fixes(args) -> None:
    """Two torch_dist save bugs a V schedule with tied embeddings runs into (each entry is in the patch table).

    * V schedules: :func:`_install_one_main_replica_per_rank`.
    * Every run on a megatron-core before 0.20: :func:`_install_fully_reshardable_bucket_offsets`.

    And, on load, a distributed optimizer's bucket-layout state across ``--pipeline-vocab-parallel`` is
    refused in one line (:func:`_install_optimizer_format_check`).
    """
    _install_fully_reshardable_bucket_offsets()
    if args.pipeline_schedule in V_SCHEDULE_NAMES:
        _install_one_main_replica_per_rank()
    _install_optimizer_format_check()


_SAVING = contextvars.ContextVar("vshape_fully_parallel_saving", default=False)


def _install_one_main_replica_per_rank() -> None:
    """Megatron's fully parallel save writes each shard once, from one rank: not twice from rank 0 of a V.

    On a V, pipeline rank 0 holds the first stage's embedding (chunk 0) and the last stage's tied copy
    (chunk 1, ``output_layer.weight``), and Megatron's ``tie_embeddings_and_output_weights_state_dict`` gives
    the copy the embedding's key as a replica (replica id ``(1, 0, dp)`` against the embedding's ``(0, 0,
    dp)``): the key and values of Megatron's tied checkpoints, which load across schedules. A looped
    placement never puts two tensors of one shard on a rank, and the fully parallel save
    (``distribute_main_replicas_with_precomputed_distribution``, the default ``--ckpt-fully-parallel-save``)
    relies on that: it chooses a saving rank per shard and sets ``replica_id = 0`` on *every* local tensor
    of that shard, so rank 0 marked both copies main and the save stopped with "Invalid sharding pattern
    validation ... embedding.word_embeddings.weight" (at DP > 1; the tied copies of the distributed
    optimizer's ``fully_reshardable`` state alike). Here, while a save is distributed, only the first of
    them (the embedding: ``model0`` comes before ``model1``) stays main; the copy holds the same values
    (:func:`~megatron_vshape.runtime.placement.sum_tied_embedding_grads` keeps them identical).
    Loading is left alone: there every local tensor is filled, copies included.
    """
    from megatron.core.dist_checkpointing.strategies import fully_parallel

    distribute = fully_parallel.distribute_main_replicas_with_precomputed_distribution
    if getattr(distribute, "_vshape", False):
        return
    apply_saving = fully_parallel.FullyParallelSaveStrategyWrapper.apply_saving_parallelization

    @functools.wraps(distribute)
    def distribute_main_replicas_with_precomputed_distribution(sharded_state_dict, parallelization_group,
                                                               precomputed_distribution):
        distribute(sharded_state_dict, parallelization_group, precomputed_distribution)
        if _SAVING.get():
            _one_main_replica_per_shard(sharded_state_dict, fully_parallel._sharded_tensor_shard_id)

    @functools.wraps(apply_saving)
    def apply_saving_parallelization(self, sharded_state_dict):
        token = _SAVING.set(True)
        try:
            return apply_saving(self, sharded_state_dict)
        finally:
            _SAVING.reset(token)

    distribute_main_replicas_with_precomputed_distribution._vshape = True
    fully_parallel.distribute_main_replicas_with_precomputed_distribution = (
        distribute_main_replicas_with_precomputed_distribution)
    fully_parallel.FullyParallelSaveStrategyWrapper.apply_saving_parallelization = apply_saving_parallelization


def _one_main_replica_per_shard(sharded_state_dict, shard_id) -> None:
    """Mark all but the first main tensor of each shard (``shard_id(tensor)``) on this rank as replicas."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    main = set()
    for tensor in nested_values(sharded_state_dict):
        if isinstance(tensor, ShardedTensor) and is_main_replica(tensor.replica_id):
            key = shard_id(tensor)
            if key in main:
                tensor.replica_id = 1
            main.add(key)


def _install_fully_reshardable_bucket_offsets() -> None:
    """megatron-core 0.19's ``fully_reshardable`` optimizer save reads every bucket after the first at the
    wrong place: a backport of Megatron-LM main's fix (main at d98e8a64 has it; megatron-core 0.20 on, not patched).

    ``sharded_param_state_fully_reshardable`` slices each parameter's state out of
    ``get_parameter_state_dp_zero``'s world tensors at the parameter's index in the grad buffer, but those
    tensors are the buckets' unpadded parts laid end to end: a bucket that starts after another bucket's
    end padding (to a multiple of lcm(DP, 128) elements) was read shifted by that padding. A tied embedding
    is a bucket of its own, after the rest of its chunk, so a first stage whose other parameters are no
    multiple of 128 elements (V-Half at PP 2 with 4 layers: 52032) saved ``optimizer.state.param``, Adam's
    moments and, on load, the weights of ``embedding.word_embeddings.weight`` 64 elements off (and its last
    64 as zeros, with Megatron's warning "param range exceeds unpadded buffer"); the resumed run then trained
    from other weights. Here that call sees the world tensors with each bucket at its buffer offset. Loading
    reads each rank's own parameter ranges and was right.
    """
    from megatron.core.optimizer import distrib_optimizer

    from ..runtime.compat import megatron_core_version
    from .vocab_checks import version_tuple

    cls = distrib_optimizer.DistributedOptimizer
    original = cls.sharded_param_state_fully_reshardable
    version = version_tuple(megatron_core_version())
    if getattr(original, "_vshape", False) or (version is not None and version >= (0, 20)):
        return

    @functools.wraps(original)
    def sharded_param_state_fully_reshardable(self, *args, **kwargs):
        gather = self.get_parameter_state_dp_zero

        def get_parameter_state_dp_zero(*gather_args, **gather_kwargs):
            return _at_bucket_offsets(self.buffers, gather(*gather_args, **gather_kwargs))

        self.get_parameter_state_dp_zero = get_parameter_state_dp_zero  # this call only (an instance attribute)
        try:
            return original(self, *args, **kwargs)
        finally:
            del self.get_parameter_state_dp_zero

    sharded_param_state_fully_reshardable._vshape = True
    cls.sharded_param_state_fully_reshardable = sharded_param_state_fully_reshardable


def _at_bucket_offsets(buffers, state):
    """``get_parameter_state_dp_zero``'s world tensors (each buffer's buckets unpadded, end to end) with
    every bucket moved to its offset in the buffer (padding zero), as the buffer's parameter indices count."""
    import torch

    if state is None:  # DP ranks other than 0 in the memory-efficient gather
        return None
    for gbuf_idx, buffer in enumerate(buffers):
        buckets = buffer.buckets
        padded_numel = buckets[-1].offset + buckets[-1].numel_unpadded
        for world in state[gbuf_idx].values():
            for key, flat in world.items():
                if not isinstance(flat, torch.Tensor):
                    continue  # numel_unpadded
                at_offsets, start = flat.new_zeros(padded_numel), 0
                for bucket in buckets:
                    at_offsets[bucket.offset:bucket.offset + bucket.numel_unpadded] = (
                        flat[start:start + bucket.numel_unpadded])
                    start += bucket.numel_unpadded
                assert start == flat.numel(), (key, start, flat.numel())
                world[key] = at_offsets
    return state


def _install_optimizer_format_check() -> None:
    """Refuse to load a distributed optimizer's bucket-layout state (Megatron's default ``dp_reshardable``)
    saved on the other side of ``--pipeline-vocab-parallel`` in one line, before Megatron reads it.

    The flag moves the embedding and the output layer out of Megatron's chunks into vocabulary shards, so
    each chunk's DP buckets hold other parameters, and Megatron stopped every rank with a traceback ("Global
    shape mismatch ... bucket_idx_0.param"). ``load_checkpoint`` first reads the checkpoint's common state
    (``_load_base_checkpoint(..., rank0=True)``): its saved arguments carry the saving run's flag, and its
    content metadata the optimizer's format. Checked where Megatron would load the optimizer state (not
    with ``--no-load-optim``, ``--finetune``, a release checkpoint, or one saved without it).
    """
    from megatron.training import checkpointing

    original = checkpointing._load_base_checkpoint
    if getattr(original, "_vshape", False):
        return

    @functools.wraps(original)
    def _load_base_checkpoint(load_dir, args, rank0=False, *rest, **kwargs):
        from .arguments import exit_on_error

        loaded = original(load_dir, args, rank0, *rest, **kwargs)
        if rank0:  # one line and exit 2 on every rank (each reads the same common state), as at start-up
            exit_on_error(_check_optimizer_format, args, loaded[0], release=loaded[2])
        return loaded

    _load_base_checkpoint._vshape = True
    checkpointing._load_base_checkpoint = _load_base_checkpoint


def _check_optimizer_format(args, state_dict, release: bool) -> None:
    from megatron.core import dist_checkpointing

    from .vocab_checks import check_optimizer_checkpoint_across_flag

    if state_dict is None or release or not getattr(args, "use_distributed_optimizer", False):
        return
    saved_args = state_dict.get("args")
    if (saved_args is None or getattr(args, "no_load_optim", False) or getattr(args, "finetune", False)
            or getattr(saved_args, "no_save_optim", False)):
        return
    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=state_dict) or {}
    check_optimizer_checkpoint_across_flag(bool(getattr(saved_args, "pipeline_vocab_parallel", False)),
                                           bool(getattr(args, "pipeline_vocab_parallel", False)),
                                           metadata.get("distrib_optim_sharding_type"))
