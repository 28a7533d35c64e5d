"""Transformer Engine stand-in (see megatron_vshape/testing/te_standin/__init__.py): never pip-install it."""

import os

__version__ = os.environ.get("VSHAPE_TE_STANDIN_VERSION", "2.8.0")
STANDIN = True

from . import common, pytorch  # noqa: E402,F401
