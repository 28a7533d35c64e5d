"""Which pipeline stage this process is running right now (a forward, backward or W pass of one chunk).

Megatron's interleaved schedule tells user code which virtual stage it is running, so that a script's
``get_batch`` or loss function can ask ``mpu.is_pipeline_first_stage()`` / ``is_pipeline_last_stage()``
and get the answer *for the chunk being run*. On a V placement that matters more than on a looped one:
pipeline rank 0 holds both the first stage (embedding) and the last stage (LM head and loss), so a
rank-level answer is wrong for one of its two chunks. Megatron-LM's own ``pretrain_gpt.py`` asks
without ``vp_stage`` when it decides whether to load labels and the loss mask.

The executor enters :func:`running_stage` around every pass; the Megatron glue's stage predicates read
:func:`active_stage`. This is one process-wide slot on purpose, not a ContextVar: on CUDA, autograd
runs ``Function.backward`` on its own worker thread, which sees no ContextVar or thread-local of the
thread that called ``backward()``. It is guarded: entering it while it is held (two executors, or a
pass inside a pass) raises instead of letting one schedule answer for another.
"""

from __future__ import annotations

from dataclasses import dataclass

from .held_value import HeldValue


@dataclass(frozen=True)
class ActiveStage:
    """The stage whose pass is running: ``stage`` of ``num_stages`` global pipeline stages."""

    stage: int
    num_stages: int

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


_SLOT: HeldValue[ActiveStage] = HeldValue(lambda new, held: RuntimeError(
    f"running_stage({new.stage}) while stage {held.stage} is running: "
    "one pipeline pass at a time per process (two executors running at once?)"))


def running_stage(stage: int, num_stages: int):
    """Context manager: ``stage`` is running in this process until the block ends."""
    return _SLOT.hold(ActiveStage(stage, num_stages))


def active_stage() -> ActiveStage | None:
    """The stage of the pass running now (visible from every thread), or None between passes."""
    return _SLOT.get()
