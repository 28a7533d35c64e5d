"""The pairwise feature matrix through Megatron-LM's own scripts (``megatron_vshape/testing/feature_matrix.py``).

Every row trains 3 iterations and one evaluation on 4 CPU ranks and must print the losses of Megatron's own
1F1B without our flags on the same model (one reference run per model, shared by the rows that differ only
in our flags, the DP options or recomputation). ``-m extended`` runs every row; the default tier runs a
fixed subset that holds every value of every factor. With ``VSHAPE_MATRIX_RESULTS=path`` each row's
result is appended to that file (JSON lines), which ``scripts/feature_matrix.py`` renders into
``docs/recipes.md``.
"""

from __future__ import annotations

import json
import os
import re
import textwrap

import pytest
from glue_support import LOSS, launch_ranks

from megatron_vshape.testing import feature_matrix as fm

pytestmark = pytest.mark.slow  # launches processes

TIMEOUT = 300
EVAL = re.compile(r"validation loss at iteration 3 on validation set \| lm loss value: ([0-9.E+-]+)")
MATRIX = fm.rows()
DEFAULT = fm.DEFAULT_ROWS


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


@pytest.mark.timeout(3 * TIMEOUT)
@pytest.mark.parametrize("row", [pytest.param(row, id=row.name, marks=() if row in DEFAULT else pytest.mark.extended)
                                 for row in MATRIX])
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


def test_the_matrix_covers_every_allowed_pair_and_the_default_tier_every_value():
    assert fm.uncovered_pairs(MATRIX) == []
    assert all(fm.allowed(row.as_dict()) for row in MATRIX)
    held = {(name, getattr(row, name)) for row in DEFAULT for name in fm.FACTORS}
    assert held == {(name, value) for name, values in fm.FACTORS.items() for value in values}
    # every excluded pair is one a row could otherwise hold, and none does
    for exclusion in fm.EXCLUDED:
        assert not any(exclusion.forbids(row.as_dict()) for row in MATRIX)


def test_docs_recipes_md_holds_the_matrix_of_this_tree():
    """docs/recipes.md's table is generated (scripts/feature_matrix.py) and lists exactly the rows of the
    generator, in order, with a result for each: a changed factor or constraint must be rerun and rendered."""
    import sys

    from glue_support import ROOT

    sys.path.insert(0, str(ROOT / "scripts"))
    import feature_matrix as script

    page = (ROOT / "docs" / "recipes.md").read_text()
    assert script.BEGIN in page and script.END in page
    written = page.split(script.BEGIN, 1)[1].split(script.END, 1)[0]
    table = [line for line in written.splitlines() if line.startswith("| ") and line[2:3].isdigit()]
    fresh = [line for line in script.render({}).splitlines() if line.startswith("| ") and line[2:3].isdigit()]
    assert [r.rsplit(" | ", 1)[0] for r in table] == [r.rsplit(" | ", 1)[0] for r in fresh]
    assert all(r.rsplit(" | ", 1)[1].startswith(("✓", "✗")) for r in table), "a row without its result"


REFUSALS = textwrap.dedent("""
    import json, sys
    from megatron_vshape.megatron.check_flags import check
    out = {}
    for name, flags in json.loads(sys.stdin.read()).items():
        verdict = check(flags, te_version="none", world_size=4)
        out[name] = [verdict.accepted, verdict.line]
    print("RESULT" + json.dumps(out))
""")


@pytest.mark.timeout(300)
def test_every_excluded_pair_the_plugin_refuses_is_one_line_before_any_rank_computes(mc19_python):
    """A row that holds a refused pair (the other factors as the first default row that allows it) gets the
    exclusion's one line from the checks every rank runs at start-up (check-flags runs the same, in one
    process)."""
    import subprocess

    from glue_support import ROOT, cpu_env

    cases = {}
    for exclusion in fm.EXCLUDED:
        if exclusion.refusal is None:
            continue
        values = dict(next(r for r in fm.DEFAULT_ROWS
                           if fm.allowed({**r.as_dict(), **dict([exclusion.first])})).as_dict())
        values.update(dict([exclusion.first, exclusion.second]))
        cases[exclusion.refusal] = fm.Row(**values).flags()
    result = subprocess.run([mc19_python, "-c", REFUSALS], input=json.dumps(cases), capture_output=True, text=True,
                            timeout=240, cwd=ROOT, env=cpu_env())
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("RESULT")]
    assert lines, result.stderr[-3000:]
    for refusal, (accepted, line) in json.loads(lines[0][len("RESULT"):]).items():
        assert not accepted and refusal in line and "\n" not in line, (refusal, line)
