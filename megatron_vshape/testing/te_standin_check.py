"""The executor's wiring against the Transformer Engine stand-in: a split schedule defers W through TE.

Run as ``python -m megatron_vshape.testing.te_standin_check [--cp 1,2] [--dp N] [--overlap-grad-reduce] [SCHEDULE ...]`` with the stand-in on
``PYTHONPATH`` (:func:`environment`): megatron-core then imports it as Transformer Engine, its own
wrappers (``megatron.core.extensions.transformer_engine``) subclass the stand-in's modules, and the
tiny GPT of a split schedule gets the TE split spec (TE's linears with ``delay_wgrad_compute``), as the
training glue picks it. A single-process reference (fused backward, TE's W right after each B) gives
the gradients; every pipeline rank reports its gradient error, the executor's deferred/run counts (the
``[vshape]`` line's figures) and which TE classes ran ``backward_dw()`` how often, at each
context-parallel size asked (``--cp 1,2``: CP under V placement, with the stand-in's CP attention and
megatron's CP batch slicing). Prints one JSON line: {cp: [row per rank]}.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import tempfile

from . import te_standin


def environment(version: str | None = None) -> dict[str, str]:
    """The environment of a process that imports the stand-in as Transformer Engine (and its ranks)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([te_standin.PATH, root, os.environ.get("PYTHONPATH", "")]))
    if version is not None:
        env[te_standin.VERSION_ENV] = version
    return env


def te_worker(rank: int, world_size: int, spec, ref_paths: list) -> dict:
    """:func:`workers.pipeline_worker`, counting the stand-in's ``backward_dw()`` calls by class."""
    from transformer_engine.pytorch.module import base

    from .workers import pipeline_worker

    calls: collections.Counter = collections.Counter()
    original = base.TransformerEngineBaseModule.backward_dw

    def counting(self):
        calls[type(self).__name__] += 1
        return original(self)

    base.TransformerEngineBaseModule.backward_dw = counting
    row = pipeline_worker(rank, world_size, spec, ref_paths)
    row["backward_dw_calls"] = dict(calls)
    return row


def run(schedules: tuple[str, ...], pp: int = 2, microbatches: int = 4, cps: tuple[int, ...] = (1,), dp: int = 1,
        overlap_grad_reduce: bool = False) -> dict:
    """One reference, then the pipeline at each context-parallel size: {cp: per-rank rows}."""
    from .spawn import spawn
    from .tiny_gpt import ModelSettings
    from .workers import RunSpec, reference_worker

    model = ModelSettings(num_layers=4 * pp, spec="te", micro_batch_size=1)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "reference.pt")
        spawn(reference_worker, 1, ([(model, path)], microbatches * dp, "cpu", True), timeout=200)
        for cp in cps:
            spec = RunSpec(schedules, pp=pp, microbatches=microbatches, cp=cp, dp=dp,
                           overlap_grad_reduce=overlap_grad_reduce, model=model)
            out[cp] = spawn(te_worker, spec.world_size, (spec, [path]), timeout=200)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cps = (1,)
    if "--cp" in argv:  # context-parallel sizes, e.g. 1,2 (the stand-in's CP attention)
        at = argv.index("--cp")
        cps = tuple(int(c) for c in argv[at + 1].split(","))
        del argv[at:at + 2]
    dp = 1
    if "--dp" in argv:  # data-parallel replicas
        at = argv.index("--dp")
        dp = int(argv[at + 1])
        del argv[at:at + 2]
    overlap = "--overlap-grad-reduce" in argv  # megatron DDP's overlapped bucket reduction
    argv = [a for a in argv if a != "--overlap-grad-reduce"]
    te_standin.install()
    result = run(tuple(argv) or ("v-half", "v-zb"), cps=cps, dp=dp, overlap_grad_reduce=overlap)
    print("RESULT" + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
