"""A Transformer Engine stand-in for CPU tests (TE cannot be installed here); see ``install``.

``transformer_engine/`` below is a small package with TE's import paths and the part of TE's
documented contract the B/W split relies on, written from TE's API documentation (nothing copied):

* ``transformer_engine.pytorch.Linear`` / ``LayerNormLinear`` take ``delay_wgrad_compute``. With it,
  the backward computes the input gradient only and puts the weight-gradient work in the module's
  ``wgrad_store``, a first-in first-out queue per module; ``backward_dw()`` pops the **oldest** entry
  and computes that weight gradient (into ``weight.main_grad`` when ``fuse_wgrad_accumulation``,
  else into ``weight.grad``), then runs the hooks registered with
  ``register_wgrad_accumulation_and_reduce_hooks``. Weights of a deferring module carry
  ``skip_backward_post_hook = True`` (what megatron DDP reads to register those hooks instead).
* FP8 settings are carried, not computed: ``fp8_autocast(enabled, fp8_recipe)`` sets what
  ``FP8GlobalStateManager.is_fp8_enabled()`` answers, and every linear records the FP8 state it ran
  its forward under (``fp8_seen``); the maths stays in the input's dtype.
* ``DotProductAttention``, ``LayerNorm`` and ``RMSNorm`` compute the plain torch maths.

* Context parallelism: attention all-gathers the keys and values of the CP group (Megatron's
  2 x CP chunk layout) instead of TE's ring; the maths is the same.

Limits: one tensor-parallel rank (TE's TP communication is not modelled: ``tp_size > 1`` raises),
no userbuffers, no FP8 numerics, no grouped linear. It is only ever put on ``sys.path`` of a test
process (:func:`install`, before megatron.core is imported), never pip-installed: megatron-core's own
wrappers in ``megatron.core.extensions.transformer_engine`` then subclass these classes as they
subclass TE's on a GPU machine.
"""

from __future__ import annotations

import os
import sys

PATH = os.path.dirname(os.path.abspath(__file__))
VERSION_ENV = "VSHAPE_TE_STANDIN_VERSION"  # the version the stand-in reports (default 2.8.0)


def install(version: str | None = None) -> None:
    """Put the stand-in first on ``sys.path``; must run before ``megatron.core`` is imported."""
    if "megatron.core" in sys.modules and "transformer_engine" not in sys.modules:
        raise RuntimeError("install the TE stand-in before importing megatron.core (it decides HAVE_TE at import)")
    if version is not None:
        os.environ[VERSION_ENV] = version
    if PATH not in sys.path:
        sys.path.insert(0, PATH)
