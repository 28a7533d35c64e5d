"""The executor's view of the weight-gradient store (``runtime/wgrad.py``), created on first use."""

from __future__ import annotations

import contextlib


class WeightGradAdapter:
    """The executor's view of the weight-gradient store of ``runtime/wgrad.py``.

    Created lazily, on the first B that defers its W: fused schedules never install the split hook.
    A captured B that defers nothing on a chunk with linear layers raises (no silent fallback to a
    full backward in B); ``counts()`` says how many weight gradients were deferred and run.
    """

    def __init__(self):
        self._store = None

    def _get(self):
        if self._store is None:
            from . import wgrad

            wgrad.enable_wgrad_split()
            self._store = wgrad.WeightGradStore()
        return self._store

    @contextlib.contextmanager
    def capture(self, key, chunk_model, schedule_name: str):
        from . import te_wgrad, wgrad

        store = self._get()
        with store.capture(key):
            yield
            te_wgrad.defer_te_wgrads(store, key, chunk_model)  # TE linears queued their W themselves
        wgrad.check_deferred(store.deferred_in(key), key, chunk_model, schedule_name)

    def run(self, key, after_task=None) -> None:
        self._get().run(key, after_task)

    @property
    def store(self):
        """The store, or None before the first deferred B (nothing is owed then)."""
        return self._store

    def pending(self) -> list:
        return list(self._store.pending()) if self._store is not None else []

    def counts(self):
        """Weight gradients deferred and run since this executor was built (``wgrad.WgradCounts``)."""
        from . import wgrad

        return self._store.counts() if self._store is not None else wgrad.WgradCounts()

    def check_models(self, models, schedule_name: str) -> None:
        """Reject what the split cannot honour (raises before any compute): DDP settings, TE linears."""
        from . import te_wgrad, wgrad

        for model in models:
            ddp_config = getattr(model, "ddp_config", None)
            if ddp_config is not None:
                wgrad.check_ddp_config(ddp_config, schedule_name)
        te_wgrad.check_te_split(models, schedule_name)
