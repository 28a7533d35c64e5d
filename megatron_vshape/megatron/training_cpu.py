"""megatron.training (megatron-core 0.19.x) on CPU with gloo: the bridges on top of ``cpu_mode``.

:func:`enable_training_cpu_mode` is what ``--cpu`` switches on. It first calls
:func:`megatron_vshape.megatron.cpu_mode.enable_cpu_mode` (the megatron-core bridges: device arguments,
``torch.cuda`` calls, streams, RNG tracker, ``clip_grads``), then bridges the places where
``megatron.training`` itself assumes CUDA:

* ``initialize_megatron`` asserts ``torch.cuda.is_available()`` unless ``allow_no_cuda=True``, which
  ``pretrain()`` never passes: we pass it.
* With ``torch.cuda.device_count() == 0`` it *silently* skips model-parallel initialisation and the
  model-parallel RNG seeding (the run dies much later with "pipeline_model parallel group is not
  initialized"): in CPU mode the process counts as one device (``set_device`` is inert).
* ``get_device_arch_version()`` (TP > 1 or CP > 1) reads CUDA device properties: answer 0 ("no
  Blackwell features"); ``validate_args`` then wants ``CUDA_DEVICE_MAX_CONNECTIONS=1``, which we set.

:func:`patch_python_compat` is separate and CUDA-free: megatron.training (0.19, main) imports
``typing.override``, new in Python 3.12; on 3.11 ``typing_extensions`` provides it
(:mod:`megatron_vshape.python_compat`; nothing to do on 3.12). Every entry point calls it before
importing ``megatron.training``.

Everything here changes process-wide state on purpose and only in processes that run with --cpu.
"""

from __future__ import annotations

import functools
import os
import sys

from megatron_vshape.python_compat import bridge_typing_override

_training_enabled = False


def patch_python_compat() -> None:
    """Make megatron.training importable on Python 3.11 (idempotent, no torch import; nothing on 3.12+)."""
    bridge_typing_override()


def require_megatron_training():
    """Import ``megatron.training`` or exit with one line saying what is missing."""
    if not bridge_typing_override():
        _exit("megatron.training imports typing.override, which Python 3.11 has only from typing_extensions: "
              "pip install typing_extensions")
    try:
        import megatron.core
    except ImportError as err:
        _exit(f"no megatron to run ({err}): install megatron-core (pip install megatron-core==0.19.2), or run "
              "a script of a Megatron-LM checkout (its directory holds megatron/)")
    try:
        import megatron.training as training
    except ImportError as err:
        version = getattr(megatron.core, "__version__", "?")
        _exit(f"megatron.training is missing (megatron-core {version}: {err}); pretrain_gpt.py and the runner "
              "need megatron-core >= 0.19 (pip install megatron-core==0.19.2) or a Megatron-LM checkout")
    return training


def _exit(message: str):
    print(f"megatron-vshape error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2) from None


def enable_training_cpu_mode() -> None:
    """Run megatron.training's ``pretrain()`` on CPU with gloo in this process (idempotent)."""
    global _training_enabled
    if _training_enabled:
        return
    # Without this, jit fusion warm-up compiles with inductor on CPU: 30 s cold, twice the run time.
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    # validate_args demands it for TP > 1 (a CUDA stream-ordering setting; meaningless and harmless on CPU).
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    patch_python_compat()
    from .cpu_mode import enable_cpu_mode
    from .patches import Group, check

    check(Group.TRAINING_CPU)

    enable_cpu_mode()
    _count_cpu_as_one_device()
    _allow_no_cuda_in_initialize()
    _no_device_arch()
    _training_enabled = True


def _count_cpu_as_one_device() -> None:
    import torch

    torch.cuda.device_count = lambda: 1


def _allow_no_cuda_in_initialize() -> None:
    from megatron.training import initialize, training

    original = initialize.initialize_megatron

    @functools.wraps(original)
    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    initialize.initialize_megatron = initialize_megatron
    training.initialize_megatron = initialize_megatron  # pretrain() imported it by name


def _no_device_arch() -> None:
    import megatron.core.utils as core_utils
    from megatron.training import arguments

    core_utils.get_device_arch_version = lambda: 0
    arguments.get_device_arch_version = lambda: 0
