"""TE's fused MoE router kernels are not stood in (megatron uses them only with --moe-router-fusion)."""


def _not_stood_in(*args, **kwargs):
    raise NotImplementedError("the TE stand-in has no fused MoE router kernels")


fused_compute_score_for_moe_aux_loss = fused_moe_aux_loss = fused_topk_with_score_function = _not_stood_in
