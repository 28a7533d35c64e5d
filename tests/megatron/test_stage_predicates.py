"""parallel_state's first/last-stage questions on a V placement, in every form user code asks them.

Megatron-LM's ``get_batch`` asks ``mpu.is_pipeline_last_stage()`` (no ``vp_stage``) while the loss
chunk runs; on a V that chunk lives on pipeline rank 0, so the rank-level answer (False) made the script
skip the labels. During a pass, every form of the question must answer for the stage being run.
"""

from __future__ import annotations

import threading

import pytest
from megatron.core import parallel_state

from megatron_vshape.megatron.model_chunks import v_stage_predicates
from megatron_vshape.runtime.active_stage import active_stage, running_stage
from megatron_vshape.schedules.core.schedule import Placement


@pytest.fixture
def v_predicates(monkeypatch):
    """Install the V predicates for a pipeline of 4; ``set_rank(r)`` picks this process's pipeline rank."""
    rank = {"value": 0}
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: rank["value"])
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: 4)
    monkeypatch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size", lambda: 2)
    # Registered with monkeypatch so that the originals come back after the test.
    monkeypatch.setattr(parallel_state, "is_pipeline_first_stage", parallel_state.is_pipeline_first_stage)
    monkeypatch.setattr(parallel_state, "is_pipeline_last_stage", parallel_state.is_pipeline_last_stage)
    v_stage_predicates()
    return lambda r: rank.update(value=r)


QUESTIONS = {
    "no arguments": {},
    "ignore_virtual=True": {"ignore_virtual": True},
    "ignore_virtual=False, no vp_stage": {"ignore_virtual": False},
}


@pytest.mark.parametrize("form", list(QUESTIONS))
def test_during_a_pass_every_form_answers_for_the_running_stage(v_predicates, form):
    d = 4
    placement = Placement.v_shape(d)
    for rank, stages in enumerate(placement.stages_per_device):
        v_predicates(rank)
        for stage in stages:
            with running_stage(stage, 2 * d):
                kwargs = QUESTIONS[form]
                assert parallel_state.is_pipeline_first_stage(**kwargs) == (stage == 0), (rank, stage)
                assert parallel_state.is_pipeline_last_stage(**kwargs) == (stage == 2 * d - 1), (rank, stage)


def test_loss_stage_on_rank_zero_is_last_without_vp_stage(v_predicates):
    """The question Megatron-LM's get_batch asks before loading labels and the loss mask."""
    v_predicates(0)
    with running_stage(7, 8):
        assert parallel_state.is_pipeline_last_stage() is True
        assert parallel_state.is_pipeline_first_stage() is False


def test_the_answer_is_seen_from_autograd_worker_threads(v_predicates):
    """On CUDA a backward runs on autograd's device thread, which sees no ContextVar of the caller."""
    v_predicates(0)
    seen = []
    with running_stage(7, 8):
        worker = threading.Thread(target=lambda: seen.append(parallel_state.is_pipeline_last_stage()))
        worker.start()
        worker.join()
    assert seen == [True]


def test_chunk_questions_and_rank_questions_between_passes(v_predicates):
    v_predicates(0)
    assert parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=1) is True
    assert parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=0) is True
    assert parallel_state.is_pipeline_last_stage() is False  # rank 0 is not the last pipeline rank
    v_predicates(3)
    assert parallel_state.is_pipeline_last_stage() is True  # where megatron's loop reads the losses
    assert parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=1) is False


def test_running_stage_refuses_a_second_pass_and_clears_after_errors():
    with running_stage(0, 4):
        with pytest.raises(RuntimeError, match="one pipeline pass at a time"):
            with running_stage(1, 4):
                pass
    with pytest.raises(ValueError):
        with running_stage(2, 4):
            raise ValueError("a failed pass")
    assert active_stage() is None
