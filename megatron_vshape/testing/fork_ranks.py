"""Start the ranks of one training launch by forking one interpreter that has imported torch and Megatron.

    python -m megatron_vshape.testing.fork_ranks --nproc N --port P --logs DIR [--stop-on-failure]
        [--no-preload] -- ENTRY [ARGS ...]

ENTRY is what would follow ``python`` on torchrun's command line: ``script.py`` or ``-m module``. Each
rank gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT), runs ENTRY as ``__main__`` exactly as ``python ENTRY`` would (``sys.argv``,
``sys.path[0]``, exit code), and writes stdout and stderr to ``DIR/rank{r}.log``. The last line
this process prints is every rank's exit code, as JSON (null: killed after another rank failed, with
``--stop-on-failure``, as torchrun does). ``--no-preload`` forks without importing anything first
(entries that use neither torch nor Megatron).

Why: importing torch, megatron-core and megatron.training costs each rank about 8 s of CPU, most of a
tiny training run, and a test machine with 2 cores runs dozens of launches. Forked ranks share one
import. Nothing is initialised before the fork (no process group, no threads beyond the interpreter's,
no CUDA): the ranks start from what ``import`` alone leaves, as fresh interpreters would. The tests'
launch helpers use this; the commands the README gives keep ``torchrun``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback
import warnings

from .spawn import TORCH_AND_MEGATRON

# Imported once before forking. megatron.training needs the Python 3.11 shim that every entry applies
# first anyway (training_cpu.patch_python_compat); an environment without it (megatron-core 0.16)
# preloads what it has and lets the entry report the rest. The runner's own modules (about 1 s of CPU
# per rank) come last: they import megatron, which must by then be the script's.
PRELOAD = (*TORCH_AND_MEGATRON, "megatron.training", "megatron.training.arguments",
           "megatron_vshape.megatron.install", "megatron_vshape.megatron.arguments")
RUNNER = "megatron_vshape.run"


def entry_script(entry: list[str]) -> str | None:
    """The training script ENTRY runs: ``script.py``, or the script given to the runner (``-m megatron_vshape.run
    script.py``); None for another module."""
    if entry[0] != "-m":
        return entry[0]
    if entry[1] == RUNNER and len(entry) > 2:
        return entry[2]
    return None


def preload(entry: list[str]) -> None:
    """Import what every rank would, from where the rank would: the entry script's directory first.

    ``python script.py`` (and the runner) import megatron from the script's directory when it holds a
    Megatron-LM checkout. Preloading from the test's environment instead would give every rank the
    installed megatron-core already imported, and a check meant for the checkout would test the
    installed version again.
    """
    from megatron_vshape.megatron.training_cpu import patch_python_compat

    script = entry_script(entry)
    if script is not None:  # as run_rank() and the runner set it: the script's directory replaces ours
        sys.path[0] = os.path.dirname(os.path.realpath(script))
    patch_python_compat()
    with warnings.catch_warnings():  # each rank's log keeps its own warnings only
        warnings.simplefilter("ignore")
        for name in PRELOAD:
            try:
                __import__(name)
            except Exception:  # noqa: BLE001 - the rank that needs it raises the real error
                return
        remember_argument_help()


def remember_argument_help() -> None:
    """Read the help text of Megatron's config dataclasses once, here, instead of three times per rank.

    megatron.training (0.19 and main) builds its parser from dataclasses, and reads each field's help
    from the class's source (``ArgumentGroupFactory._get_field_docstrings``: ``inspect.getsource``, which
    parses the whole module, for every class and base class). Megatron parses its arguments three times
    per start (in-process restart, fault tolerance, then ``parse_and_validate_args``): about 4 s of CPU
    per rank here, a fifth of a tiny launch. The help text depends only on the source, which no rank
    changes, so the ranks share one reading, taken before the fork. Nothing else about parsing changes:
    the same parser is built, with the same help, from the same source.
    """
    try:
        from megatron.training import argument_utils, arguments
    except ImportError:  # older megatron.training: no dataclass-built arguments, nothing to share
        return
    factory = getattr(argument_utils, "ArgumentGroupFactory", None)
    read = getattr(factory, "_get_field_docstrings", None)
    if read is None or getattr(read, "remembered", False):
        return
    cache: dict[type, dict[str, str]] = {}

    def remembered_field_docstrings(self, src_cfg_class: type) -> dict[str, str]:
        if src_cfg_class not in cache:
            cache[src_cfg_class] = read(self, src_cfg_class)
        return dict(cache[src_cfg_class])

    remembered_field_docstrings.remembered = True
    factory._get_field_docstrings = remembered_field_docstrings
    arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))  # read them all now


def _exit_code(err: SystemExit) -> int:
    if err.code is None or isinstance(err.code, int):
        return err.code or 0
    print(err.code, file=sys.stderr)  # sys.exit("message"): Python prints it and exits 1
    return 1


def run_rank(rank: int, nproc: int, port: int, log_path: str, entry: list[str]) -> None:
    """In the forked child: become rank ``rank`` and run ``entry``; never returns."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    code = 0
    try:
        if entry[0] == "-m":
            sys.argv = [entry[1], *entry[2:]]
            runpy.run_module(entry[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(entry[0])
            sys.argv = [entry[0], *entry[1:]]
            sys.path[0] = os.path.dirname(script)  # as `python script.py`: its directory, not the cwd
            runpy.run_path(script, run_name="__main__")
    except SystemExit as err:
        code = _exit_code(err)
    except BaseException:  # noqa: B036 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    finally:
        threading._shutdown()  # as at interpreter exit: wait for non-daemon threads, then atexit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def launch(nproc: int, port: int, log_dir: str, stop_on_failure: bool, entry: list[str],
           preload_first: bool = True) -> list[int | None]:
    if preload_first:
        preload(entry)
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            run_rank(rank, nproc, port, os.path.join(log_dir, f"rank{rank}.log"), entry)
        pids.append(pid)
    codes: list[int | None] = [None] * nproc
    while any(code is None for code in codes):
        pid, status = os.wait()
        rank = pids.index(pid)
        codes[rank] = os.waitstatus_to_exitcode(status)
        if codes[rank] and stop_on_failure:  # like torchrun: one failed rank ends the launch
            for other, other_pid in enumerate(pids):
                if codes[other] is None:
                    os.kill(other_pid, signal.SIGKILL)
            for other, other_pid in enumerate(pids):
                if codes[other] is None:
                    os.waitpid(other_pid, 0)
            break
    return codes


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_vshape.testing.fork_ranks")
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--logs", required=True, help="directory for rank{r}.log")
    parser.add_argument("--stop-on-failure", action="store_true")
    parser.add_argument("--no-preload", dest="preload", action="store_false")
    split = argv.index("--")
    options, entry = parser.parse_args(argv[:split]), argv[split + 1:]
    started = time.monotonic()
    codes = launch(options.nproc, options.port, options.logs, options.stop_on_failure, entry, options.preload)
    print(json.dumps({"codes": codes, "seconds": round(time.monotonic() - started, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
