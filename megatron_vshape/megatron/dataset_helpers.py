"""Megatron's C++ dataset helpers (``megatron.core.datasets.helpers_cpp``), built for the Python that runs.

Megatron's training start-up calls ``compile_helpers()`` on rank 0 (``_compile_dependencies``), then a
barrier. It runs ``make`` in ``megatron/core/datasets``, and the Makefile asks ``python3 -m pybind11`` for
the include flags and ``python3-config --extension-suffix`` for the library's name: whatever Python those
names find on PATH, which need not be the one running (a 3.12 library that 3.11 ranks cannot import).
Without ``pybind11`` the compiler fails; the megatron-core wheel ships the library prebuilt and no
Makefile, so ``make`` fails there too. Either way rank 0 exits with a compiler error and every other
rank dies in the barrier with gloo's "connection closed".

:func:`install` (every run, from ``install()``) replaces ``compile_helpers``: nothing to do when
``helpers_cpp`` imports; otherwise it compiles ``helpers.cpp`` with the Makefile's flags for
``sys.executable`` (its pybind11, its headers, its extension suffix), on rank 0 as Megatron does.
Before that, every rank checks that the build has what it needs, at argument validation, before any
process group exists: a missing piece is one line and exit 2 on every rank.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from .flags import ConfigError

MODULE = "megatron.core.datasets.helpers_cpp"
SOURCE = "helpers.cpp"
# Megatron's Makefile: CXXFLAGS += -O3 -Wall -shared -std=c++17 -fPIC -fdiagnostics-color
CXXFLAGS = ("-O3", "-Wall", "-shared", "-std=c++17", "-fPIC")


def datasets_dir() -> Path:
    """The directory of the running megatron's ``megatron.core.datasets`` (without importing it)."""
    spec = importlib.util.find_spec("megatron.core.datasets")
    return Path(next(iter(spec.submodule_search_locations)))


def library_path() -> Path:
    """Where the helpers for this interpreter go: ``helpers_cpp`` + this Python's extension suffix."""
    return datasets_dir() / f"helpers_cpp{sysconfig.get_config_var('EXT_SUFFIX')}"


def importable() -> bool:
    try:
        importlib.import_module(MODULE)
    except ImportError:
        return False
    return True


def compiler() -> str:
    """The C++ compiler ``make`` would use: ``$CXX``, else ``c++``."""
    return os.environ.get("CXX") or "c++"


def build_command() -> list[str]:
    import pybind11

    includes = [f"-I{sysconfig.get_path('include')}", f"-I{pybind11.get_include()}"]
    return [*shlex.split(compiler()), *CXXFLAGS, *includes]


def missing() -> str | None:
    """What building the helpers for this interpreter lacks (None: already built, or buildable)."""
    if importable():
        return None
    where = datasets_dir()
    python = f"Python {sys.version_info.major}.{sys.version_info.minor} ({sys.executable})"
    if not (where / SOURCE).is_file():
        return (f"megatron's dataset helpers are not built for {python} and {where} has no {SOURCE} to build "
                f"them from: install the megatron-core wheel made for this Python")
    lacks = []
    if importlib.util.find_spec("pybind11") is None:
        lacks.append("pybind11 (pip install pybind11)")
    if not (Path(sysconfig.get_path("include")) / "Python.h").is_file():
        lacks.append(f"Python's headers ({sysconfig.get_path('include')}/Python.h)")
    if shutil.which(shlex.split(compiler())[0]) is None:
        lacks.append(f"a C++ compiler ({compiler()}; set CXX)")
    if not os.access(where, os.W_OK):
        lacks.append(f"write access to {where} (copy the checkout somewhere writable)")
    if not lacks:
        return None
    return (f"megatron's dataset helpers ({library_path().name}) are not built for {python}, and building them "
            f"needs {', '.join(lacks)}")


def check() -> None:
    """Raise :class:`ConfigError` (one line) when the helpers are neither importable nor buildable."""
    why = missing()
    if why is not None:
        raise ConfigError(why)


def build() -> None:
    """Compile ``helpers.cpp`` for this interpreter, unless ``helpers_cpp`` already imports.

    The library is written under a temporary name and renamed into place, so that another process never
    imports a half-written file.
    """
    if importable():
        return
    target = library_path()
    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    command = [*build_command(), str(target.parent / SOURCE), "-o", str(partial)]
    print(f" [vshape] building megatron's dataset helpers for {sys.executable}: {' '.join(command)}", flush=True)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        print(result.stdout + result.stderr, file=sys.stderr, flush=True)
        print(f"megatron-vshape error: building megatron's dataset helpers failed ({command[0]} exited "
              f"{result.returncode}; its output above)", file=sys.stderr, flush=True)
        raise SystemExit(2)
    os.replace(partial, target)
    importlib.invalidate_caches()


def install() -> None:
    """Check the helpers can be had (one line if not), then make Megatron's compile step build them our way."""
    check()
    from megatron.core.datasets import utils

    utils.compile_helpers = build
