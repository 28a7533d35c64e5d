"""The GPT layer spec split schedules get on GPU: megatron's splittable linears, TE's attention and norms.

A split schedule (zb-*, v-*) defers weight gradients by hooking megatron-core's own linear layers
(:mod:`megatron_vshape.runtime.wgrad`); Transformer Engine's linears bypass that hook, and TE's own
deferral is tied to megatron's MoE overlap schedule (see :mod:`megatron_vshape.runtime.te_wgrad`).
Megatron's local spec splits but has unfused attention, whose scores alone are tens of GB per layer
at long sequences. The split spec takes the best of both:

* every GEMM is megatron-core's ``ColumnParallelLinear`` / ``RowParallelLinear`` (the local spec's),
  so B defers its weight gradient to W (gradient accumulation fusion needs apex's
  ``fused_weight_gradient_mlp_cuda``, as with the local spec on GPU);
* core attention is ``TEDotProductAttention`` (TE's flash / fused attention backends);
* layer norms (and the q/k norms) are ``TENorm``.

It is the local spec with exactly those classes replaced, so MoE, MLA and RMSNorm options follow the
local spec. Checkpoints use the local spec's parameter names (norms are separate modules, not fused
into the next linear as in the TE spec).

:func:`megatron_vshape.megatron.arguments.resolve_defaults` selects it for split schedules with
``--transformer-impl transformer_engine`` (megatron's GPU default) by setting Megatron's own
``--spec`` to :data:`SPEC_ARG`, which megatron.training's GPT builders (and ``scripts/pretrain_gpt.py``)
read with ``import_module(args.spec)``: the attribute ``gpt_split_layer_spec`` of this module is the
spec built from megatron.training's arguments (on first use).
"""

from __future__ import annotations

import copy
import dataclasses
import functools

from megatron.core.transformer.spec_utils import ModuleSpec

from .flags import SPLIT_SPEC_ARG

SPEC_ARG = SPLIT_SPEC_ARG  # Megatron's --spec naming this module's gpt_split_layer_spec


class SplitSpecError(RuntimeError):
    """The split spec cannot be built here (no Transformer Engine)."""


def te_classes() -> tuple[type, type]:
    """megatron-core's TE wrappers (attention, norm); refuses when TE is not installed."""
    from megatron.core.extensions import transformer_engine as te_ext

    if not te_ext.HAVE_TE:
        raise SplitSpecError(
            "the split layer spec needs Transformer Engine for fused attention (not installed): "
            "use --transformer-impl local"
        )
    return te_ext.TEDotProductAttention, te_ext.TENorm


def _replacements(attention: type, norm: type) -> dict[type, type]:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    table = {DotProductAttention: attention, WrappedTorchNorm: norm}
    try:
        from megatron.core.fusions.fused_layer_norm import FusedLayerNorm  # apex's, when the local spec picked it
    except ImportError:
        return table
    table[FusedLayerNorm] = norm
    return table


def _replace(node, table: dict[type, type]):
    """``node`` with every class in ``table`` swapped, recursing through specs and submodule dataclasses."""
    if isinstance(node, type):
        return table.get(node, node)
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            object.__setattr__(node, f.name, _replace(getattr(node, f.name), table))  # a private deep copy
        return node
    if isinstance(node, list):
        return [_replace(item, table) for item in node]
    if isinstance(node, functools.partial):  # 0.19 builders: partial(MLP.as_mlp_submodule, submodules=...)
        args = [_replace(a, table) for a in node.args]
        return functools.partial(node.func, *args, **{k: _replace(v, table) for k, v in node.keywords.items()})
    return node


def with_te_attention_and_norms(local_spec, attention: type | None = None, norm: type | None = None):
    """A copy of a local-spec ``ModuleSpec`` with TE attention and norms (classes default to TE's)."""
    if attention is None or norm is None:
        attention, norm = te_classes()
    return _replace(copy.deepcopy(local_spec), _replacements(attention, norm))


def split_layer_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False, multi_latent_attention=False,
                     qk_l2_norm=False, normalization=None, attention: type | None = None, norm: type | None = None):
    """The split spec for these GPT options (the local spec's keyword arguments)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    local = get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, qk_layernorm=qk_layernorm,
        multi_latent_attention=multi_latent_attention, normalization=normalization, qk_l2_norm=qk_l2_norm,
    )
    return with_te_attention_and_norms(local, attention, norm)


def split_layer_spec_from_args(args):
    """The split spec for megatron.training's parsed arguments."""
    return split_layer_spec(
        num_experts=getattr(args, "num_experts", None), moe_grouped_gemm=getattr(args, "moe_grouped_gemm", False),
        qk_layernorm=getattr(args, "qk_layernorm", False),
        multi_latent_attention=getattr(args, "multi_latent_attention", False),
        qk_l2_norm=getattr(args, "qk_l2_norm", False), normalization=getattr(args, "normalization", None),
    )


