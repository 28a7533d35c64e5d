"""Megatron's C++ dataset helpers (``megatron_vshape.megatron.dataset_helpers``): what a build lacks is one
line before any rank starts, and a failed build one line after the compiler's output. The build itself runs
in the Megatron-LM main launches of ``test_real_client.py`` (with another Python's python3-config on PATH)."""

import importlib.util
import sys
import sysconfig

import pytest

from megatron_vshape.megatron import dataset_helpers
from megatron_vshape.megatron.arguments import ConfigError

PYTHON = f"Python {sys.version_info.major}.{sys.version_info.minor} ({sys.executable})"


@pytest.fixture
def unbuilt(tmp_path, monkeypatch):
    """A datasets directory with helpers.cpp and no library this interpreter imports."""
    (tmp_path / "helpers.cpp").write_text("int main() { return 0; }\n")
    monkeypatch.setattr(dataset_helpers, "datasets_dir", lambda: tmp_path)
    monkeypatch.setattr(dataset_helpers, "importable", lambda: False)
    return tmp_path


def test_nothing_is_missing_when_the_helpers_import(monkeypatch):
    monkeypatch.setattr(dataset_helpers, "importable", lambda: True)
    assert dataset_helpers.missing() is None
    dataset_helpers.check()


def test_a_missing_pybind11_is_named_in_one_line(unbuilt, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pybind11" else real(name, *a))
    with pytest.raises(ConfigError) as caught:
        dataset_helpers.check()
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    assert str(caught.value) == (f"megatron's dataset helpers (helpers_cpp{suffix}) are not built for {PYTHON}, and "
                                 "building them needs pybind11 (pip install pybind11)")


def test_every_missing_piece_is_named(unbuilt, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setattr(dataset_helpers.os, "access", lambda path, mode: False)
    message = dataset_helpers.missing()
    assert "\n" not in message
    assert "a C++ compiler (no-such-compiler; set CXX)" in message
    assert f"write access to {unbuilt} (copy the checkout somewhere writable)" in message


def test_a_wheel_without_helpers_for_this_python_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(dataset_helpers, "datasets_dir", lambda: tmp_path)  # no helpers.cpp, as in the wheel
    monkeypatch.setattr(dataset_helpers, "importable", lambda: False)
    assert dataset_helpers.missing() == (f"megatron's dataset helpers are not built for {PYTHON} and {tmp_path} has no "
                                         "helpers.cpp to build them from: install the megatron-core wheel made for "
                                         "this Python")


@pytest.mark.slow  # runs a (failing) compiler process
def test_a_failed_build_ends_with_one_line_and_leaves_no_library(unbuilt, monkeypatch, capsys):
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    with pytest.raises(SystemExit) as caught:
        dataset_helpers.build()
    assert caught.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "megatron-vshape error: building megatron's dataset helpers failed (false exited 1; its output above)")
    assert [path.name for path in unbuilt.iterdir()] == ["helpers.cpp"]
