#!/usr/bin/env python
"""Build-time check: every compiled kernel the GPU layer spec needs imports, or the build fails.

    python docker/check_kernels.py [--attention-backend fused|flash] [--list]

The Slurm scripts (scripts/slurm/generate.py) train with ``--transformer-impl transformer_engine``
and TE's fused (cuDNN) or flash attention; split schedules pair megatron-core's splittable linears
with TE's attention and norms, and the local spec falls back to apex. Megatron silently swaps a
missing kernel for a slow torch one (or, for attention, for the unfused path whose s x s scores
do not fit at sequence 16384), so a missing kernel must fail the image build instead of the job.

Only imports run: ``docker build`` has no GPU, so nothing is launched. Exit 1 and one line per
missing kernel (what needs it, how to get it); exit 0 and one line per kernel found.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Kernel:
    module: str  # what must import
    attribute: str | None  # and what it must provide (None: the import is enough)
    needed_by: str
    fix: str


_TE_FIX = "use an NGC PyTorch image (it ships Transformer Engine) or pip install transformer_engine[pytorch]"
_APEX_FIX = "use an NGC PyTorch image (it ships apex) or build apex with --cpp_ext --cuda_ext"

COMMON = (
    Kernel("transformer_engine.pytorch", "DotProductAttention", "--transformer-impl transformer_engine", _TE_FIX),
    Kernel("transformer_engine_torch", None, "Transformer Engine's compiled kernels", _TE_FIX),
    Kernel("transformer_engine.pytorch.optimizers", "FusedAdam", "megatron's optimizer (TE FusedAdam)", _TE_FIX),
    Kernel("transformer_engine.pytorch.optimizers", "multi_tensor_applier", "gradient clipping", _TE_FIX),
    Kernel("fused_layer_norm_cuda", None, "apex FusedLayerNorm (local and split layer specs)", _APEX_FIX),
    Kernel("apex.normalization.fused_layer_norm", "FusedLayerNormAffineFunction", "megatron's FusedLayerNorm",
           _APEX_FIX),
    Kernel("fused_weight_gradient_mlp_cuda", None,
           "--gradient-accumulation-fusion in megatron's linears (the split schedules' W)", _APEX_FIX),
    Kernel("amp_C", None, "apex multi-tensor kernels (optimizer, clipping fallback)", _APEX_FIX),
    Kernel("apex.optimizers", "FusedAdam", "apex FusedAdam (optimizer fallback)", _APEX_FIX),
)
ATTENTION = {
    # TE's cuDNN fused attention lives in its own extension; the query function proves it was built in.
    "fused": (Kernel("transformer_engine_torch", "get_fused_attn_backend", "--attention-backend fused",
                     "use a Transformer Engine build with cuDNN fused attention (NGC images have it)"),),
    # TE's flash backend calls the flash-attn package (FA2 on A100; FA3 is optional on H100).
    "flash": (Kernel("flash_attn", "flash_attn_func", "--attention-backend flash",
                     "pip install flash-attn --no-build-isolation, or build with --build-arg ATTENTION_BACKEND=fused "
                     "and pass EXTRA_ARGS='--attention-backend fused' to the Slurm scripts"),
              Kernel("flash_attn_2_cuda", None, "--attention-backend flash (flash-attn's CUDA extension)",
                     "reinstall flash-attn against this image's torch")),
}


def required(attention_backend: str) -> tuple[Kernel, ...]:
    return COMMON + ATTENTION[attention_backend]


def missing(kernel: Kernel) -> str | None:
    """Why ``kernel`` is unusable (one line), or None if it imports and has its attribute."""
    try:
        module = importlib.import_module(kernel.module)
    except Exception as err:  # ImportError, or an extension that fails to load (OSError, RuntimeError)
        return f"import {kernel.module} failed ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    if kernel.attribute is not None and not hasattr(module, kernel.attribute):
        return f"{kernel.module} has no {kernel.attribute}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attention-backend", choices=sorted(ATTENTION), default="fused",
                        help="the attention the Slurm scripts use (default: fused, as generate.py writes them)")
    parser.add_argument("--list", action="store_true", help="print the kernels checked, import nothing")
    opts = parser.parse_args(argv)
    kernels = required(opts.attention_backend)
    if opts.list:
        for kernel in kernels:
            print(f"{kernel.module}{'.' + kernel.attribute if kernel.attribute else ''}: {kernel.needed_by}")
        return 0
    failures = 0
    for kernel in kernels:
        problem = missing(kernel)
        if problem is None:
            print(f"ok      {kernel.module}{'.' + kernel.attribute if kernel.attribute else ''}")
        else:
            failures += 1
            print(f"MISSING {kernel.needed_by}: {problem}; {kernel.fix}", file=sys.stderr)
    if failures:
        print(f"check_kernels: {failures} of {len(kernels)} kernels missing: the image would fall back to "
              "slow or unfused paths; fix the image (see above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
