"""Which megatron a run imports (``megatron_vshape.megatron.which_megatron``): the script's checkout first, as
``python script.py`` would, and the start-up line that says which one runs. No process is launched here;
the runner itself is launched from another directory in ``test_runner_cli.py``."""

import os
import sys
import types
from pathlib import Path

import pytest

from megatron_vshape.megatron import which_megatron
from megatron_vshape.megatron.arguments import ConfigError


def _checkout(root: Path) -> Path:
    (root / "megatron" / "core").mkdir(parents=True)
    (root / "megatron" / "core" / "__init__.py").write_text("")
    (root / "pretrain_gpt.py").write_text("")
    return root / "pretrain_gpt.py"


def _core_module(megatron_dir: Path, version: str = "0.20.0") -> types.ModuleType:
    module = types.ModuleType("megatron.core")
    module.__file__ = str(megatron_dir / "core" / "__init__.py")
    module.__version__ = version
    return module


def test_the_scripts_directory_replaces_the_working_directory_on_the_path(tmp_path, monkeypatch):
    """``python -m`` put the working directory first; ``python script.py`` would have the script's."""
    script = _checkout(tmp_path / "Megatron-LM")
    monkeypatch.setattr(sys, "path", [os.getcwd(), "/somewhere/else"])
    monkeypatch.delitem(sys.modules, "megatron.core", raising=False)
    which_megatron.put_script_first(script)
    which_megatron.put_script_first(script)  # idempotent
    assert sys.path == [str(tmp_path / "Megatron-LM"), "/somewhere/else"]
    assert which_megatron.checkout_of(script) == tmp_path / "Megatron-LM" / "megatron"


def test_a_megatron_imported_before_the_checkout_is_refused_in_one_line(tmp_path, monkeypatch):
    script = _checkout(tmp_path / "Megatron-LM")
    monkeypatch.setattr(sys, "path", ["/somewhere/else"])
    monkeypatch.setitem(sys.modules, "megatron.core", _core_module(tmp_path / "site-packages" / "megatron", "0.19.2"))
    with pytest.raises(ConfigError) as caught:
        which_megatron.put_script_first(script)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"megatron was imported from {tmp_path}/site-packages/megatron "
                                                      f"before the runner could put the script's checkout "
                                                      f"{tmp_path}/Megatron-LM/megatron first")
    monkeypatch.setitem(sys.modules, "megatron.core", _core_module(tmp_path / "Megatron-LM" / "megatron"))
    which_megatron.put_script_first(script)  # the checkout's own: fine


def test_a_script_without_a_checkout_runs_the_installed_megatron(tmp_path, monkeypatch):
    """Megatron-LM's scripts alone (the core_v0.19.0 copy): nothing to put first but their directory."""
    (tmp_path / "pretrain_gpt.py").write_text("")
    monkeypatch.setattr(sys, "path", ["/somewhere/else"])
    monkeypatch.setitem(sys.modules, "megatron.core", _core_module(tmp_path / "site-packages" / "megatron", "0.19.2"))
    which_megatron.put_script_first(tmp_path / "pretrain_gpt.py")
    assert sys.path == [str(tmp_path), "/somewhere/else"]
    assert which_megatron.checkout_of(tmp_path / "pretrain_gpt.py") is None


def test_the_startup_line_names_the_running_megatron_and_an_installed_one_it_shadows(tmp_path, monkeypatch):
    checkout, site = tmp_path / "Megatron-LM" / "megatron", tmp_path / "site-packages" / "megatron"
    monkeypatch.setattr(which_megatron, "installed_megatron_core", lambda: ("0.19.2", site))
    assert which_megatron.startup_line(_core_module(checkout)) == (
        f"megatron 0.20.0 from {checkout}; the installed megatron-core 0.19.2 at {site} is not used")
    assert which_megatron.startup_line(_core_module(site, "0.19.2")) == (
        f"megatron 0.19.2 from {site} (the installed megatron-core 0.19.2)")
    monkeypatch.setattr(which_megatron, "installed_megatron_core", lambda: None)
    assert which_megatron.startup_line(_core_module(checkout)) == (
        f"megatron 0.20.0 from {checkout} (no megatron-core installed)")


def test_the_installed_megatron_core_is_found_with_its_directory():
    installed = which_megatron.installed_megatron_core()  # the tests' environments all pip-install one
    assert installed is not None
    version, directory = installed
    assert version.count(".") == 2 and directory is not None and (directory / "core" / "__init__.py").is_file()
