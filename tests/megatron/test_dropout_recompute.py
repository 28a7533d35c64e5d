"""Schedule-invariant dropout under activation recomputation: the recomputed forward redraws the masks.

Recomputation re-runs layer forwards inside the backward: after the forward step's wrapper has returned,
and on a GPU on autograd's worker thread. Before, the layers' reseeding hooks saw no position there, so
the recomputed masks differed from the forward's and the gradients were silently wrong.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _gpu_path_workers import recompute_dropout_worker  # noqa: E402

from megatron_vshape.testing import spawn  # noqa: E402

pytestmark = pytest.mark.slow  # launches processes: not in the fast tier (-m "not slow")


@pytest.mark.timeout(150)
def test_recomputed_layers_redraw_the_forwards_dropout_masks():
    (errors,) = spawn(recompute_dropout_worker, 1, (), timeout=120)
    assert errors["main_thread"] <= 1e-6, errors
    assert errors["threaded"] <= 1e-6, errors
