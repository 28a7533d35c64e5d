"""The schedule watchdog on real ranks: one rank stalls inside a pass; every rank says where it is and
the job ends within the watchdog's timeout plus a few seconds, instead of hanging until NCCL's (or
gloo's) own timeout."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from megatron_vshape.runtime.watchdog import EXIT_CODE
from megatron_vshape.testing import SpawnError, spawn

pytestmark = pytest.mark.slow  # launches processes: not in the fast tier (-m "not slow")

WATCHDOG_SECONDS = 8.0
STALLED_RANK, STALLED_CALL = 1, 3  # pipeline rank 1 sleeps in its third forward


def stalled_worker(rank, world_size, log_dir):
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_vshape.megatron.cpu_mode import enable_cpu_mode
    from megatron_vshape.runtime import build_forward_backward_func, build_model_chunks
    from megatron_vshape.runtime.watchdog import ScheduleWatchdog
    from megatron_vshape.testing import tiny_gpt

    enable_cpu_mode()
    parallel_state.initialize_model_parallel(1, world_size)
    model_parallel_cuda_manual_seed(1234)
    settings = tiny_gpt.ModelSettings()
    log = open(Path(log_dir) / f"rank{rank}.log", "w")  # noqa: SIM115 - the process ends in os._exit
    executor = build_forward_backward_func("v-half", watchdog=ScheduleWatchdog(WATCHDOG_SECONDS, grace=2.0, out=log))
    placement = executor.schedule(world_size, 8).placement
    config = tiny_gpt.make_config(settings, world_size, 1, 2, False)
    chunks = build_model_chunks(placement, rank, lambda spec, pgs: tiny_gpt.build_gpt(
        config, settings, spec.pre_process, spec.post_process, spec.vp_stage, pgs, placement.num_stages))
    calls = []

    def forward_step(data_iterator, model):
        calls.append(None)
        if rank == STALLED_RANK and len(calls) == STALLED_CALL:
            time.sleep(3600)  # the stall: a pass that never ends
        return tiny_gpt.forward_step(data_iterator, model)

    torch.distributed.barrier()
    (Path(log_dir) / f"rank{rank}.start").write_text(str(time.time()))
    executor(forward_step_func=forward_step, data_iterator=[iter(tiny_gpt._data(settings, range(8))) for _ in chunks],
             model=chunks, num_microbatches=8, seq_length=settings.seq_length,
             micro_batch_size=settings.micro_batch_size)
    return "finished"  # never reached: the stalled rank sleeps, the other waits for it


@pytest.mark.timeout(300)
def test_a_stalled_rank_is_reported_by_every_rank_and_the_job_ends(tmp_path):
    with pytest.raises(SpawnError, match=rf"died \(exit codes \[{EXIT_CODE}"):
        spawn(stalled_worker, 2, (str(tmp_path),), timeout=240)
    ended = time.time()
    started = max(float((tmp_path / f"rank{r}.start").read_text()) for r in range(2))
    assert ended - started < WATCHDOG_SECONDS + 10, ended - started
    lines = {r: (tmp_path / f"rank{r}.log").read_text().strip() for r in range(2)}
    for rank, line in lines.items():
        assert line.startswith(f"[vshape watchdog] rank {rank} (pipeline rank {rank}): schedule v-half"), line
        assert "\n" not in line
    stalled, waiting = lines[STALLED_RANK], lines[1 - STALLED_RANK]
    assert "in a pass at step" in stalled and "(F" in stalled, stalled
    # The other rank is blocked in the p2p exchange on a message from the stalled rank.
    assert "in the p2p exchange" in waiting and "from pipeline rank 1" in waiting, waiting
    assert "last finished: " in waiting and "nothing yet" not in waiting
