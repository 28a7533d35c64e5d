"""DotProductAttention: causal softmax attention over [s, b, h, d] (the maths of megatron's local one).

With a context-parallel group of size > 1, each rank holds two of the sequence's 2 x CP chunks (chunk r
and chunk 2CP-1-r, Megatron's ``get_batch_on_this_cp_rank`` layout): the keys and values of every rank
are all-gathered (their gradients summed back to the owner), put in sequence order, and the causal mask
uses global positions. That is what TE's CP attention computes, without its ring or its kernels.
"""

import math

import torch


class _AllGatherSeq(torch.autograd.Function):
    """[s_local, ...] -> every rank's tensor, stacked [cp, s_local, ...]; backward sums and keeps our slice."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        parts = [torch.empty_like(tensor) for _ in range(group.size())]
        torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad[ctx.group.rank()], None


def _global_order(stacked: torch.Tensor) -> torch.Tensor:
    """[cp, 2c, ...] (rank r: chunks r and 2cp-1-r) -> [2 cp c, ...] in sequence order."""
    cp = stacked.shape[0]
    halves = stacked.unflatten(1, (2, stacked.shape[1] // 2))  # [cp, 2, c, ...]
    chunks = [halves[j, 0] if j < cp else halves[2 * cp - 1 - j, 1] for j in range(2 * cp)]
    return torch.cat(chunks)


def _positions(rank: int, cp: int, chunk: int, device) -> torch.Tensor:
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])


class DotProductAttention(torch.nn.Module):
    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                 qkv_format="sbhd", attn_mask_type="causal", sequence_parallel=False, tp_size=1,
                 get_rng_state_tracker=None, tp_group=None, layer_number=None, attention_type="self",
                 softmax_scale=None, cp_group=None, cp_global_ranks=None, cp_stream=None, cp_comm_type="p2p",
                 **kwargs):
        super().__init__()
        if tp_size != 1:
            raise NotImplementedError("the TE stand-in runs one tensor-parallel rank")
        self.num_heads, self.kv_channels = num_attention_heads, kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(kv_channels)
        self.attn_mask_type, self.qkv_format = attn_mask_type, qkv_format
        self.cp_group, self.cp_comm_type = cp_group, cp_comm_type
        self.te_kwargs = kwargs

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type="p2p"):
        self.cp_group, self.cp_comm_type = cp_group, cp_comm_type

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, **kwargs):
        s, b, h, d = query.shape
        q_pos = k_pos = torch.arange(s, device=query.device)
        group = self.cp_group
        if group is not None and group.size() > 1:
            cp = group.size()
            key = _global_order(_AllGatherSeq.apply(key, group))
            value = _global_order(_AllGatherSeq.apply(value, group))
            q_pos = _positions(group.rank(), cp, s // 2, query.device)
            k_pos = torch.arange(key.shape[0], device=query.device)
        if key.shape[2] != h:  # grouped-query attention: repeat the KV heads
            key = key.repeat_interleave(h // key.shape[2], dim=2)
            value = value.repeat_interleave(h // value.shape[2], dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
        if "causal" in str(attn_mask_type or self.attn_mask_type):
            scores = scores.masked_fill(q_pos[:, None] < k_pos[None, :], float("-inf"))
        out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)  # [b, h, s, d]
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)
