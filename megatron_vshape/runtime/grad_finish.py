"""The data-parallel side of a call's gradients: hold the reductions back, start them per chunk, and the
process groups ``finalize_model_grads`` gets on a V placement.

A chunk's reduction may start only once every backward of the chunk is done (the executor's pass loop says
when: :meth:`GradSyncControl.start`); Megatron's ``no_sync`` holds it back until then.
"""

from __future__ import annotations

import contextlib

from .grad_sync import BucketLauncher
from .placement import LocalGroup


class GradSyncControl:
    """Holds back data-parallel gradient reduction until every backward of a chunk is done."""

    def __init__(self, config, models, enabled: bool, launcher: BucketLauncher | None = None):
        self.config, self.models, self.enabled, self.launcher = config, models, enabled, launcher
        self._stack = contextlib.ExitStack()
        self._started: set[int] = set()

    def __enter__(self):
        if not self.enabled:
            return self
        no_sync = self.config.no_sync_func
        funcs = no_sync if isinstance(no_sync, list) else (
            [no_sync] if no_sync is not None else [m.no_sync for m in self.models if hasattr(m, "no_sync")])
        for func in funcs:
            self._stack.enter_context(func())
        return self

    def start(self, chunk_index: int) -> None:
        """All W of chunk ``chunk_index`` are done: launch its (overlapped) reduction now."""
        if not self.enabled or chunk_index in self._started:
            return
        self._started.add(chunk_index)
        model = self.models[chunk_index]
        ddp_config = getattr(model, "ddp_config", None)
        if ddp_config is None or not ddp_config.overlap_grad_reduce:
            return  # finalize_model_grads reduces synchronously
        if self.launcher is not None and self.launcher.launch_rest(chunk_index):
            return  # a split backward: bucket by bucket, what is not launched yet (grad_sync.py)
        grad_sync = self.config.grad_sync_func
        if isinstance(grad_sync, list):
            grad_sync[chunk_index](model.parameters())
        elif grad_sync is not None:
            grad_sync(model.parameters())
        else:
            model.start_grad_sync()

    def __exit__(self, *exc):
        self._stack.close()
        return False


def v_pg_collection(pg_collection):
    """Process groups for finalize on a V: no cross-rank embedding group (tied copies are local)."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    if pg_collection is None:
        pg_collection = ProcessGroupCollection()
        pg_collection.tp = parallel_state.get_tensor_model_parallel_group()
        pg_collection.pp = parallel_state.get_pipeline_model_parallel_group()
        pg_collection.cp = parallel_state.get_context_parallel_group()
        pg_collection.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    else:
        import copy

        pg_collection = copy.copy(pg_collection)
    pg_collection.embd = LocalGroup()  # tied copies are summed locally after finalize
    pg_collection.pos_embd = None
    return pg_collection
