"""Every backward on a new thread, as CUDA's autograd runs it (used by the tests' workers, the recipe checks'
``RecipeSpec.backward_on_new_threads`` and tests/megatron/threaded_backward_entry.py)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

# --- backward as CUDA's autograd runs it -------------------------------------------------------


class _EngineOnNewThreads:
    """Stands in for ``Variable._execution_engine``: each ``run_backward`` runs on a fresh thread.

    On CUDA, autograd runs ``Function.backward`` on a per-device worker thread that sees none of the
    caller's ContextVars or thread-locals (Megatron's ``custom_backward`` does not even stash the
    caller's context for it). On CPU the engine runs the graph on the calling thread; calling it
    from a new, bare thread reproduces what a GPU backward sees.
    """

    def __init__(self, engine) -> None:
        self._engine = engine
        self.threads_used = 0

    def run_backward(self, *args, **kwargs):
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["value"] = self._engine.run_backward(*args, **kwargs)
            except BaseException as err:  # noqa: B036 - re-raised on the caller's thread
                outcome["error"] = err

        thread = threading.Thread(target=run, name="fake-autograd-device-thread")
        thread.start()
        thread.join()
        self.threads_used += 1
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def __getattr__(self, name):
        return getattr(self._engine, name)


@contextlib.contextmanager
def backward_on_new_threads():
    """Every backward (``torch.autograd.backward`` and Megatron's ``custom_backward``) on a new thread."""
    from torch.autograd.variable import Variable

    engine = Variable._execution_engine
    fake = _EngineOnNewThreads(engine)
    Variable._execution_engine = fake
    try:
        yield fake
    finally:
        Variable._execution_engine = engine
