"""Transformer Engine and split schedules: the split layer spec, TE's own deferral, and refusals.

No TE can be installed here (a partial transformer-engine package breaks ``import megatron.core``), so
TE's Python API is stood in for in-process only, as far as the wiring needs: megatron's TE module's
``HAVE_TE`` / ``TEDotProductAttention`` / ``TENorm`` attributes (monkeypatched, restored after each test)
and layer classes that live in ``transformer_engine`` modules (``_wgrad_support.fake_te_classes``).
What this proves: the spec the glue picks has megatron's linears (split, exact) with TE's attention and
norm classes in place, and TE linears are refused. What it cannot prove: TE's own kernels on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types

import pytest
import torch
from _gpu_path_workers import fake_te_classes, split_spec_layer_worker

from megatron_vshape.megatron import layer_spec
from megatron_vshape.runtime import te_wgrad
from megatron_vshape.runtime.wgrad import WgradError
from megatron_vshape.testing import spawn


def _classes_in(node, seen=None) -> set[type]:
    """Every class a ModuleSpec tree names (through submodule dataclasses and builder partials)."""
    seen = set() if seen is None else seen
    if isinstance(node, type):
        seen.add(node)
    elif dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            _classes_in(getattr(node, f.name), seen)
    elif isinstance(node, functools.partial):
        for item in (node.func, *node.args, *node.keywords.values()):
            _classes_in(item, seen)
    return seen


@pytest.mark.parametrize("options", [{}, {"num_experts": 2, "qk_layernorm": True, "normalization": "RMSNorm"}])
def test_split_spec_has_megatron_linears_and_te_attention_and_norms(options):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    attention, norm = fake_te_classes()
    spec = layer_spec.split_layer_spec(attention=attention, norm=norm, **options)
    classes = _classes_in(spec)
    assert {attention, norm, ColumnParallelLinear, RowParallelLinear} <= classes
    assert not classes & {DotProductAttention, WrappedTorchNorm}, "unfused attention or torch norms left"
    te_like = {c for c in classes if c.__module__.startswith(("transformer_engine", "megatron.core.extensions"))}
    assert te_like == {attention, norm}, "TE may provide attention and norms only, never a linear layer"
    sub = spec.submodules
    assert sub.input_layernorm is norm and sub.self_attention.submodules.core_attention is attention


def test_split_spec_takes_megatrons_te_classes_and_refuses_without_te(monkeypatch):
    from megatron.core.extensions import transformer_engine as te_ext

    attention, norm = fake_te_classes()
    monkeypatch.setattr(te_ext, "HAVE_TE", True)
    monkeypatch.setattr(te_ext, "TEDotProductAttention", attention)
    monkeypatch.setattr(te_ext, "TENorm", norm)
    spec = layer_spec.split_layer_spec()
    assert spec.submodules.self_attention.submodules.core_attention is attention
    monkeypatch.setattr(te_ext, "HAVE_TE", False)
    with pytest.raises(layer_spec.SplitSpecError, match="use --transformer-impl local"):
        layer_spec.split_layer_spec()


def test_megatrons_spec_import_resolves_the_split_spec_from_the_training_args(monkeypatch):
    """What ``--spec`` (set by resolve_defaults) does in megatron.training: import_module(args.spec)."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.transformer.spec_utils import ModuleSpec, import_module

    attention, norm = fake_te_classes()
    monkeypatch.setattr(te_ext, "HAVE_TE", True)
    monkeypatch.setattr(te_ext, "TEDotProductAttention", attention)
    monkeypatch.setattr(te_ext, "TENorm", norm)
    args = types.SimpleNamespace(num_experts=None, moe_grouped_gemm=False, qk_layernorm=True,
                                 multi_latent_attention=False, qk_l2_norm=False, normalization="LayerNorm")
    training = sys.modules.get("megatron.training") or types.ModuleType("megatron.training")
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setattr(training, "get_args", lambda: args, raising=False)
    monkeypatch.setattr(layer_spec, "gpt_split_layer_spec", layer_spec._SpecFromTrainingArgs())  # unbuilt
    spec = import_module(layer_spec.SPEC_ARG)
    assert isinstance(spec, ModuleSpec)  # Megatron-LM's builders pass it to GPTModel as the layer spec
    assert spec.submodules.self_attention.submodules.q_layernorm is norm
    assert spec.submodules.self_attention.submodules.core_attention is attention


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_layer_from_the_split_spec_splits_exactly_with_te_attention_in_place():
    (row,) = spawn(split_spec_layer_worker, 1, (), timeout=100)
    assert row["te_modules"] == ["LayerNorm", "TEDotProductAttention"], row
    assert row["threads_used"] == 1, row
    assert row["deferred"] == 4, f"qkv, proj, fc1 and fc2 must each defer their weight gradient: {row}"
    assert row["linear_weight_grads_after_b"] == [], row
    assert row["input_grad_exact"] and row["differ_after_w"] == [], row


class _TELinear(torch.nn.Module):
    __module__ = "transformer_engine.pytorch.module.layernorm_linear"

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4, 4))
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(4))


