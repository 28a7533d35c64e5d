"""The spawn harness: gloo ranks start from a fork server that has already imported torch and megatron-core
(the imports cost about 7 s of CPU per rank), and each call's ranks see the caller's environment as it is at
that call, not as it was when the fork server started."""

import os
import sys

import pytest

from megatron_vshape.testing.spawn import PRELOAD, spawn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _modules_and_mark(rank, world_size):
    return {"preloaded": [name for name in PRELOAD if name in sys.modules], "mark": os.environ.get("VSHAPE_SPAWN_MARK")}


def test_gloo_ranks_start_with_megatron_imported_and_the_callers_current_environment(monkeypatch):
    monkeypatch.setenv("VSHAPE_SPAWN_MARK", "first")
    first = spawn(_modules_and_mark, 2, timeout=150)
    monkeypatch.setenv("VSHAPE_SPAWN_MARK", "second")  # the fork server keeps the environment it started with
    second = spawn(_modules_and_mark, 2, timeout=150)
    for result in first + second:
        assert result["preloaded"] == list(PRELOAD)
    assert [r["mark"] for r in first + second] == ["first", "first", "second", "second"]
