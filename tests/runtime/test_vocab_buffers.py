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
    import torch
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_vshape.megatron.cpu_mode import enable_cpu_mode
    from megatron_vshape.megatron.vocab_surgery import install_vocab_parallel
    from megatron_vshape.runtime import build_forward_backward_func, build_model_chunks, comm_queue
    from megatron_vshape.schedules.core.schedule import Costs, VocabWork
    from megatron_vshape.testing.tiny_gpt import ModelSettings, build_gpt, forward_step, make_config, microbatch

    torch.set_num_threads(1)
    enable_cpu_mode()
    parallel_state.initialize_model_parallel(1, world_size)
    model = ModelSettings(num_layers=4, hidden_size=32, seq_length=16, vocab_size=64)
    model_parallel_cuda_manual_seed(model.seed)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    func = build_forward_backward_func(schedule, costs=Costs(vocab=VocabWork(1.0, 1.0, 1.0, 0.5)))
    placement = func.schedule(world_size, 4).placement
    vp = None if placement.chunks_per_device == 1 else placement.chunks_per_device
    config = make_config(model, world_size, 1, vp, False)
    chunks = build_model_chunks(placement, pp_rank, lambda cs, pgs: build_gpt(
        config, model, cs.pre_process, cs.post_process, cs.vp_stage, pgs, placement.num_stages))
    install_vocab_parallel(chunks, placement)
    ddp = [DistributedDataParallel(config, DistributedDataParallelConfig(), c) for c in chunks]

    token_bytes = []  # every integer tensor posted on the vocabulary queue: the tokens
    post = comm_queue.CommQueue.post

    def recording_post(self, issue, tensors=()):
        token_bytes.extend(t.nbytes for t in tensors if not t.is_floating_point())
        return post(self, issue, tensors)

    comm_queue.CommQueue.post = recording_post

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
    for m in counts:
        data = [dict(microbatch(model, i), index=i) for i in range(m)]
        iterators = [Counting(data) for _ in ddp]

        def step(data_iterator, module, iterators=iterators):
            for it in iterators:
                if it is data_iterator.source if hasattr(data_iterator, "source") else it is data_iterator:
                    it.used += 1
            return forward_step(data_iterator, module)

        token_bytes.clear()
        func(forward_step_func=step, data_iterator=iterators if len(ddp) > 1 else iterators[0],
             model=ddp if len(ddp) > 1 else ddp[0], num_microbatches=m, seq_length=model.seq_length,
             micro_batch_size=model.micro_batch_size)
        embedding_bytes = func.last_vocab_bytes[1] if hasattr(func, "last_vocab_bytes") else None
        out[m] = {"token_bytes": max(token_bytes, default=0), "posted": len(token_bytes),
                  "ahead": iterators[0].ahead, "embedding_bytes": embedding_bytes}
    comm_queue.CommQueue.post = post
    parallel_state.destroy_model_parallel()
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