def test_te_linears_in_a_split_schedule_are_refused_naming_the_alternative():
    attention, _ = fake_te_classes()
    chunk = torch.nn.Sequential(torch.nn.Linear(4, 4), _TELinear())
    with pytest.raises(WgradError, match=r"v-half splits B and W.*\(_TELinear\).*without delay_wgrad_compute.*"
                                         r"drop --spec.*--transformer-impl local"):
        te_wgrad.check_te_split([chunk], "v-half")
    assert te_wgrad.te_linear_names([torch.nn.Linear(4, 4)]) == []


class _MegatronWrapper(_TELinear):
    """What megatron's TE wrappers are: a class of megatron's own module subclassing a TE layer."""

    __module__ = "megatron.core.extensions.transformer_engine"


def test_te_layers_are_recognised_through_their_base_classes():
    """Every real TE layer of a megatron model is a megatron wrapper: recognition by the module's own class
    alone would miss them all (and let their weight gradients run in B unnoticed)."""
    wrapper = _MegatronWrapper()
    assert te_wgrad.is_te_linear(wrapper)
    with pytest.raises(WgradError, match=r"\(_MegatronWrapper\)"):
        te_wgrad.check_te_split([torch.nn.Sequential(wrapper)], "v-zb")


class _Queue:
    """TE's per-module deferral contract, in two lines: put in backward, backward_dw pops the oldest."""

    def __init__(self):
        self.entries, self.popped = [], []

    def delay_wgrad_compute(self):
        return True


class _DeferringTELinear(_MegatronWrapper):
    def __init__(self):
        super().__init__()
        self.wgrad_store = _Queue()

    def backward_dw(self):  # found on the TE base in a real run; here the wrapper's own
        self.wgrad_store.popped.append(self.wgrad_store.entries.pop(0))


class _Store:
    def __init__(self):
        self.tasks = []

    def defer(self, task):
        self.tasks.append(task)


def test_deferring_te_linears_are_accepted_and_a_w_out_of_b_order_is_refused():
    layer = _DeferringTELinear()
    chunk = torch.nn.Sequential(layer)
    te_wgrad.check_te_split([chunk], "v-zb")  # defers W itself: no refusal
    store = _Store()
    for mb in (0, 1):  # two B passes: TE queued mb 0's entry, then mb 1's
        layer.wgrad_store.entries.append(mb)
        assert te_wgrad.defer_te_wgrads(store, (0, mb), chunk) == 1
    first, second = store.tasks
    assert first.weight is layer.weight  # the store's gradient-ready tracking reads task.weight
    with pytest.raises(WgradError, match=r"W of \(0, 1\) would pop \(0, 0\)'s weight gradient.*out of B order"):
        second()
    first()
    second()
    assert layer.wgrad_store.popped == [0, 1]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_split_schedule_defers_w_through_te_backward_dw_with_the_te_standin_also_under_cp(mc19_python):
    """megatron's own TE wrappers over the TE stand-in (TE 2.8's contract), the TE split spec, v-half on two
    pipeline ranks: W runs through backward_dw(), gradients equal a fused one-process run's, the deferred
    counts (the [vshape] line's) are > 0 on every rank. Then the same with context parallelism 2 (4 ranks):
    megatron's CP slicing on the V's first and last stage (both on pipeline rank 0), seq/CP p2p messages,
    the loss averaged over the CP group's tokens."""
    import json
    import subprocess

    from megatron_vshape.testing.te_standin_check import environment

    result = subprocess.run([mc19_python, "-m", "megatron_vshape.testing.te_standin_check", "--cp", "1,2", "v-half"],
                            env=environment(), capture_output=True, text=True, timeout=380)
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("RESULT")]
    assert lines, result.stderr[-4000:]
    by_cp = json.loads(lines[0][len("RESULT"):])
    for cp, tolerance in (("1", 0.0), ("2", 1e-5)):  # CP sums the attention in another order: fp32 rounding
        rows = by_cp[cp]
        assert sorted(r["pp_rank"] for r in rows) == sorted([0, 1] * int(cp)), cp
        for row in rows:
            got = row["results"]["v-half"]
            assert got["max_grad_rel_err"] <= tolerance and got["max_loss_abs_err"] <= 1e-6, (cp, row)
            assert got["wgrad_deferred"] > 0 and got["wgrad_run"] == got["wgrad_deferred"], (cp, row)
            # 2 layers per V chunk, 2 chunks, 4 microbatches: qkv+fc1 (LayerNorm+Linear) and proj+fc2 (Linear)
            assert row["backward_dw_calls"] == {"DeferringTELayerNormColumnParallelLinear": 2 * 2 * 2 * 4,
                                                "DeferringTERowParallelLinear": 2 * 2 * 2 * 4}, (cp, row)
            # the V's first and last stage are on pipeline rank 0: its ranks (one per CP rank) report every loss
            assert got["num_losses"] == (4 if row["pp_rank"] == 0 else 0), (cp, row)
