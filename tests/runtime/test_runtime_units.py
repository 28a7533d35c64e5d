"""Fast checks of the runtime pieces: placement numbering, plan helpers, harness, CPU mode, CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from spawn_targets import die_without_reporting, raise_value_error, sleep_forever

from megatron_vshape.runtime import build_forward_backward_func
from megatron_vshape.runtime.placement import chunk_specs
from megatron_vshape.schedules.core.actions import Action, Kind
from megatron_vshape.schedules.core.schedule import Placement, ScheduleError
from megatron_vshape.schedules.generators.registry import get_schedule
from megatron_vshape.schedules.lowering.messages import Payload, lower
from megatron_vshape.schedules.lowering.program import deferred_backwards as _deferred_backwards
from megatron_vshape.schedules.lowering.program import forward_only_plan as _forward_only_plan
from megatron_vshape.testing import SpawnError, spawn

ROOT = Path(__file__).resolve().parents[2]


def test_v_chunk_one_is_built_as_the_looped_chunk_of_the_mirrored_rank():
    specs = chunk_specs(Placement.v_shape(4), 1)
    assert [s.stage for s in specs] == [1, 6]
    assert [(s.looped_rank, s.vp_stage) for s in specs] == [(1, 0), (2, 1)]  # stage 6 = 1*4 + 2
    first, last = chunk_specs(Placement.v_shape(4), 0)
    assert first.pre_process and not first.post_process
    assert last.post_process and not last.pre_process  # rank 0 holds embedding and loss


def test_looped_single_chunk_has_no_virtual_stage():
    (spec,) = chunk_specs(Placement.looped(4), 3)
    assert (spec.stage, spec.looped_rank, spec.vp_stage, spec.post_process) == (3, 3, None, True)


def test_forward_only_plan_keeps_forwards_and_activations():
    plan = lower(get_schedule("v-half", 4, 8))[1]
    forward = _forward_only_plan(plan)
    assert all(step.action.kind is Kind.F for step in forward.steps)
    assert len(forward.steps) == sum(step.action.kind is Kind.F for step in plan.steps)
    assert all(m.payload is Payload.ACTIVATION for msgs in forward.recv_order.values() for m in msgs)


def test_fused_schedules_never_defer_and_split_ones_do():
    one_f_one_b, v_zb = get_schedule("1f1b", 4, 8), get_schedule("v-zb", 4, 8)
    assert _deferred_backwards(one_f_one_b, lower(one_f_one_b)[0]) == set()
    deferred = _deferred_backwards(v_zb, lower(v_zb)[0])
    assert deferred and all(action.kind is Kind.B for action in deferred)


def test_a_b_whose_gradient_leaves_the_rank_is_split_even_when_its_w_follows():
    """Run as one backward, such a B would send its input gradient only after its W: W's duration later
    than the simulator assumes (V-ZB at PP 2 fuses the last stage's B+W on rank 0 and rank 1 waits)."""
    found_local_pair = found_remote_pair = False
    for name, d, m in (("v-zb", 2, 8), ("v-zb", 4, 8), ("zb-h1", 4, 8), ("v-half", 4, 8), ("zb-1p", 2, 6)):
        schedule = get_schedule(name, d, m)
        for plan in lower(schedule):
            deferred = _deferred_backwards(schedule, plan)
            for step, after in zip(plan.steps, plan.steps[1:]):
                action = step.action
                if action.kind is not Kind.B:
                    continue
                if after.action != Action(Kind.W, action.stage, action.microbatch):
                    assert action in deferred
                elif step.sends:
                    found_remote_pair = True
                    assert action in deferred, (name, d, m, action)
                else:
                    found_local_pair = True
                    assert action not in deferred, (name, d, m, action)
    assert found_remote_pair and found_local_pair


def test_unknown_schedule_is_a_one_line_error():
    with pytest.raises(ScheduleError, match="--pipeline-schedule: unknown schedule 'v-max'"):
        build_forward_backward_func("v-max")


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_harness_reports_a_rank_that_dies_without_reporting():
    with pytest.raises(SpawnError, match=r"rank\(s\) \[1\] died \(exit codes \[3\]\)"):
        spawn(die_without_reporting, 2, timeout=50)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_harness_kills_a_hung_group():
    start = time.monotonic()
    with pytest.raises(SpawnError, match="timed out"):
        spawn(sleep_forever, 2, timeout=3)  # whether or not rank 1 has started sleeping yet
    assert time.monotonic() - start < 40


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_harness_reports_a_failing_rank():
    # The ranks import torch before they raise: 30 s was not enough on a loaded 2-core machine.
    with pytest.raises(SpawnError, match="boom on"):
        spawn(raise_value_error, 2, timeout=120)


def _cpu_mode_probe(rank, world_size):
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    from megatron_vshape.megatron.cpu_mode import cpu_mode_enabled, enable_cpu_mode

    enable_cpu_mode()
    enable_cpu_mode()  # idempotent
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(123)
    tracker = get_cuda_rng_tracker()
    outside_before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(4)
    with tracker.fork():
        b = torch.rand(4)
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32

    param = torch.nn.Parameter(torch.zeros(4))
    param.grad = torch.full((4,), 3.0)
    norm = get_grad_norm_fp32([param.grad])
    clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=norm)
    return {
        "grad_norm": round(float(norm), 4), "clipped_norm": round(param.grad.norm().item(), 4),
        "enabled": cpu_mode_enabled(),
        "device": str(torch.zeros(2, device="cuda").device),
        "current_device": torch.cuda.current_device(),
        "type": torch.zeros(2).type(),
        "to": str(torch.ones(1).to(torch.cuda.current_device()).device),
        "fork_advances": not torch.equal(a, b),
        "outside_untouched": torch.equal(outside_before, torch.get_rng_state()),
        "synchronize": torch.cuda.synchronize() is None,
    }


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cpu_mode_bridges_megatron_cuda_assumptions():
    (probe,) = spawn(_cpu_mode_probe, 1, timeout=100)
    assert probe == {
        "grad_norm": 6.0, "clipped_norm": 1.0,
        "enabled": True, "device": "cpu", "current_device": 0, "type": "torch.cuda.FloatTensor", "to": "cpu",
        "fork_advances": True, "outside_untouched": True, "synchronize": True,
    }


def _run_verify(*args, timeout=200):
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    return subprocess.run([sys.executable, "-m", "megatron_vshape.verify", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_verify_cli_json():
    proc = _run_verify("--schedule", "v-zb", "--pp", "2", "--microbatches", "4", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["max_grad_rel_err"] <= 1e-6 and report["max_loss_abs_err"] <= 1e-6
    assert len(report["peak_activation_bytes"]) == 2 and min(report["peak_activation_bytes"]) > 0
    assert len(report["predicted_peak_units"]) == 2


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, flag", [
    (["--schedule", "v-half", "--pp", "4", "--layers", "12"], "--layers"),
    (["--schedule", "v-nope", "--pp", "2"], "--schedule"),
    (["--schedule", "v-half", "--pp", "2", "--sequence-parallel"], "--sequence-parallel"),
])
def test_verify_cli_rejects_bad_input_in_one_line(args, flag):
    proc = _run_verify(*args, timeout=50)
    assert proc.returncode != 0
    message = proc.stderr.strip().splitlines()
    assert len(message) == 1 and flag in message[0], proc.stderr
