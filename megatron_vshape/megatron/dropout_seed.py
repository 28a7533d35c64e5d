"""Schedule-invariant randomness: dropout masks and initial weights that no schedule can change.

Dropout: masks depend on (seed, iteration, microbatch, global layer) only.

Megatron draws dropout masks from running RNG streams (the default generator for hidden dropout,
the tensor-parallel tracker for attention dropout). Those streams advance in the order a rank
runs its forward passes, so two schedules that interleave microbatches and chunks differently draw
different masks and train a (slightly) different model. To make every schedule compute the same
maths, :class:`InvariantDropout` reseeds both streams at the start of each transformer layer's forward
(and of the embedding, "layer 0", whose dropout runs before the first layer) from

    (seed, iteration, global microbatch, global layer number)

where the global microbatch is ``dp_rank * num_microbatches + k`` for the k-th forward of that model
chunk in this iteration (every schedule runs a chunk's forwards in microbatch order). Tensor-parallel
ranks keep Megatron's relation: same default-generator seed, tracker seed ``+ 2718 + tp_rank``.

Scope: the current (iteration, microbatch) is held in one process-wide slot, set only while
:meth:`InvariantDropout.wrap_forward_step`'s wrapper runs a forward step; outside it the layer hooks do
nothing, so evaluation, other code and other schedules are untouched. Process-wide, not a ContextVar,
because activation recomputation re-runs layer forwards *inside the backward*, which on CUDA runs on
autograd's worker thread (no ContextVar or thread-local of the schedule's thread is visible there) and
anyway after the forward step's wrapper has returned. So :func:`attach` also wraps megatron's
``tensor_parallel.checkpoint``: a checkpointed function remembers the position it was first run at and
holds it again while it is recomputed, so the recomputed layers redraw the forward's exact masks.
(TE's ``te_checkpoint``, used only with fp8, is not wrapped.)

Initialisation: Megatron initialises each rank's parameters from one stream seeded by
``seed + 100 * pipeline rank``, so a layer's initial weights depend on which rank builds it and what
that rank built before: 1F1B and a V schedule would start from different models.
:func:`invariant_init` reseeds the same streams right before the embedding (stream 0), before each
transformer layer (its global layer number) and after the decoder block (the output layer's stream),
so every placement builds bit-identical initial weights.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
from dataclasses import dataclass

import torch

from ..runtime.placement import _unwrap

_EMBEDDING_LAYER = 0
_AFTER_DECODER = -1  # the output layer's init stream
_TRACKER_OFFSET = 2718  # megatron's model-parallel seed offset (model_parallel_cuda_manual_seed)
_HOOKED = "_vshape_invariant_dropout_hook"


@dataclass(frozen=True)
class _Position:
    seed: int
    iteration: int
    microbatch: int
    tp_rank: int


class _PositionSlot:
    """The position being run, one per process and readable from every thread (see the module docstring).

    Holding nests (a recomputed forward inside a forward step holds the same position again) and
    restores the previous value when the block ends. The schedules run one pass at a time.
    """

    def __init__(self) -> None:
        self._position: _Position | None = None

    def get(self) -> _Position | None:
        return self._position

    @contextlib.contextmanager
    def holding(self, position: _Position):
        previous, self._position = self._position, position
        try:
            yield
        finally:
            self._position = previous


_current = _PositionSlot()


def mix_seed(seed: int, iteration: int, microbatch: int, layer: int) -> int:
    """A 63-bit seed from the four values (a hash, so nearby tuples give unrelated streams)."""
    digest = hashlib.blake2b(f"{seed}/{iteration}/{microbatch}/{layer}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _generator_state(seed: int) -> torch.Tensor:
    """The state a freshly seeded default generator of this device would have."""
    if torch.cuda.is_available():
        saved = torch.cuda.get_rng_state()
        torch.cuda.manual_seed(seed)
        state = torch.cuda.get_rng_state()
        torch.cuda.set_rng_state(saved)
        return state
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator.get_state()


def reseed_streams(base: int, tp_rank: int) -> None:
    """Reseed the default generators and megatron's tensor-/expert-parallel tracker states."""
    from megatron.core.tensor_parallel import random as mrandom

    if torch.cuda.is_available():
        torch.manual_seed(base)  # CPU and every CUDA device
    else:
        # What torch.manual_seed does on a machine without accelerators, without its calls into the CUDA, XPU
        # and MTIA modules: each of those, not initialised, queues the seed with a formatted stack trace
        # (about a third of this function's CPU, at one call per layer per microbatch).
        torch.default_generator.manual_seed(base)
    states = getattr(mrandom.get_cuda_rng_tracker(), "states_", None)
    if not isinstance(states, dict):
        return
    for name, offset in ((mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, _TRACKER_OFFSET + tp_rank),
                         (getattr(mrandom, "_EXPERT_PARALLEL_RNG_TRACKER_NAME", None), 1024 + tp_rank)):
        if name in states and isinstance(states[name], torch.Tensor):
            states[name] = _generator_state(base + offset)


