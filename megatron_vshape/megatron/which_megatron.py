"""Which megatron a run imports: the script's own checkout first, as ``python script.py`` would.

A user of Megatron-LM launches ``pretrain_gpt.py`` from a clone; ``python pretrain_gpt.py`` puts the
script's directory first on ``sys.path``, so the clone's ``megatron/`` runs, even when a megatron-core
wheel is installed too. The runner must do the same, and before anything imports megatron: a module once
imported stays, and the installed package would silently stand in for the user's (possibly patched) tree.
``megatron/`` is a namespace package in both the wheel and the checkout; with the checkout first on the
path its ``megatron.core`` and ``megatron.training`` are the ones found.

:func:`put_script_first` is the runner's part; :func:`startup_line` is the line rank 0 prints at start-up
(every entry: the runner, a patched script, our ``scripts/pretrain_gpt.py``).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

from .flags import ConfigError


def checkout_of(script: Path) -> Path | None:
    """The ``megatron`` package directory next to ``script`` (a Megatron-LM checkout), or None."""
    candidate = script.resolve().parent / "megatron"
    return candidate if (candidate / "core" / "__init__.py").is_file() else None


def put_script_first(script: Path) -> None:
    """Put ``script``'s directory first on ``sys.path``, as ``python script.py`` does.

    ``python -m megatron_vshape.run`` started with the working directory there instead: it is replaced,
    so a ``megatron/`` in whatever directory the job was launched from cannot shadow the script's own or
    the installed one. (megatron_vshape itself is imported by now, and finds its submodules by its own
    package path.) Raises :class:`ConfigError` when megatron was imported before this and is not the
    script's checkout: the run would silently train on another megatron.
    """
    directory = str(script.resolve().parent)
    safe_path = getattr(sys.flags, "safe_path", False)  # python -P (3.11+): nothing was put first
    if sys.path and not safe_path and sys.path[0] in ("", os.getcwd()):
        sys.path[0] = directory
    elif not sys.path or sys.path[0] != directory:
        sys.path.insert(0, directory)
    checkout = checkout_of(script)
    imported = sys.modules.get("megatron.core")
    if checkout is not None and imported is not None and package_dir(imported) != checkout:
        raise ConfigError(f"megatron was imported from {package_dir(imported)} before the runner could put the "
                          f"script's checkout {checkout} first on sys.path; launch the runner in a fresh interpreter")


def package_dir(core_module) -> Path:
    """The ``megatron`` directory a ``megatron.core`` module was imported from."""
    return Path(core_module.__file__).resolve().parent.parent


def installed_megatron_core() -> tuple[str, Path | None] | None:
    """The pip-installed megatron-core: (version, its ``megatron`` directory), or None if there is none.

    An editable install (``pip install -e`` of a checkout) is found by its PEP 610 record; a regular
    one by its files.
    """
    try:
        dist = importlib.metadata.distribution("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None
    location = None
    direct_url = dist.read_text("direct_url.json")
    if direct_url:
        try:
            record = json.loads(direct_url)
        except ValueError:
            record = {}
        if record.get("dir_info", {}).get("editable") and record.get("url", "").startswith("file://"):
            location = Path(unquote(urlparse(record["url"]).path)) / "megatron"
    if location is None:
        candidate = Path(dist.locate_file("megatron"))
        location = candidate if (candidate / "core").is_dir() else None
    return dist.version, location.resolve() if location is not None else None


def startup_line(core=None) -> str:
    """Which megatron runs: its version and where it was imported from; also the installed one where
    that is another. ``core``: the ``megatron.core`` module (default: import it)."""
    if core is None:
        import megatron.core as core

    version = getattr(core, "__version__", "unknown")
    running = package_dir(core)
    line = f"megatron {version} from {running}"
    installed = installed_megatron_core()
    if installed is None:
        return line + " (no megatron-core installed)"
    installed_version, installed_dir = installed
    if installed_dir == running:
        return line + f" (the installed megatron-core {installed_version})"
    where = f" at {installed_dir}" if installed_dir is not None else ""
    return line + f"; the installed megatron-core {installed_version}{where} is not used"


def print_startup_line() -> None:
    """Rank 0 prints :func:`startup_line` once per process."""
    global _printed
    if _printed or os.environ.get("RANK", "0") != "0":
        return
    _printed = True
    print(f" [vshape] {startup_line()}", flush=True)


_printed = False
