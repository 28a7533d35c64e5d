"""Workers for the GPU-path models on CPU (run by ``megatron_vshape.testing.spawn``): the executor with
every backward on a new thread, a split-spec layer with Transformer Engine stand-ins, and dropout under
activation recomputation."""

from __future__ import annotations

from _wgrad_support import Case, _config, _grads, _microbatches, _reset, gpt_layer_forward, init_megatron

from megatron_vshape.testing.autograd_threads import backward_on_new_threads

# --- the executor with every backward on a new thread (as megatron.training on a GPU) ----------------


def threaded_executor_worker(rank: int, world_size: int, spec, reference_path: str, blind: bool) -> dict:
    """Run ``spec``'s schedule through the executor with ``backward_on_new_threads``.

    Counts the deferred weight-gradient GEMMs that ran (``_LinearWeightGrad.__call__``). With
    ``blind`` the split hook cannot see the capture (what the old ContextVar capture did on a
    worker thread): the executor must then raise instead of silently running the full backward in B.
    """
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    import megatron_vshape.runtime as runtime
    from megatron_vshape.megatron.cpu_mode import enable_cpu_mode
    from megatron_vshape.runtime import wgrad
    from megatron_vshape.testing import workers

    enable_cpu_mode()
    parallel_state.initialize_model_parallel(spec.tp, spec.pp)
    model_parallel_cuda_manual_seed(spec.model.seed)
    gemms = {"count": 0}
    original_call, original_build = wgrad._LinearWeightGrad.__call__, runtime.build_forward_backward_func
    executors = []

    def counting_call(self):
        gemms["count"] += 1
        return original_call(self)

    def recording_build(*args, **kwargs):
        executors.append(original_build(*args, **kwargs))
        return executors[-1]

    wgrad._LinearWeightGrad.__call__ = counting_call
    runtime.build_forward_backward_func = recording_build
    if blind:
        wgrad._current_capture = lambda: None
    row = {"pp_rank": parallel_state.get_pipeline_model_parallel_rank()}
    try:
        with backward_on_new_threads() as engine:
            row["result"] = workers.run_schedule(spec.schedules[0], spec, spec.model, torch.load(reference_path))
    except wgrad.WgradError as err:
        row["error"] = str(err)
    row["threads_used"] = engine.threads_used
    row["w_gemms"] = gemms["count"]
    counts = executors[0]._wgrad.counts() if executors else wgrad.WgradCounts()
    row["counts"] = {"deferred": counts.deferred, "run": counts.run}
    return row


# --- Transformer Engine stand-ins (no TE can be installed here) ---------------------------------------


def fake_te_classes():
    """(attention, norm) standing in for megatron's TEDotProductAttention and TENorm.

    Their classes live in ``transformer_engine`` modules, as TE's do, so ``te_wgrad`` sees TE layers;
    the maths is megatron's local attention and torch's LayerNorm (TENorm also returns a TE module from
    ``__new__``).
    """
    import torch
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class TEDotProductAttention(DotProductAttention):
        __module__ = "transformer_engine.pytorch.attention.dot_product_attention"

    class LayerNorm(torch.nn.LayerNorm):
        __module__ = "transformer_engine.pytorch.module.layernorm"

    class TENorm:
        __module__ = "megatron.core.extensions.transformer_engine"

        def __new__(cls, config, hidden_size, eps=1e-5):
            return LayerNorm(hidden_size, eps=eps)

    return TEDotProductAttention, TENorm


def split_spec_layer_worker(rank: int, world_size: int) -> dict:
    """One TransformerLayer from the split spec (fake TE attention and norms), B on a new thread via
    custom_backward inside a capture, then W: returns what was deferred and whether grads are exact."""
    init_megatron(rank, world_size, 1)
    import torch
    from megatron.core.transformer.spec_utils import build_module

    from megatron_vshape.megatron.layer_spec import split_layer_spec
    from megatron_vshape.runtime import te_wgrad
    from megatron_vshape.runtime.wgrad import WeightGradStore, enable_wgrad_split

    enable_wgrad_split()
    attention, norm = fake_te_classes()
    config = _config(1, False, Case("gpt_layer"))
    torch.manual_seed(7)
    layer = build_module(split_layer_spec(attention=attention, norm=norm), config=config, layer_number=1)
    te_wgrad.check_te_split([layer], "v-zb")  # TE attention and norms are fine: they own no weight matrix
    (x, dy), = _microbatches(rank, 1, False, False, count=1)

    x_ref = x.clone().requires_grad_()
    torch.autograd.backward(gpt_layer_forward(layer, x_ref), dy)
    ref = _grads(layer)
    _reset(layer)

    store, x_split = WeightGradStore(), x.clone().requires_grad_()
    out = gpt_layer_forward(layer, x_split)
    out.data = torch.empty((1,), dtype=out.dtype)  # megatron's deallocate_output_tensor
    from megatron.core.pipeline_parallel.schedules import custom_backward

    with backward_on_new_threads() as engine, store.capture((0, 0)):
        custom_backward(out, dy)
    deferred = store.deferred_in((0, 0))
    linear_grads_after_b = [n for n, g in _grads(layer).items() if g is not None and "linear" in n and "weight" in n]
    store.run((0, 0))
    after_w = _grads(layer)
    return {
        "te_modules": sorted({type(m).__name__ for m in layer.modules() if te_wgrad.is_te_module(m)}),
        "threads_used": engine.threads_used,
        "deferred": deferred,
        "linear_weight_grads_after_b": linear_grads_after_b,
        "input_grad_exact": bool(torch.equal(x_split.grad, x_ref.grad)),
        "differ_after_w": [n for n in ref if not torch.equal(after_w[n], ref[n])],
    }


# --- schedule-invariant dropout under activation recomputation -------------------------------------


def recompute_dropout_worker(rank: int, world_size: int) -> dict:
    """Gradients of a 2-layer GPT with dropout, with and without full activation recomputation.

    The forward runs inside ``InvariantDropout.wrap_forward_step`` and the backward after it, as in
    every schedule; ``threaded``: Megatron's custom_backward on a new thread, as on a GPU. The recomputed
    layers must redraw the forward's dropout masks, so the gradients must match. Returns the largest
    relative gradient difference per backward path.
    """
    init_megatron(rank, world_size, 1)
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel.schedules import custom_backward
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_vshape.megatron.dropout_seed import InvariantDropout, attach

    def build(recompute: bool):
        extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
        config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.3,
                                   attention_dropout=0.3, use_cpu_initialization=True, **extra)
        torch.manual_seed(11)
        return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16)

    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(16).unsqueeze(0).expand(2, 16)

    def grads(model, threaded: bool):
        model.train()
        attach([model])
        step = InvariantDropout(seed=5, iteration=0, num_microbatches=1, dp_rank=0,
                                tp_rank=0).wrap_forward_step(lambda it, m: m(tokens, positions, None, labels=tokens))
        loss = step(None, model).sum()
        torch.rand(100)  # other passes run between this F and its B: the RNG streams move on
        if threaded:
            loss = loss.view(1)
            with backward_on_new_threads():
                custom_backward(loss, torch.ones_like(loss))
        else:
            loss.backward()
        out = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        model.zero_grad()
        return out

    plain, recomputed = build(False), build(True)
    result = {}
    for threaded in (False, True):
        want, got = grads(plain, threaded), grads(recomputed, threaded)
        result["threaded" if threaded else "main_thread"] = max(
            ((got[n] - want[n]).norm() / want[n].norm()).item() for n in want)
    return result
