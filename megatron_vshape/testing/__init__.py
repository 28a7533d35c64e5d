"""What ``vshape verify`` and the tests share: a timeout-guarded process harness, a tiny GPT, and the
single-process reference and per-rank pipeline workers that compare a schedule's gradients with it.

* :mod:`.spawn` -- :func:`spawn`: run a function on N fresh ranks; a rank that fails, dies or hangs
  fails the call and every process is killed.
* :mod:`.tiny_gpt` -- :class:`ModelSettings` and megatron-core's GPTModel built from it, with its data.
* :mod:`.workers` -- :class:`RunSpec` and :func:`run_check`: reference run + pipeline run, merged.
"""

from .spawn import SpawnError, spawn
from .tiny_gpt import ModelSettings
from .workers import RunSpec, merge_results, pipeline_worker, reference_worker, run_check

__all__ = ["ModelSettings", "RunSpec", "SpawnError", "merge_results", "pipeline_worker", "reference_worker",
           "run_check", "spawn"]
