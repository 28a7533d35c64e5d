"""`vshape plan --jobs N`: the rows' searches and layout comparisons on forked processes give the answer one
process gives, in the same order (planner/row_pool.py). Pure Python (the workers fork this process)."""

from __future__ import annotations

import json
import os

import pytest

from megatron_vshape.planner import cli, row_pool

PLAN = ["--model", "9.6b", "--gpus", "16", "--global-batch", "64", "--tp", "1", "--pp", "4,8",
        "--micro-batch", "1,2", "--schedules", "1f1b,zb-1p,v-half,v-zb"]


def _plan(capsys, tmp_path, jobs: int) -> tuple[str, list]:
    out = tmp_path / f"plan{jobs}.json"
    assert cli.main([*PLAN, "--jobs", str(jobs), "--json", str(out)]) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


def test_the_plan_on_two_processes_prints_and_writes_what_one_process_does(capsys, tmp_path):
    one, one_json = _plan(capsys, tmp_path, 1)
    two, two_json = _plan(capsys, tmp_path, 2)
    assert two == one and two_json == one_json
    assert "v-zb +vocab" in one and "Layer layout" in one  # rows with their flag and the layout table were compared


def test_pieces_answer_in_their_order_whatever_order_they_run_in():
    pieces = [lambda i=i: (i, os.getpid()) for i in range(6)]
    answers = row_pool.run_all(pieces, 2, weights=[0, 5, 1, 4, 2, 3])
    assert [i for i, _ in answers] == list(range(6))
    assert all(pid != os.getpid() for _, pid in answers)  # on the workers
    assert [pid for _, pid in row_pool.run_all(pieces, 1)] == [os.getpid()] * 6  # one job: here, no fork
    assert row_pool._PIECES == ()  # nothing left behind for a later pool


def test_a_piece_that_raises_raises_here():
    def bad():
        raise ValueError("no layout fits")
    with pytest.raises(ValueError, match="no layout fits"):
        row_pool.run_all([lambda: 1, bad], 2)


def test_jobs_must_be_a_positive_count(capsys):
    assert cli.main([*PLAN, "--jobs", "0"]) == 2
    assert "--jobs" in capsys.readouterr().err
