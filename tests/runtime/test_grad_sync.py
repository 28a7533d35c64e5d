"""When the executor launches each DDP bucket group under a split backward (runtime/grad_sync.py), in-process.

The gradient-exact multi-process check is ``test_executor_exact.py::
test_dp2_overlapped_grad_reduce_launches_each_bucket_after_its_last_w``; this one pins the rule pass by
pass on stand-ins for Megatron's DDP and the weight-gradient store.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_vshape.runtime.grad_sync import BucketLauncher
from megatron_vshape.runtime.wgrad import WeightGradStore
from megatron_vshape.schedules.core.actions import Action, Kind


class _Group:
    def __init__(self, name, params, log):
        self.name, self.params, self.log = name, params, log

    def start_grad_sync(self):
        self.log.append(self.name)


class _Task:
    """A W task that adds to one weight (what the store counts)."""

    def __init__(self, weight, log):
        self.weight, self.log = weight, log

    def __call__(self):
        self.log.append(f"W task {self.weight.label}")


def _param(label):
    param = torch.nn.Parameter(torch.zeros(1))
    param.label = label
    return param


def _setup(overlap=True):
    log = []
    norm, w1, w2 = _param("norm"), _param("w1"), _param("w2")
    groups = [_Group("bucket[norm]", [norm], log), _Group("bucket[w1,w2]", [w1, w2], log)]
    config = SimpleNamespace(overlap_grad_reduce=overlap)
    model = SimpleNamespace(ddp_config=config, bucket_groups=groups, expert_parallel_bucket_groups=[])
    actions = [Action(Kind.F, 0, 0), Action(Kind.F, 0, 1), Action(Kind.B, 0, 0), Action(Kind.B, 0, 1),
               Action(Kind.W, 0, 0), Action(Kind.W, 0, 1)]
    plan = SimpleNamespace(steps=[SimpleNamespace(action=a) for a in actions])
    return log, (norm, w1, w2), config, model, plan


def test_buckets_launch_at_the_last_b_or_the_last_w_task_of_their_weights():
    log, (norm, w1, w2), config, model, plan = _setup()
    store = WeightGradStore()
    launcher = BucketLauncher([model], plan, lambda stage: 0, split=True, store_of=lambda: store)
    for index, step in enumerate(plan.steps):
        action = step.action
        if action.kind is Kind.B:
            store._tasks[(0, action.microbatch)] = []
            with launcher.deferred_b(True):
                assert config.overlap_grad_reduce is False  # Megatron's hook: no assertion on the missing grad
                for weight in (w1, w2):
                    store._push((0, action.microbatch), _Task(weight, log))
            assert config.overlap_grad_reduce is True
        elif action.kind is Kind.W:
            log.append(f"W{action.microbatch}")
            store.run((0, action.microbatch), launcher.weight_done(0))
        launcher.after_pass(index, action.stage, action.kind)
        log.append(f"after {action.kind.value}{action.microbatch}")
    launcher.launch_rest(0)  # the executor's end-of-chunk call: nothing left to launch
    assert log == ["after F0", "after F1", "after B0", "bucket[norm]", "after B1",
                   "W0", "W task w1", "W task w2", "after W0",
                   "W1", "W task w1", "W task w2", "bucket[w1,w2]", "after W1"]
    assert [group.name for _, group in launcher.launches] == ["bucket[norm]", "bucket[w1,w2]"]


def test_without_overlap_or_split_nothing_is_launched_or_silenced():
    for overlap, split in ((False, True), (True, False)):
        log, _params, config, model, plan = _setup(overlap)
        launcher = BucketLauncher([model], plan, lambda stage: 0, split=split, store_of=WeightGradStore)
        with launcher.deferred_b(True):
            assert config.overlap_grad_reduce is overlap
        launcher.after_pass(3, 0, Kind.B)
        assert not launcher.launch_rest(0) and log == []
