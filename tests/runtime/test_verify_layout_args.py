"""vshape verify --pipeline-layout: bad layouts fail in one line before any process starts."""

import pytest

from megatron_vshape.verify import main


@pytest.mark.parametrize("argv, expected", [
    (["--pp", "2", "--pipeline-layout", "1,2"], "--pipeline-layout: 2 counts given for 4 pipeline stages"),
    (["--pp", "2", "--pipeline-layout", "1,3,2,3"], "--pipeline-layout: counts sum to 9 but --layers is 8"),
    (["--pp", "2", "--pipeline-layout", "1,3,0,4"], "--pipeline-layout: stage(s) 2 would hold no layer"),
    (["--pp", "2", "--pipeline-layout", "balanced"], "--pipeline-layout balanced is chosen by training"),
    (["--pp", "1", "--pipeline-layout", "1,7"], "--pipeline-layout needs --pp >= 2"),
])
def test_bad_layout_is_one_line_and_exit_2(capsys, argv, expected):
    assert main(["--schedule", "v-half", "--microbatches", "4", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and "\n" not in err, err


def test_uneven_layer_count_is_fine_with_a_layout(monkeypatch):
    """--layers 14 does not divide into 4 stages; with a layout the run is set up (run_check stubbed)."""
    import megatron_vshape.verify as verify

    seen = {}

    def fake_run_check(spec, timeout):
        seen["spec"] = spec
        return {"v-half": {"max_grad_rel_err": 0.0, "max_loss_abs_err": 0.0, "peak_activation_bytes": [0, 0],
                           "predicted_peak_units": [1.0, 1.0], "wgrad_deferred": 0, "wgrad_run": 0,
                           "worst_param": None}}

    monkeypatch.setattr(verify, "run_check", fake_run_check)
    assert main(["--schedule", "v-half", "--pp", "2", "--microbatches", "4", "--layers", "14",
                 "--pipeline-layout", "2,5,4,3"]) == 0
    assert seen["spec"].layouts == ((2, 5, 4, 3),) and seen["spec"].layout_for(4) == (2, 5, 4, 3)
