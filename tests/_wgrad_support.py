"""Helpers for tests/test_wgrad.py: megatron models built on CPU and the per-rank workers that
``megatron_vshape.testing.spawn`` runs (it owns the process group, timeouts and cleanup).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def init_megatron(rank: int, world_size: int, tp: int) -> None:
    """Megatron parallel_state in CPU mode, on the gloo group ``testing.spawn`` started."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_vshape.megatron.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(1234)


def shard_sequence(tensor, rank: int, tp: int, sequence_parallel: bool):
    """This rank's slice of a [s, b, h] tensor under sequence parallelism, else the whole tensor."""
    if not sequence_parallel:
        return tensor.clone()
    return tensor.chunk(tp, dim=0)[rank].clone()


# --- models ----------------------------------------------------------------------------------


class ColumnRowMlp:
    """Megatron's tensor-parallel MLP shape: ColumnParallelLinear -> gelu -> RowParallelLinear."""

    def __new__(cls, config, hidden: int, bias: bool):
        import torch
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        init = torch.nn.init.xavier_normal_
        module = torch.nn.Module()
        module.fc1 = ColumnParallelLinear(
            hidden, 4 * hidden, config=config, init_method=init, bias=bias, gather_output=False
        )
        module.fc2 = RowParallelLinear(
            4 * hidden, hidden, config=config, init_method=init, bias=bias, input_is_parallel=True,
            skip_bias_add=False,
        )
        return module


def mlp_forward(module, x):
    import torch

    inner = module.module if hasattr(module, "module") else module
    hidden, _ = inner.fc1(x)
    out, _ = inner.fc2(torch.nn.functional.gelu(hidden))
    return out


def gpt_layer(config):
    """One megatron TransformerLayer from the local (non-TE) GPT spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    return build_module(get_gpt_layer_local_spec(), config=config, layer_number=1)


def gpt_layer_forward(layer, x):
    inner = layer.module if hasattr(layer, "module") else layer
    out = inner(x, attention_mask=None)
    return out[0] if isinstance(out, tuple) else out


def wrap_ddp(module, config):
    """Megatron DDP (no overlap): main_grad buffers and the per-parameter accumulation hooks."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=False)
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)


# --- the equivalence check run on every rank -------------------------------------------------

HIDDEN, SEQ, BATCH = 32, 8, 2


@dataclass(frozen=True)
class Case:
    """One model configuration compared between the plain backward and B-then-W."""

    model: str = "mlp"  # "mlp" (Column -> Row) or "gpt_layer" (local-spec TransformerLayer)
    bias: bool = True
    ddp: bool = False  # megatron DDP: gradients accumulate into main_grad through its hooks
    fusion: bool = False  # gradient_accumulation_fusion on for the split run (needs ddp)
    bf16: bool = False  # bf16 parameters and activations (with ddp: fp32 main_grad, as on GPUs)

    def __str__(self) -> str:
        return f"{self.model}(bias={self.bias}, ddp={self.ddp}, fusion={self.fusion}, bf16={self.bf16})"


def equivalence_worker(rank: int, world_size: int, tp: int, sp: bool, cases: list[Case]) -> list[str]:
    """On every rank: for each case, plain backward vs capture+run must give bitwise-equal grads."""
    init_megatron(rank, world_size, tp)
    from megatron_vshape.runtime.wgrad import enable_wgrad_split

    enable_wgrad_split()
    checked = []
    for case in cases:
        try:
            _check_case(rank, tp, sp, case)
        except AssertionError as err:
            raise AssertionError(f"{case}, tp={tp}, sp={sp}: {err}") from err
        checked.append(str(case))
    return checked


def _config(tp: int, sp: bool, case: Case):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, tensor_model_parallel_size=tp,
        sequence_parallel=sp, use_cpu_initialization=True, add_bias_linear=case.bias,
        params_dtype=torch.bfloat16 if case.bf16 else torch.float32, bf16=case.bf16,
        hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False,
    )


def _build(case: Case, config):
    import torch

    torch.manual_seed(7)  # CPU initialisation draws the full master weight: identical on all ranks
    if case.model == "mlp":
        return ColumnRowMlp(config, HIDDEN, case.bias), mlp_forward
    return gpt_layer(config), gpt_layer_forward


def _microbatches(rank: int, tp: int, sp: bool, bf16: bool, count: int = 2):
    import torch

    gen = torch.Generator().manual_seed(99)
    batches = []
    for _ in range(count):
        dtype = torch.bfloat16 if bf16 else torch.float32
        x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).to(dtype)
        dy = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).to(dtype)
        batches.append((shard_sequence(x, rank, tp, sp), shard_sequence(dy, rank, tp, sp)))
    return batches


def _linear_weights(model) -> set[int]:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    return {id(m.weight) for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}


def _grads(model) -> dict[str, Any]:
    out = {}
    for name, param in model.named_parameters():
        grad = param.main_grad if hasattr(param, "main_grad") else param.grad
        out[name] = None if grad is None else grad.detach().clone()
    return out


def _reset(model) -> None:
    if hasattr(model, "zero_grad_buffer"):
        model.zero_grad_buffer()
    for param in model.parameters():
        param.grad = None


def _forward_inputs(model, forward, batches):
    inputs, outputs = [], []
    for x, _ in batches:
        x = x.clone().requires_grad_()
        inputs.append(x)
        outputs.append(forward(model, x))
    return inputs, outputs


