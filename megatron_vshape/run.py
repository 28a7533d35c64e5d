"""Run an unmodified Megatron-LM training script with megatron-vshape installed.

    torchrun --nproc-per-node 8 -m megatron_vshape.run path/to/Megatron-LM/pretrain_gpt.py \\
        --pipeline-schedule v-half --pipeline-model-parallel-size 8 ...(the script's usual flags)

The script's directory goes first on ``sys.path`` before anything imports megatron, exactly as
``python script.py`` would: a Megatron-LM checkout's own ``megatron/`` runs, not an installed
megatron-core (:mod:`megatron_vshape.megatron.which_megatron`; rank 0 prints which one runs, and from
where). The runner then hooks megatron.training's argument parsing
(:func:`megatron_vshape.megatron.install.hook_arguments`): our flags join the script's, our checks run
before Megatron's ``validate_args`` (one-line error, exit 2, on every rank), and
:func:`megatron_vshape.install` runs right after it. Then the script runs as ``__main__``.
It works with scripts that call ``parse_and_validate_args(extra_args_provider=...)`` (Megatron-LM with
megatron-core 0.19.x and main) and with older ones that pass ``extra_args_provider`` to ``pretrain()``.
Needs megatron.training: megatron-core >= 0.19, or a Megatron-LM checkout.

With a V schedule, the script's model provider must forward ``pg_collection`` to GPTModel (Megatron-LM's
does). Rank 0 holds both the first and the last stage: while a chunk runs, install() makes
``mpu.is_pipeline_first_stage/last_stage`` answer for that chunk, with or without ``vp_stage``.
Tested with Megatron-LM's own ``pretrain_gpt.py`` and ``pretrain_hybrid.py``, unmodified: tag core_v0.19.0
against the installed megatron-core 0.19.2, and main at d98e8a64 with its own ``megatron/`` (0.20.0).
"""

from __future__ import annotations

import sys
from pathlib import Path

USAGE = "usage: python -m megatron_vshape.run SCRIPT.py [script and megatron-vshape flags ...]"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") and len(argv) == 1:
        print(USAGE + "\n\n" + __doc__, file=sys.stderr)
        raise SystemExit(0 if argv else 2)
    script = Path(argv[0])
    if not script.is_file():
        print(f"megatron-vshape error: {USAGE}; no such script: {script}", file=sys.stderr)
        raise SystemExit(2)
    from megatron_vshape.megatron.arguments import exit_on_error
    from megatron_vshape.megatron.which_megatron import put_script_first

    # Before anything imports megatron: the script's own checkout, if it has one, is the megatron that runs.
    exit_on_error(put_script_first, script)
    from megatron_vshape.megatron.install import hook_arguments

    hook_arguments()
    sys.argv = [str(script), *argv[1:]]
    run_as_main(script)
    shutdown_distributed()


def run_as_main(script: Path) -> None:
    """Run ``script`` as ``__main__``, as ``python script.py`` would, except for processes it spawns.

    A child started with multiprocessing's ``spawn`` re-executes the parent's main *file* (its imports
    included) unless the main module's spec is named ``__main__``. Megatron's checkpoint writer starts
    such a child (a ``Manager``): re-running Megatron-LM's ``pretrain_*.py`` there imports
    megatron.training without our Python 3.11 bridge (``typing.override``) and fails the first save (on
    3.12 it would only import everything again, for nothing). The children need nothing from the
    script, so the spec says ``__main__`` and they skip it.
    """
    import importlib.machinery

    original = sys.modules["__main__"]
    module = type(sys)("__main__")
    module.__file__ = str(script)
    module.__spec__ = importlib.machinery.ModuleSpec("__main__", None, origin=str(script))
    module.__builtins__ = __builtins__
    sys.modules["__main__"] = module
    try:
        exec(compile(script.read_bytes(), str(script), "exec"), module.__dict__)
    finally:
        sys.modules["__main__"] = original


def shutdown_distributed() -> None:
    """Leave together and tear the process groups down before the interpreter exits.

    A rank that exits first can otherwise destroy communicator threads a slower peer still uses
    ("terminate called without an active exception", exit -6). Scripts that already did it are fine.
    The collection afterwards frees finished communication works (and the tensors they hold) while
    the interpreter is whole: freed later, at interpreter shutdown, a backend thread that needs the
    GIL for them aborts the process the same way.
    """
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    stop_data_loader_workers()
    gc.collect()


def stop_data_loader_workers() -> None:
    """Stop the workers of every live multi-process DataLoader iterator while its queues still work.

    Megatron's iterators (``--num-workers``, default 2, persistent) sit in reference cycles. Collected by
    :func:`gc.collect`, an iterator's index queues are finalized (their feeder threads told to stop) before
    the iterator's own ``__del__`` sends each worker its stop signal through them, so the signal never
    leaves the process. Each worker then costs a join timeout (torch's ``MP_STATUS_CHECK_INTERVAL``, 5 s):
    20 to 30 s at the end of every run with a train, validation and test loader. Stopped here, first, each
    worker gets its signal and exits at once.
    """
    import gc

    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    # type(), not isinstance(): isinstance reads __class__, which a deprecated torch object answers with a warning
    for iterator in [o for o in gc.get_objects() if issubclass(type(o), _MultiProcessingDataLoaderIter)]:
        iterator._shutdown_workers()  # torch's own shutdown, the one __del__ would run


if __name__ == "__main__":
    main()
