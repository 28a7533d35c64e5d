"""DotProductAttention: plain causal softmax attention over [s, b, h, d] (the maths of megatron's local one)."""

import math

import torch


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
        self.cp_group = cp_group
        self.te_kwargs = kwargs

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type="p2p"):
        if cp_group is not None and cp_group.size() > 1:
            raise NotImplementedError("the TE stand-in has no context-parallel attention")
        self.cp_group = cp_group

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, **kwargs):
        s, b, h, d = query.shape
        if key.shape[2] != h:  # grouped-query attention: repeat the KV heads
            key = key.repeat_interleave(h // key.shape[2], dim=2)
            value = value.repeat_interleave(h // value.shape[2], dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
        if "causal" in str(attn_mask_type or self.attn_mask_type):
            mask = torch.ones(s, key.shape[0], dtype=torch.bool, device=query.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)  # [b, h, s, d]
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)
