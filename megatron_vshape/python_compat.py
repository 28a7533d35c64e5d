"""What megatron needs from a Python older than the one it declares (no torch, no megatron import).

megatron-core 0.19 and Megatron-LM main declare Python >= 3.12 (NGC's PyTorch containers ship 3.12), and
megatron.training imports ``typing.override``, new in 3.12. They otherwise run on 3.11, which some
machines keep (this project's CI among them: the CPU build of torch it installs is a 3.11 wheel). On 3.11
``typing_extensions`` provides the same decorator. On 3.12 and later nothing here does anything.
"""

from __future__ import annotations

import sys

NEEDS_BRIDGE = sys.version_info < (3, 12)  # typing.override is in the standard library from 3.12 on


def bridge_typing_override() -> bool:
    """On Python < 3.12, give ``typing`` the ``override`` of ``typing_extensions`` (idempotent).

    Returns False when the bridge was needed but ``typing_extensions`` is missing: the import of
    megatron.training that follows then names what is missing itself.
    """
    if not NEEDS_BRIDGE:
        return True
    import typing

    if hasattr(typing, "override"):
        return True
    try:
        import typing_extensions
    except ImportError:
        return False
    typing.override = typing_extensions.override
    return True
