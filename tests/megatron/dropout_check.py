"""One-process probe for test_dropout_seed.py (CPU mode changes the process, so it runs as a subprocess).

Prints one JSON object of booleans, each an observable property of schedule-invariant randomness.
"""

import json
import socket
import sys

import torch
import torch.distributed as dist

from megatron_vshape.megatron.cpu_mode import enable_cpu_mode


def setup():
    enable_cpu_mode()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(123)


def build():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.5,
                               attention_dropout=0.5, use_cpu_initialization=True)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16)


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values())
               if isinstance(x, torch.Tensor))


def main():
    setup()
    from megatron_vshape.megatron.dropout_seed import InvariantDropout, attach, invariant_init

    out = {}
    torch.manual_seed(1)
    plain_a = build()
    torch.manual_seed(2)
    plain_b = build()
    out["plain_init_depends_on_rng_state"] = not same(plain_a, plain_b)
    with invariant_init(seed=7, tp_rank=0):
        torch.manual_seed(1)
        model = build()
        torch.manual_seed(2)
        again = build()
    out["invariant_init_ignores_rng_state"] = same(model, again)
    with invariant_init(seed=8, tp_rank=0):
        other_seed = build()
    out["invariant_init_depends_on_seed"] = not same(model, other_seed)

    tokens = torch.randint(0, 64, (2, 16))
    positions = torch.arange(16).unsqueeze(0).expand(2, 16)
    model.train()

    def forward_step(data_iterator, chunk):
        return chunk(tokens, positions, None)

    attach([model])
    out["plain_dropout_differs_between_calls"] = not torch.equal(forward_step(None, model), forward_step(None, model))
    first = InvariantDropout(seed=5, iteration=3, num_microbatches=4, dp_rank=0, tp_rank=0).wrap_forward_step(
        forward_step)
    mb0 = first(None, model)
    mb1 = first(None, model)
    torch.rand(1000)  # another schedule runs other passes in between: RNG streams move on
    second = InvariantDropout(seed=5, iteration=3, num_microbatches=4, dp_rank=0, tp_rank=0).wrap_forward_step(
        forward_step)
    out["same_position_same_masks"] = torch.equal(second(None, model), mb0) and torch.equal(second(None, model), mb1)
    out["microbatches_get_different_masks"] = not torch.equal(mb0, mb1)
    later = InvariantDropout(seed=5, iteration=4, num_microbatches=4, dp_rank=0, tp_rank=0).wrap_forward_step(
        forward_step)
    out["iterations_get_different_masks"] = not torch.equal(later(None, model), mb0)
    other_dp = InvariantDropout(seed=5, iteration=3, num_microbatches=4, dp_rank=1, tp_rank=0).wrap_forward_step(
        forward_step)
    out["dp_ranks_get_different_masks"] = not torch.equal(other_dp(None, model), mb0)
    model.eval()
    out["eval_has_no_dropout"] = torch.equal(first(None, model), first(None, model))
    print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
