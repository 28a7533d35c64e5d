"""No vocabulary buffer grows with the number of microbatches m (issue 42): the tokens every rank holds, the
data items the first stage reads ahead, and the embeddings and gradients it keeps (CPU, gloo, spawned ranks).

One training call of V-Half and of 1F1B with ``--pipeline-vocab-parallel`` at PP 2, m = 4 and m = 16: the
largest token buffer posted on the vocabulary queue, the most data items read from the first stage's
iterator ahead of its forward steps, and the peak bytes the embedding's passes report (the ``[vshape]``
line's "first stage's embeddings") are the same at both m. (The call-wide prologue broadcast one [m, b, s]
token tensor and read all m items ahead.)
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # launches processes: not in the fast tier (-m "not slow")


def buffers_rank(rank: int, world_size: int, schedule: str, counts: tuple[int, ...]):
    from megatron_vshape.testing.tiny_gpt import (
        forward_step,
        microbatch,
        recorded_vocab_rank,
        train_call,
        vocab_pipeline,
    )

    class Counting:
        """The data items, counting how many were read ahead of the forward steps that use them."""

        def __init__(self, items):
            self.items, self.read, self.used, self.ahead = iter(items), 0, 0, 0

        def __iter__(self):
            return self

        def __next__(self):
            self.read += 1
            self.ahead = max(self.ahead, self.read - self.used)
            return next(self.items)

    out = {}
    with recorded_vocab_rank(world_size) as (model, posts):
        func, ddp = vocab_pipeline(schedule, world_size, 4, model)
        for m in counts:
            data = [dict(microbatch(model, i), index=i) for i in range(m)]
            iterators = [Counting(data) for _ in ddp]

            def step(data_iterator, module, iterators=iterators):
                for it in iterators:
                    if it is data_iterator.source if hasattr(data_iterator, "source") else it is data_iterator:
                        it.used += 1
                return forward_step(data_iterator, module)

            posts.clear()
            train_call(func, ddp, iterators, step, m, model)
            # every integer tensor posted on the vocabulary queue: the tokens
            token_bytes = [t.nbytes for tensors in posts for t in tensors if not t.is_floating_point()]
            embedding_bytes = func.last_vocab_bytes[1] if hasattr(func, "last_vocab_bytes") else None
            out[m] = {"token_bytes": max(token_bytes, default=0), "posted": len(token_bytes),
                      "ahead": iterators[0].ahead, "embedding_bytes": embedding_bytes}
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["v-half", "1f1b"])
def test_no_vocabulary_buffer_grows_with_the_number_of_microbatches(schedule):
    from megatron_vshape.testing import spawn

    results = spawn(buffers_rank, 2, (schedule, (4, 16)), timeout=240)
    first = results[0]  # pipeline rank 0 holds stage 0 (and, on the V, the last stage)
    for rank, by_m in enumerate(results):
        small, large = by_m[4], by_m[16]
        assert small["token_bytes"] == large["token_bytes"] == 2 * 16 * 8, (rank, by_m)  # one microbatch's [b, s]
        assert large["posted"] == 16 and small["posted"] == 4, (rank, by_m)  # one token broadcast per microbatch
        assert small["embedding_bytes"] == large["embedding_bytes"] > 0, (rank, by_m)
    assert first[4]["ahead"] == first[16]["ahead"] <= 4, first  # items read ahead of the first stage's F