class SpecFromTrainingArgs(ModuleSpec):
    """A spec for megatron.training's arguments, built on first use (they are parsed by then).

    Megatron's ``import_module(args.spec)`` reads a module attribute (``vars(module)[name]``) and
    Megatron-LM's builders pass it to GPTModel as the layer ModuleSpec itself, so the attribute must be
    a ModuleSpec that exists at import time, before the arguments are known: its fields are filled
    from ``build(args)`` (default :func:`split_layer_spec_from_args`) the first time one is read.
    """

    def __init__(self, build=None) -> None:  # no fields yet: they are filled on first access
        object.__setattr__(self, "_build", build or split_layer_spec_from_args)

    def __getattribute__(self, name: str):
        # ModuleSpec's fields have class-level defaults, so __getattr__ would never see them.
        if name in _SPEC_FIELDS and name not in object.__getattribute__(self, "__dict__"):
            from megatron.training import get_args

            built = object.__getattribute__(self, "_build")(get_args())
            for field_name in _SPEC_FIELDS:
                object.__setattr__(self, field_name, getattr(built, field_name))
        return object.__getattribute__(self, name)


_SPEC_FIELDS = frozenset(f.name for f in dataclasses.fields(ModuleSpec))
_SpecFromTrainingArgs = SpecFromTrainingArgs  # the name tests/test_te_wiring.py uses
gpt_split_layer_spec = SpecFromTrainingArgs()


# --- the TE split spec: Transformer Engine's own linears, with TE's deferred weight gradient -------------
#
# With TE >= 2.3 a split schedule keeps TE's linears (FP8/FP4, fused LayerNorm+Linear, grouped GEMM,
# userbuffer TP overlap) and defers W through TE itself: each linear is built with
# ``delay_wgrad_compute=True`` and the W pass calls its ``backward_dw()`` (runtime/te_wgrad.py).
# Megatron passes that keyword to TE only when ``config.delay_wgrad_compute`` is set, which its
# TransformerConfig refuses without its MoE overlap schedule, and its wrappers' ``backward_dw()`` is a
# no-op without it. So the config is left alone: each wrapper class gets a subclass whose MRO puts a
# small TE subclass between megatron's wrapper and TE's module. Megatron's ``__init__`` runs unchanged
# and its ``super().__init__(...)`` reaches the insert, which adds the keyword; the executor's W calls
# TE's ``backward_dw`` directly.

TE_WRAPPERS = ("TELinear", "TEColumnParallelLinear", "TERowParallelLinear", "TELayerNormColumnParallelLinear",
               "TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear")


def te_module_base(wrapper: type) -> type:
    """The Transformer Engine class a megatron wrapper subclasses (first TE class in its MRO)."""
    for cls in wrapper.__mro__:
        if cls.__module__.startswith("transformer_engine"):
            return cls
    raise SplitSpecError(f"{wrapper.__name__} does not subclass a Transformer Engine module")


@functools.cache
def deferring(wrapper: type) -> type:
    """``wrapper`` (a megatron TE linear) building its TE module with ``delay_wgrad_compute=True``."""
    base = te_module_base(wrapper)

    def __init__(self, *args, **kwargs):  # noqa: N807 - the TE module's constructor, one keyword added
        kwargs["delay_wgrad_compute"] = True
        base.__init__(self, *args, **kwargs)

    insert = type(f"Deferred{base.__name__}", (base,), {"__init__": __init__, "__module__": __name__})
    # backward_dw() stays megatron's (a no-op without its config flag), so no megatron code path pops TE's
    # queue behind the executor's back; the W pass calls TE's own (runtime/te_wgrad.py).
    return type(f"Deferring{wrapper.__name__}", (wrapper, insert),
                {"__module__": __name__,
                 "__doc__": f"megatron's {wrapper.__name__}; TE defers its weight gradient to TE's backward_dw()."})


def _deferring_table() -> dict[type, type]:
    from megatron.core.extensions import transformer_engine as te_ext

    if not te_ext.HAVE_TE:
        raise SplitSpecError("the TE split spec needs Transformer Engine >= 2.3 (not installed): "
                             "use --transformer-impl local")
    wrappers = (getattr(te_ext, name, None) for name in TE_WRAPPERS)
    return {w: deferring(w) for w in wrappers if isinstance(w, type)}


def te_deferral_available() -> bool:
    """Transformer Engine >= 2.3 is importable (megatron's own check): TE's linears can defer W."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.utils import is_te_min_version

    return bool(te_ext.HAVE_TE) and is_te_min_version("2.3.0")


def te_split_layer_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False, multi_latent_attention=False,
                        qk_l2_norm=False, **te_spec_kwargs):
    """megatron's TE layer spec with every TE linear deferring its weight gradient (see above)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    spec = get_gpt_layer_with_transformer_engine_spec(num_experts, moe_grouped_gemm, qk_layernorm,
                                                      multi_latent_attention, qk_l2_norm=qk_l2_norm, **te_spec_kwargs)
    return _replace(spec, _deferring_table())


def te_split_layer_spec_from_args(args):
    """The TE split spec for megatron.training's parsed arguments."""
    return te_split_layer_spec(
        num_experts=getattr(args, "num_experts", None), moe_grouped_gemm=getattr(args, "moe_grouped_gemm", False),
        qk_layernorm=getattr(args, "qk_layernorm", False),
        multi_latent_attention=getattr(args, "multi_latent_attention", False),
        qk_l2_norm=getattr(args, "qk_l2_norm", False),
    )


gpt_te_split_layer_spec = SpecFromTrainingArgs(te_split_layer_spec_from_args)