def reseed(position: _Position, layer: int) -> None:
    """Reseed the dropout streams for ``layer`` of the microbatch at ``position``."""
    reseed_streams(mix_seed(position.seed, position.iteration, position.microbatch, layer), position.tp_rank)


def _layer_pre_hook(layer: int):
    def hook(module, args, kwargs=None):
        position = _current.get()
        if position is not None and module.training:
            reseed(position, layer)

    return hook


def _carry_position_into_recompute() -> None:
    """Wrap megatron's ``tensor_parallel.checkpoint`` (idempotent): a recomputation holds its forward's position."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mrandom

    original = mrandom.checkpoint
    if getattr(original, _HOOKED, False):
        return

    @functools.wraps(original)
    def checkpoint(function, distribute_saved_activations, *args):
        position = _current.get()
        if position is None:  # not in an invariant forward step: megatron's checkpoint untouched
            return original(function, distribute_saved_activations, *args)

        def run_at_position(*inputs):  # runs in the forward, and again when recomputed in the backward
            with _current.holding(position):
                return function(*inputs)

        return original(run_at_position, distribute_saved_activations, *args)

    setattr(checkpoint, _HOOKED, True)
    mrandom.checkpoint = tensor_parallel.checkpoint = checkpoint


def attach(models) -> int:
    """Register the reseeding pre-hooks on every transformer layer and embedding (idempotent), and
    carry positions into activation recomputation.

    Returns the number of modules hooked now.
    """
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.transformer.transformer_layer import TransformerLayer

    _carry_position_into_recompute()
    attach_plan_reseeding()
    hooked = 0
    for model in models:
        for module in _unwrap(model).modules():
            if getattr(module, _HOOKED, False):
                continue
            if isinstance(module, TransformerLayer) or _is_mamba_layer(module):
                layer = int(module.layer_number)
            elif isinstance(module, LanguageModelEmbedding):
                layer = _EMBEDDING_LAYER
            else:
                continue
            module.register_forward_pre_hook(_layer_pre_hook(layer))
            setattr(module, _HOOKED, True)
            hooked += 1
    return hooked


def _hybrid_classes():
    """(HybridStack, MambaLayer) of megatron-core's HybridModel, or None where megatron-core has none."""
    try:
        from megatron.core.models.hybrid.hybrid_block import HybridStack
        from megatron.core.ssm.mamba_layer import MambaLayer
    except ImportError:
        return None
    return HybridStack, MambaLayer


def _is_mamba_layer(module) -> bool:
    hybrid = _hybrid_classes()
    return hybrid is not None and isinstance(module, hybrid[1])


class InvariantDropout:
    """Per-iteration helper: wraps a forward_step_func so each call knows its microbatch."""

    def __init__(self, seed: int, iteration: int, num_microbatches: int, dp_rank: int, tp_rank: int):
        self.seed, self.iteration, self.tp_rank = seed, iteration, tp_rank
        self.first_microbatch = dp_rank * num_microbatches
        self._calls: dict[int, int] = {}  # id(model chunk) -> forwards run this iteration

    def _next_microbatch(self, model) -> int:
        key = id(model)
        k = self._calls.get(key, 0)
        self._calls[key] = k + 1
        return self.first_microbatch + k

    def wrap_forward_step(self, forward_step_func):
        @functools.wraps(forward_step_func)  # keeps the signature megatron inspects
        def forward_step(data_iterator, model, *args, **kwargs):
            position = _Position(self.seed, self.iteration, self._next_microbatch(model), self.tp_rank)
            with _current.holding(position):
                result = forward_step_func(data_iterator, model, *args, **kwargs)
            if kwargs.get("return_schedule_plan"):  # the combined 1F1B step runs the plan later: it takes the position
                _mark_plan(result[0], position)
            return result

        return forward_step


# Megatron's combined 1F1B step (--overlap-moe-expert-parallel-comm) runs a chunk's layers from its schedule plan's
# nodes, not through the layer modules' forward: the pre-hooks above never fire there. The forward step marks the
# plan it returns with its position; while a marked plan runs, the position is held (the embedding's pre-hook
# reseeds as in a plain forward) and each layer is reseeded as its forward begins (the plan's per-layer run),
# before the layer draws anything. In a pair the B's nodes between draw nothing (no recomputation with the flag).
_PLAN_POSITION = "_vshape_dropout_position"