def _check_case(rank: int, tp: int, sp: bool, case: Case) -> None:
    import torch

    from megatron_vshape.runtime.wgrad import WeightGradStore

    config = _config(tp, sp, case)
    model, forward = _build(case, config)
    if case.ddp:
        model = wrap_ddp(model, config)
    batches = _microbatches(rank, tp, sp, case.bf16)
    deferred = _linear_weights(model)

    # Reference: Megatron's own backward, gradients accumulated over two microbatches.
    inputs, outputs = _forward_inputs(model, forward, batches)
    for out, (_, dy) in zip(outputs, batches):
        torch.autograd.backward(out, dy)
    ref_inputs, ref = [x.grad for x in inputs], _grads(model)
    names = [n for n, p in model.named_parameters() if id(p) in deferred]
    assert names and all(ref[n] is not None and ref[n].abs().sum() > 0 for n in names), "reference has no weight grads"
    _reset(model)
    if case.fusion:
        for module in model.modules():
            if hasattr(module, "gradient_accumulation_fusion"):
                module.gradient_accumulation_fusion = True

    # Split: B of both microbatches inside captures, then W in the reverse order.
    store = WeightGradStore()
    inputs, outputs = _forward_inputs(model, forward, batches)
    for mb, (out, (_, dy)) in enumerate(zip(outputs, batches)):
        with store.capture((0, mb)):
            torch.autograd.backward(out, dy)
    assert store.pending() == [(0, 0), (0, 1)], f"pending after B: {store.pending()}"
    for x, ref_x in zip(inputs, ref_inputs):
        assert torch.equal(x.grad, ref_x), "input grad after B differs from Megatron's"
    _assert_after_b(model, ref, deferred)
    store.run((0, 1))
    store.run((0, 0))
    assert store.pending() == [], f"pending after W: {store.pending()}"
    after_w = _grads(model)
    bad = [n for n in ref if not torch.equal(after_w[n], ref[n])]
    assert not bad, f"grads after W differ from Megatron's: {bad}"


def _assert_after_b(model, ref, deferred: set[int]) -> None:
    """After B only: linear weights untouched (None / zero main_grad); every other grad complete."""
    import torch

    grads = _grads(model)
    for name, param in model.named_parameters():
        if id(param) in deferred:
            untouched = grads[name] is None or not grads[name].any()
            assert untouched, f"B touched the weight grad of {name}"
        else:
            assert torch.equal(grads[name], ref[name]), f"grad of {name} (kept in B) differs after B"


# --- a whole schedule, all stages in one process -----------------------------------------------


def schedule_worker(rank: int, world_size: int, names: list[str], devices: int, microbatches: int) -> dict:
    """Run each schedule's F/B/W actions, all stages in this process, against plain backward.

    Actions run in the order of their simulated start times (a valid order for every dependency);
    stage s+1's input is stage s's output detached, as between pipeline ranks. Returns, per
    schedule, the largest number of (stage, microbatch) keys whose W was pending at once.
    """
    init_megatron(rank, world_size, 1)
    from megatron_vshape.runtime.wgrad import enable_wgrad_split

    enable_wgrad_split()
    return {name: _run_schedule(name, devices, microbatches) for name in names}


def _run_schedule(name: str, devices: int, microbatches: int) -> int:
    import torch

    from megatron_vshape.runtime.wgrad import WeightGradStore
    from megatron_vshape.schedules.core.actions import Kind
    from megatron_vshape.schedules.core.schedule import Costs
    from megatron_vshape.schedules.core.simulator import simulate
    from megatron_vshape.schedules.generators.registry import get_schedule

    costs = Costs(f=1, b=1, w=1, comm=0)
    schedule = get_schedule(name, num_devices=devices, num_microbatches=microbatches, costs=costs)
    timeline = simulate(schedule, costs).timeline
    order = sorted(timeline, key=lambda a: (timeline[a].start, timeline[a].device))
    config = _config(1, False, Case())
    torch.manual_seed(3)
    stages = [ColumnRowMlp(config, HIDDEN, bias=True) for _ in range(schedule.num_stages)]
    batches = _microbatches(0, 1, False, False, count=microbatches)

    ref_inputs = []  # reference: each microbatch through all stages, one plain backward
    for x, dy in batches:
        x = x.clone().requires_grad_()
        out = x
        for stage in stages:
            out = mlp_forward(stage, out)
        torch.autograd.backward(out, dy)
        ref_inputs.append(x.grad)
    ref = [_grads(stage) for stage in stages]
    for stage in stages:
        _reset(stage)

    store, inputs, outputs, most_pending = WeightGradStore(), {}, {}, 0
    for action in order:
        s, mb = action.stage, action.microbatch
        if action.kind is Kind.F:
            source = batches[mb][0] if s == 0 else outputs[s - 1, mb]
            inputs[s, mb] = source.detach().clone().requires_grad_()
            outputs[s, mb] = mlp_forward(stages[s], inputs[s, mb])
        elif action.kind is Kind.B:
            grad = batches[mb][1] if s == len(stages) - 1 else inputs[s + 1, mb].grad
            with store.capture((s, mb)):
                torch.autograd.backward(outputs[s, mb], grad)
        else:
            most_pending = max(most_pending, len(store.pending()))
            store.run((s, mb))
    assert store.pending() == [], f"{name}: W never ran for {store.pending()}"
    for mb, ref_x in enumerate(ref_inputs):
        assert torch.equal(inputs[0, mb].grad, ref_x), f"{name}: input grad of microbatch {mb} differs"
    for s, stage in enumerate(stages):
        got = _grads(stage)
        bad = [n for n in got if not torch.equal(got[n], ref[s][n])]
        assert not bad, f"{name}: stage {s} grads differ from plain backward: {bad}"
    return most_pending
