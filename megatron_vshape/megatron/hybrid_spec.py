"""HybridModel (Megatron-LM's ``pretrain_hybrid.py``) on CPU and on V placements.

Layer specs. megatron-core's ``hybrid_stack_spec`` is Transformer Engine throughout (norms fused into
the next linear), which CPU mode does not have, and whose linears keep the weight gradient in B.
:func:`hybrid_local_spec` builds the same stack from megatron-core's local GPT spec (the torch layers
``get_gpt_layer_local_submodules`` picks): attention (``*``), MLP (``-``) and MoE (``E``) layers with
their own norms, and a Mamba layer (``M``) whose in/out projections are megatron's
``ColumnParallelLinear`` / ``RowParallelLinear`` with a separate norm in front (Mamba's scan itself
needs CUDA kernels). :func:`hybrid_split_spec` is that stack with TE's attention and norms
(:func:`megatron_vshape.megatron.layer_spec.with_te_attention_and_norms`): every GEMM is megatron's
own linear, so a B/W-split schedule defers all weight gradients, Mamba's included. ``G``, ``D``, MLA
and multi-token prediction keep megatron's TE specs. Megatron's ``--spec`` reads module attributes,
so the two specs are :class:`~.layer_spec.SpecFromTrainingArgs`, filled from megatron.training's
arguments on first use (:mod:`.hybrid_pattern` sets ``--spec``).

Patches (all in :mod:`.patches`, group ``hybrid``), installed by :func:`install`:

* V placement: chunk 1 of rank i is built with a pipeline view that reports looped rank d-1-i
  (:mod:`megatron_vshape.runtime.placement`); megatron's ``select_pipeline_segment`` asks
  ``torch.distributed.get_rank`` of the group, which a view cannot answer. For a view it is asked for
  the global stage ``vp_stage * d + rank`` directly, so V stage s gets the pattern's segment s, with
  its global layer numbers.
* ``--cpu``: HybridStack builds its final norm with ``TENorm`` whatever the spec says; on CPU it gets
  the local spec's torch norm.
"""

from __future__ import annotations

import functools

from megatron.core.transformer.spec_utils import ModuleSpec

from .layer_spec import SpecFromTrainingArgs, with_te_attention_and_norms

_ALLOCATION = "megatron.core.models.hybrid.hybrid_layer_allocation"
# The MoE spec needs some expert count to pick its classes; the model's own count comes from the config.
_ANY_EXPERTS = 8


def hybrid_local_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False, normalization=None,
                      qk_l2_norm=False) -> ModuleSpec:
    """megatron-core's hybrid stack with its local (torch) GPT layers; see the module docstring."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.models.hybrid import hybrid_layer_specs as megatron_specs
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    options = dict(qk_layernorm=qk_layernorm, normalization=normalization, qk_l2_norm=qk_l2_norm)
    dense = get_gpt_layer_local_submodules(**options)
    moe = get_gpt_layer_local_submodules(num_experts=num_experts or _ANY_EXPERTS, moe_grouped_gemm=moe_grouped_gemm,
                                         **options)
    norm = dense.input_layernorm
    te = megatron_specs.hybrid_stack_spec.submodules
    # Checkpoint keys as megatron's TE hybrid spec writes them (its norms live inside the next linear),
    # which are also the GPT local spec's: checkpoints move between CPU, GPU and GPTModel runs.
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=norm, self_attention=dense.self_attention, self_attn_bda=dense.self_attn_bda,
            sharded_state_dict_keys_map={"input_layernorm.": "self_attention.linear_qkv.layer_norm_"})),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=norm, mlp=dense.mlp, mlp_bda=dense.mlp_bda,
            sharded_state_dict_keys_map={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"})),
        moe_layer=ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=norm, mlp=moe.mlp, mlp_bda=moe.mlp_bda)),
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
            norm=norm,
            mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(
                in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)),
            mamba_bda=te.mamba_layer.submodules.mamba_bda,
            sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"})),
        gdn_layer=te.gdn_layer, dsa_layer=te.dsa_layer, mla_layer=te.mla_layer, mtp_block_spec=te.mtp_block_spec,
    ))


def hybrid_split_spec(**options) -> ModuleSpec:
    """The local hybrid stack with Transformer Engine's attention and norms (GPU, B/W-split schedules)."""
    return with_te_attention_and_norms(hybrid_local_spec(**options))


def _options_from_args(args) -> dict:
    return dict(num_experts=getattr(args, "num_experts", None), moe_grouped_gemm=getattr(args, "moe_grouped_gemm", False),
                qk_layernorm=getattr(args, "qk_layernorm", False), normalization=getattr(args, "normalization", None),
                qk_l2_norm=getattr(args, "qk_l2_norm", False))


# Megatron's --spec targets (see hybrid_pattern.HYBRID_LOCAL_SPEC_ARG / HYBRID_SPLIT_SPEC_ARG).
hybrid_local_stack_spec = SpecFromTrainingArgs(lambda args: hybrid_local_spec(**_options_from_args(args)))
hybrid_split_stack_spec = SpecFromTrainingArgs(lambda args: hybrid_split_spec(**_options_from_args(args)))


# ---------------------------------------------------------------------------------------------
# Patches
# ---------------------------------------------------------------------------------------------

def install(cpu: bool) -> None:
    """V-chunk segment selection, and on CPU HybridStack's final norm (idempotent)."""
    from .patches import Group, check

    check(Group.HYBRID)
    _v_segments()
    if cpu:
        _cpu_final_norm()


def _v_segments() -> None:
    import importlib

    from megatron_vshape.runtime.placement import PipelineRankView

    allocation = importlib.import_module(_ALLOCATION)
    original = allocation.select_pipeline_segment
    if getattr(original, "_vshape", False):
        return

    @functools.wraps(original)
    def select_pipeline_segment(main_pattern, pp_group, vp_stage, *args, **kwargs):
        if isinstance(pp_group, PipelineRankView):
            # Megatron takes segment vp_stage * PP + pp_rank; a V chunk's view reports its looped rank.
            stage = (vp_stage or 0) * pp_group.size() + pp_group.rank()
            return original(main_pattern, None, stage, *args, **kwargs)
        return original(main_pattern, pp_group, vp_stage, *args, **kwargs)

    select_pipeline_segment._vshape = True
    allocation.select_pipeline_segment = select_pipeline_segment


def _cpu_final_norm() -> None:
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.hybrid import hybrid_block

    if getattr(hybrid_block.TENorm, "_vshape", False):
        return
    local = LocalSpecProvider()

    def final_norm(config, hidden_size, eps=1e-5, **kwargs):
        norm = local.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=False)
        return norm(config=config, hidden_size=hidden_size, eps=eps)

    final_norm._vshape = True
    hybrid_block.TENorm = final_norm