def _mark_plan(plan, position: _Position) -> None:
    if not hasattr(plan, "num_layers"):
        return
    setattr(plan, _PLAN_POSITION, position)
    for i in range(plan.num_layers()):
        setattr(plan.get_layer(i), _PLAN_POSITION, position)


def attach_plan_reseeding() -> bool:
    """Wrap the schedule plans' runs (idempotent); False where megatron-core has no schedule plans."""
    try:
        from megatron.core.models.common import model_chunk_schedule_plan as plans
    except ImportError:
        return False
    layer_plan, chunk_plan = plans.TransformerLayerSchedulePlan, plans.TransformerModelChunkSchedulePlan
    if getattr(layer_plan.run, _HOOKED, False):
        return True
    layer_run, chunk_run = layer_plan.run, chunk_plan.run

    @functools.wraps(layer_run)
    def run_layer(f_layer, b_layer, *args, **kwargs):
        position = getattr(f_layer, _PLAN_POSITION, None) if f_layer is not None else None
        if position is not None and f_layer.layer.training:
            reseed(position, int(f_layer.layer.layer_number))
        return layer_run(f_layer, b_layer, *args, **kwargs)

    @functools.wraps(chunk_run)
    def run_chunk(f_schedule_plan, b_schedule_plan, *args, **kwargs):
        position = getattr(f_schedule_plan, _PLAN_POSITION, None) if f_schedule_plan is not None else None
        holding = _current.holding(position) if position is not None else contextlib.nullcontext()
        with holding:
            return chunk_run(f_schedule_plan, b_schedule_plan, *args, **kwargs)

    setattr(run_layer, _HOOKED, True)
    layer_plan.run = staticmethod(run_layer)
    chunk_plan.run = staticmethod(run_chunk)
    return True


# ---------------------------------------------------------------------------------------------
# Initialisation
# ---------------------------------------------------------------------------------------------

_INIT_ITERATION = -1  # distinguishes init streams from any training iteration's dropout streams


def _global_layer_number(bound: inspect.BoundArguments) -> int:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    args = bound.arguments
    number = args.get("layer_number", 1)
    if args.get("is_mtp_layer", False) or not args.get("add_layer_offset", True):
        return number
    pgs = args.get("pg_collection") or ProcessGroupCollection.use_mpu_process_groups()
    return number + get_transformer_layer_offset(args["config"], args.get("vp_stage"), pgs.pp.rank())


@contextlib.contextmanager
def invariant_init(seed: int, tp_rank: int):
    """While active, model construction reseeds per global layer (see the module docstring)."""
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_layer import TransformerLayer

    def stream(layer: int) -> None:
        reseed_streams(mix_seed(seed, _INIT_ITERATION, 0, layer), tp_rank)

    originals = {cls: cls.__init__ for cls in (TransformerLayer, LanguageModelEmbedding, TransformerBlock)}
    signature = inspect.signature(originals[TransformerLayer])

    def layer_init(self, *args, **kwargs):
        stream(_global_layer_number(signature.bind(self, *args, **kwargs)))
        originals[TransformerLayer](self, *args, **kwargs)

    def embedding_init(self, *args, **kwargs):
        stream(_EMBEDDING_LAYER)
        originals[LanguageModelEmbedding](self, *args, **kwargs)

    def block_init(self, *args, **kwargs):
        originals[TransformerBlock](self, *args, **kwargs)
        stream(_AFTER_DECODER)  # what GPTModel builds next (the output layer) gets its own stream

    replacements = {TransformerLayer: layer_init, LanguageModelEmbedding: embedding_init, TransformerBlock: block_init}
    hybrid = _hybrid_classes()
    if hybrid is not None:  # HybridModel: its stack ends the decoder; Mamba layers get their layer's stream
        stack, mamba = hybrid
        originals.update({stack: stack.__init__, mamba: mamba.__init__})
        mamba_signature = inspect.signature(mamba.__init__)

        def stack_init(self, *args, **kwargs):
            originals[stack](self, *args, **kwargs)
            stream(_AFTER_DECODER)

        def mamba_init(self, *args, **kwargs):  # HybridStack passes the global layer number
            stream(int(mamba_signature.bind(self, *args, **kwargs).arguments.get("layer_number", 1)))
            originals[mamba](self, *args, **kwargs)

        replacements.update({stack: stack_init, mamba: mamba_init})
    try:
        for cls, func in replacements.items():
            cls.__init__ = functools.wraps(originals[cls])(func)
        yield
    finally:
        for cls, func in originals.items():
            cls.__init__ = func
