"""The pairwise feature matrix through Megatron-LM's own scripts (``megatron_vshape/testing/feature_matrix.py``):
what it covers, the page generated from it, and its refusals. Its rows train in
``test_feature_matrix_rows_*.py`` (``feature_matrix_rows.py``).
"""

from __future__ import annotations

import json
import textwrap

import pytest

from megatron_vshape.testing import feature_matrix as fm

MATRIX = fm.rows()
DEFAULT = fm.DEFAULT_ROWS


def test_the_matrix_covers_every_allowed_pair_and_the_default_tier_every_value():
    assert fm.uncovered_pairs(MATRIX) == []
    assert all(fm.allowed(row.as_dict()) for row in MATRIX)
    held = {(name, getattr(row, name)) for row in DEFAULT for name in fm.FACTORS}
    assert held == {(name, value) for name, values in fm.FACTORS.items() for value in values}
    # every excluded pair is one a row could otherwise hold, and none does
    for exclusion in fm.EXCLUDED:
        assert not any(exclusion.forbids(row.as_dict()) for row in MATRIX)


def test_the_shard_files_hold_every_row_once_and_each_model_in_one_file():
    parts = fm.shards()
    assert sorted((row for part in parts for row in part), key=MATRIX.index) == list(MATRIX)
    owner = {}
    for index, part in enumerate(parts):
        for row in part:
            assert owner.setdefault(row.reference_key(), index) == index, row.name  # one reference launch per tier
    from glue_support import ROOT

    files = sorted(p.name for p in (ROOT / "tests" / "megatron").glob("test_feature_matrix_rows_*.py"))
    assert files == [f"test_feature_matrix_rows_{i}.py" for i in range(fm.SHARDS)]


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


@pytest.mark.slow  # a process that imports torch and Megatron
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
