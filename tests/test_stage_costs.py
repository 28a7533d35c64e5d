"""Per-stage costs (issue 13): uniform costs give today's schedules, non-uniform ones stay valid.

``python tests/test_stage_costs.py --record`` rewrites tests/fixtures/uniform_schedules.json from
the current code; it was run once before per-stage costs reached any generator, so the fixture
is "today's" schedules and the comparison below is the guard that uniform costs change nothing.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from megatron_vshape.schedules import Costs, get_schedule, schedule_names, simulate

FIXTURE = Path(__file__).parent / "fixtures" / "uniform_schedules.json"
COST_SETTINGS = {
    "equal": Costs(),
    "skewed": Costs(f=1.0, b=1.5, w=0.7),
    "comm": Costs(f=1.2, b=1.0, w=0.9, comm=0.1),
}
GRID = [(d, m) for d in (2, 4, 8) for m in (d, 2 * d, 4 * d)]


def _is_slow(name: str, d: int, m: int) -> bool:
    """The fast tier re-checks every schedule on d <= 4 (v-auto: d = 2); the slow test the rest."""
    return d > 4 or (name == "v-auto" and d > 2)


def _key(name: str, d: int, m: int, setting: str) -> str:
    return f"{name} d={d} m={m} {setting}"


def _fingerprint(name: str, d: int, m: int, setting: str) -> dict:
    costs = COST_SETTINGS[setting]
    schedule = get_schedule(name, d, m, costs)
    result = simulate(schedule, costs)
    return {
        "actions_sha256": hashlib.sha256(schedule.to_text().encode()).hexdigest(),
        "makespan": round(result.makespan, 9),
        "peak_memory": [round(p, 9) for p in result.peak_memory],
    }


def _cells(slow: bool):
    for name in schedule_names():
        for d, m in GRID:
            if _is_slow(name, d, m) != slow:
                continue
            for setting in COST_SETTINGS:
                yield name, d, m, setting


def record() -> None:
    table = {_key(*cell): _fingerprint(*cell) for slow in (False, True) for cell in _cells(slow)}
    FIXTURE.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(table)} fingerprints to {FIXTURE}")


def _compare(slow: bool) -> None:
    expected = json.loads(FIXTURE.read_text())
    changed = [
        _key(*cell) for cell in _cells(slow) if _fingerprint(*cell) != expected[_key(*cell)]
    ]
    assert not changed, f"uniform-cost schedules changed: {changed[:5]} ({len(changed)} in all)"


def test_uniform_schedules_unchanged_fast_cells():
    _compare(slow=False)


@pytest.mark.slow
def test_uniform_schedules_unchanged_large_cells():
    _compare(slow=True)


if __name__ == "__main__" and "--record" in sys.argv:
    record()
