"""The feature matrix's row test, shared by its shard files (``test_feature_matrix_rows_*.py``; imported by
name: keep this module name unique in tests/).

Every row trains 3 iterations and one evaluation on 4 CPU ranks and must print the losses of Megatron's own
1F1B without our flags on the same model (one reference run per model and file, shared by the rows that
differ only in our flags, the DP options or recomputation). ``-m extended`` runs every row; the default tier
runs a fixed subset that holds every value of every factor. With ``VSHAPE_MATRIX_RESULTS=path`` each row's
result is appended to that file (JSON lines), which ``scripts/feature_matrix.py`` renders into
``docs/recipes.md``. The rows are spread over several files (:func:`feature_matrix.shards`), whole models
each, so that CI's two workers (which take whole files) share the launches.
"""

from __future__ import annotations

import json
import os
import re

import pytest
from glue_support import LOSS, launch_ranks

from megatron_vshape.testing import feature_matrix as fm

TIMEOUT = 300
EVAL = re.compile(r"validation loss at iteration 3 on validation set \| lm loss value: ([0-9.E+-]+)")


def _launch(python: str, client, script: str, flags: list[str]) -> tuple[int, str]:
    result = launch_ranks(python, fm.RANKS, ["-m", "megatron_vshape.run", str(client / script)], flags,
                          timeout=TIMEOUT)
    return result.returncode, result.stdout


def _losses(output: str) -> dict:
    losses = {int(i): float(v) for i, v in LOSS.findall(output)}
    evaluation = EVAL.findall(output)
    if evaluation:
        losses["validation"] = float(evaluation[0])
    return losses


@pytest.fixture(scope="module")
def references(mc19_python, megatron_lm_019):
    """Megatron's own 1F1B per model (launched on first use)."""
    cache: dict[tuple, dict] = {}

    def reference(row: fm.Row) -> dict:
        key = row.reference_key()
        if key not in cache:
            code, output = _launch(mc19_python, megatron_lm_019, row.script, row.reference_flags())
            assert code == 0, f"Megatron's 1F1B for {row.name}:\n{output[-5000:]}"
            cache[key] = _losses(output)
            assert set(cache[key]) == {1, 2, 3, "validation"}, output[-3000:]
        return cache[key]

    return reference


def _record(row: fm.Row, outcome: dict) -> None:
    path = os.environ.get("VSHAPE_MATRIX_RESULTS")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps({"row": row.as_dict(), "name": row.name, **outcome}) + "\n")


def row_test(shard: int):
    """The test of the rows of ``shard`` (``fm.shards()[shard]``), for a shard file to hold."""

    @pytest.mark.slow  # launches processes
    @pytest.mark.timeout(3 * TIMEOUT)
    @pytest.mark.parametrize("row", [pytest.param(row, id=row.name,
                                                  marks=() if row in fm.DEFAULT_ROWS else pytest.mark.extended)
                                     for row in fm.shards()[shard]])
    def test_row_gives_megatrons_1f1b_losses(mc19_python, megatron_lm_019, references, row):
        code, output = _launch(mc19_python, megatron_lm_019, row.script, row.flags())
        refused = [line for line in output.splitlines() if "megatron-vshape error:" in line]
        if code != 0:
            _record(row, {"outcome": "failed", "refusal": refused[:1]})
            pytest.fail(f"{row.name} exited {code}:\n{output[-5000:]}")
        got, want = _losses(output), references(row)
        assert set(got) == set(want), (row.name, got, output[-3000:])
        errors = {k: abs(got[k] - want[k]) / abs(want[k]) for k in want}
        _record(row, {"outcome": "ran", "losses": got, "reference": want, "max_rel_err": max(errors.values())})
        assert max(errors.values()) <= row.tolerance(), (row.name, errors, got, want)

    return test_row_gives_megatrons_1f1b_losses
