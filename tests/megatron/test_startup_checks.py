"""Issue 12: config errors that used to surface late now stop every rank at start-up with exit 2.

``--pipeline-schedule v-auto --pipeline-memory-limit 0.05`` passed the start-up checks and raised a
ScheduleError traceback on every rank at iteration 1 (exit 1), naming the CLI's ``--memory-limit``;
an unwritable ``--save`` failed only at the first save, after the work was done. Each rank is
started by hand (torchrun would kill the slower rank as soon as one fails), as in
test_pretrain_cpu.py's bad-config test.
"""


import pytest
from glue_support import ROOT, run_ranks_by_hand
from test_pretrain_cpu import TINY, with_values

pytestmark = pytest.mark.slow  # launches processes: not in the fast tier (-m "not slow")

PP2 = with_values(TINY, {"--pipeline-model-parallel-size": "2"})  # 8 microbatches of 2 on 2 ranks

CASES = {
    "v-auto-unreachable-limit": (
        ["--pipeline-schedule", "v-auto", "--pipeline-memory-limit", "0.05", *PP2],
        "megatron-vshape error: --pipeline-schedule v-auto at PP=2 with 8 microbatches: --pipeline-memory-limit 0.05 "
        "is below what v-auto reaches on 2 devices with 8 microbatches"),
    "save-under-a-file": (
        ["--pipeline-schedule", "v-half", *PP2, "--save", str(ROOT / "README.md" / "ckpt"), "--save-interval", "1"],
        f"megatron-vshape error: --save {ROOT / 'README.md' / 'ckpt'}: {ROOT / 'README.md'} exists and is not a "
        "directory"),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", sorted(CASES))
def test_config_error_stops_every_rank_before_iteration_1(mc19_python, case):
    args, expected = CASES[case]
    results = run_ranks_by_hand(mc19_python, [str(ROOT / "scripts" / "pretrain_gpt.py"), *args], 2, timeout=200)
    for returncode, out in results:
        assert returncode == 2, out[-3000:]  # was 1: a traceback at iteration 1 (or at the first save)
        errors = [ln for ln in out.splitlines() if "error" in ln.lower()]
        assert len(errors) == 1 and errors[0].startswith(expected), out[-3000:]
        assert "Traceback" not in out and "iteration        1/" not in out, out[-3000:]
