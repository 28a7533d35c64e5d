"""With ``--pipeline-vocab-parallel`` and ``--overlap-grad-reduce``, when the data-parallel reductions start.

Only the vocabulary shard's parameters get gradients after the layers' last passes (each G adds its output
rows', the embedding's D and the call's epilogue add its rows'), so only their buckets wait for the call's
end; every other bucket launches at its last W (split schedules, ``runtime/grad_sync.py``) or with its
chunk's last backward (fused ones), inside the pass loop, as without the flag. Before, every chunk's
reduction waited for the epilogue (``launches_in_loop`` was 0).

Every bucket's reduction completes at its launch (``sync_bucket_launch``) and the buckets are small (several
per chunk): a bucket launched before the last pass that adds to it would leave that part un-reduced, which
the gradient comparison with one process sees deterministically.
"""

from __future__ import annotations

import pytest

from megatron_vshape.testing import RunSpec, run_check

pytestmark = pytest.mark.slow  # launches processes: not in the fast tier (-m "not slow")


@pytest.mark.timeout(600)
def test_dp2_buckets_launch_in_the_pass_loop_but_the_vocabulary_shards_wait_for_the_epilogue():
    spec = RunSpec(schedules=("v-zb", "v-half", "interleaved-1f1b", "1f1b"), pp=2, dp=2, microbatches=4,
                   overlap_grad_reduce=True, bucket_size=2000, sync_bucket_launch=True, vocab_parallel=True)
    results = run_check(spec, timeout=500)
    for name, row in results.items():
        assert row["num_losses"] == spec.microbatches * spec.dp, (name, row)
        assert row["max_grad_rel_err"] <= 1e-6 and row["max_loss_abs_err"] <= 1e-6, (name, row)
        assert row["buckets"] > 4 * spec.world_size, (name, row)  # several buckets per chunk
        if name == "1f1b":  # one chunk per rank, fused backward: the chunk holds the shard, so all of it waits
            assert row["launches_in_loop"] == 0, (name, row)
        else:  # the chunk without the shard (and, split, its own chunk's other buckets) in the loop
            assert 0 < row["launches_in_loop"] < row["buckets"], (name, row)
