"""Cost of splitting a backward into B + W: (B + W) / fused backward, for one megatron GPT layer.

The split is not free: B and W each launch their own GEMMs and W re-reads the saved input and
output gradient, so (B + W) / fused > 1 measures what a split schedule pays for its smaller bubble.
Runs on whatever device is present (CUDA if visible, else CPU in megatron_vshape's CPU mode), one
process, tensor parallel size 1.

    python scripts/bench_wgrad.py --hidden 1024 --seq 512 --json bench_wgrad.json
    python scripts/bench_wgrad.py --model mlp --hidden 4096 --dtype bf16     # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class Result:
    model: str
    device: str
    dtype: str
    hidden: int
    seq: int
    batch: int
    threads: int
    iters: int
    fused_ms: float  # medians
    b_ms: float
    w_ms: float
    fused_min_ms: float  # minima: less sensitive to other processes on a shared machine
    b_min_ms: float
    w_min_ms: float

    @property
    def ratio(self) -> float:
        return (self.b_ms + self.w_ms) / self.fused_ms

    @property
    def ratio_min(self) -> float:
        return (self.b_min_ms + self.w_min_ms) / self.fused_min_ms

    def to_json(self) -> dict:
        return {**asdict(self), "b_plus_w_over_fused": self.ratio, "b_plus_w_over_fused_min": self.ratio_min}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["gpt-layer", "mlp"], default="gpt-layer",
                        help="a local-spec TransformerLayer, or ColumnParallelLinear -> gelu -> RowParallelLinear")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: on a shared, oversubscribed machine more threads spin "
                             "on each other and the timings become noise)")
    parser.add_argument("--compile", action="store_true",
                        help="let megatron's jit fusers use torch.compile (off: on CPU it compiles with inductor "
                             "during the timed passes)")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = parser.parse_args(argv)
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}: change one of them")
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    return args


def init_single_rank(device: torch.device) -> None:
    """A world of one: megatron's layers need parallel_state even at tensor parallel size 1."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if device.type == "cpu":
        from megatron_vshape.megatron.cpu_mode import enable_cpu_mode

        enable_cpu_mode()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(1234)


def build(args, device: torch.device):
    """The model and its forward: x [s, b, h] -> y [s, b, h]."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    config = TransformerConfig(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=args.heads, params_dtype=dtype,
        bf16=args.dtype == "bf16", use_cpu_initialization=device.type == "cpu",
        hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False,
    )
    if args.model == "mlp":
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        init = torch.nn.init.xavier_normal_
        fc1 = ColumnParallelLinear(args.hidden, 4 * args.hidden, config=config, init_method=init, bias=True,
                                   gather_output=False)
        fc2 = RowParallelLinear(4 * args.hidden, args.hidden, config=config, init_method=init, bias=True,
                                input_is_parallel=True, skip_bias_add=False)
        model = torch.nn.ModuleList([fc1, fc2]).to(device)
        return model, lambda x: fc2(torch.nn.functional.gelu(fc1(x)[0]))[0], dtype

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    layer = build_module(get_gpt_layer_local_spec(), config=config, layer_number=1).to(device)

    def forward(x):
        out = layer(x, attention_mask=None)
        return out[0] if isinstance(out, tuple) else out

    return layer, forward, dtype


def _timed(fn, device: torch.device) -> float:
    """Milliseconds of fn(), with the device drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def measure(args, device: torch.device) -> Result:
    from megatron_vshape.runtime.wgrad import WeightGradStore, enable_wgrad_split

    enable_wgrad_split()
    model, forward, dtype = build(args, device)
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (args.seq, args.batch, args.hidden)
    x = torch.randn(shape, generator=gen, device=device, dtype=dtype).requires_grad_()
    dy = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    store = WeightGradStore()
    fused, b_pass, w_pass = [], [], []
    def clear_grads():  # both variants start from empty grads: assignment, not accumulation
        model.zero_grad(set_to_none=True)
        x.grad = None

    for step in range(args.warmup + args.iters):
        out = forward(x)  # forwards are not timed
        t_fused = _timed(lambda out=out: torch.autograd.backward(out, dy), device)
        clear_grads()
        out = forward(x)

        def b(out=out, step=step):
            with store.capture((0, step)):
                torch.autograd.backward(out, dy)

        t_b = _timed(b, device)
        t_w = _timed(lambda step=step: store.run((0, step)), device)
        clear_grads()
        if step >= args.warmup:
            fused.append(t_fused)
            b_pass.append(t_b)
            w_pass.append(t_w)
    return Result(
        model=args.model, device=str(device), dtype=args.dtype, hidden=args.hidden, seq=args.seq,
        batch=args.batch, threads=torch.get_num_threads(), iters=args.iters,
        fused_ms=statistics.median(fused), b_ms=statistics.median(b_pass), w_ms=statistics.median(w_pass),
        fused_min_ms=min(fused), b_min_ms=min(b_pass), w_min_ms=min(w_pass),
    )


def print_table(result: Result) -> None:
    print(f"{result.model} on {result.device} ({result.dtype}), hidden {result.hidden}, seq {result.seq}, "
          f"batch {result.batch}, {result.threads} threads, {result.iters} timed iterations")
    rows = [
        ("fused backward", result.fused_ms, result.fused_min_ms),
        ("B (input grads)", result.b_ms, result.b_min_ms),
        ("W (weight grads)", result.w_ms, result.w_min_ms),
        ("B + W", result.b_ms + result.w_ms, result.b_min_ms + result.w_min_ms),
    ]
    print(f"{'pass':<18}{'median ms':>11}{'/ fused':>9}{'min ms':>11}{'/ fused':>9}")
    for name, med, low in rows:
        print(f"{name:<18}{med:>11.2f}{med / result.fused_ms:>9.3f}{low:>11.2f}{low / result.fused_min_ms:>9.3f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.compile:
        import torch._dynamo

        torch._dynamo.config.disable = True
    torch.set_num_threads(args.threads)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu" and args.dtype == "bf16":
        print("note: bf16 GEMMs on CPU are slow and unrepresentative; fp32 is the CPU default", file=sys.stderr)
    init_single_rank(device)
    try:
        result = measure(args, device)
    finally:
        torch.distributed.destroy_process_group()
    print_table(result)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result.to_json(), fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
