"""What the parsed ``vshape`` flags mean for the schedule library: costs, memory model, size, placement.

Each function reads the argparse namespace of one subcommand and raises :class:`UsageError` (one line
naming the flag and the fix) on a bad value or combination, before anything long is built.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from .cli_parser import UsageError
from .schedules.core import inputs
from .schedules.core.schedule import Costs, MemoryModel, Placement, VocabWork, parse_stage_work
from .schedules.generators.registry import SCHEDULES


def costs_of(args) -> Costs:
    """--costs or --costs-from, with --stage-costs applied (simulate only)."""
    if args.costs_from is not None:
        if args.costs is not None:
            raise UsageError("give --costs or --costs-from, not both")
        return costs_from_file(args.costs_from)
    costs = Costs.parse(args.costs or "f=1,b=1,w=1,comm=0")
    stage_costs = getattr(args, "stage_costs", None)  # only `simulate` has the flag
    if stage_costs is not None:
        num_stages = args.stages * SCHEDULES[args.schedule].chunks_per_device(args.chunks)
        costs = costs.with_stages(parse_stage_work(stage_costs, num_stages))
    vocab = getattr(args, "vocab_parallel", None)  # only `simulate` has the flag
    if vocab is not None:
        costs = replace(costs, vocab=VocabWork.parse(vocab))
    return costs


def costs_from_file(path: str) -> Costs:
    """The costs training wrote with --pipeline-costs-out (a JSON object with f, b, w, comm)."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise UsageError(f"--costs-from {path}: cannot read a JSON object ({err})") from None
    if not isinstance(record, dict) or not all(key in record for key in ("f", "b", "w", "comm")):
        raise UsageError(f"--costs-from {path}: needs the keys f, b, w and comm (as training writes them)")
    return Costs.parse(",".join(f"{key}={record[key]}" for key in ("f", "b", "w", "comm")))


def memory_model_of(args) -> MemoryModel:
    """--memory-model simple, or gpt with all of --hidden, --heads and --seq."""
    if args.memory_model == "simple":
        if any(v is not None for v in (args.hidden, args.heads, args.seq)):
            raise UsageError("--hidden/--heads/--seq only apply to --memory-model gpt")
        return MemoryModel()
    missing = [flag for flag, v in (("--hidden", args.hidden), ("--heads", args.heads), ("--seq", args.seq))
               if v is None]
    if missing:
        raise UsageError(f"--memory-model gpt needs {', '.join(missing)} (e.g. --hidden 4096 --heads 32 --seq 4096)")
    inputs.count("--hidden", args.hidden, 1, 1 << 20)
    inputs.count("--heads", args.heads, 1, 1 << 14)
    inputs.count("--seq", args.seq, 1, 1 << 24)
    return MemoryModel.for_gpt(args.hidden, args.heads, args.seq)


def size_of(args) -> inputs.Size:
    """The requested size, checked for range and sane total before anything is built."""
    inputs.count("--chunks", args.chunks, 1, inputs.MAX_CHUNKS)
    chunks = SCHEDULES[args.schedule].chunks_per_device(args.chunks)
    return inputs.Size(args.stages, args.microbatches, chunks).check()


def placement_of(args, rows) -> Placement:
    """The placement named by --placement, sized from the file (rows = devices, stages used)."""
    devices = len(rows)
    if devices == 0:
        raise UsageError(f"FILE: {args.file} holds no schedule rows")
    inputs.count(f"FILE {args.file}: rows (devices)", devices, 1, inputs.MAX_DEVICES)
    passes = sum(map(len, rows))
    if passes > inputs.MAX_PASSES:
        raise UsageError(f"FILE: {args.file} holds {passes:,} passes, above the {inputs.MAX_PASSES:,} this tool reads")
    if args.stages is not None and args.stages != devices:
        raise UsageError(f"--stages: the file has {devices} rows (one per device) but --stages is {args.stages}")
    used = {a.stage for row in rows for a in row}
    num_stages = max(used, default=-1) + 1
    if num_stages > len(used):  # a stage index far beyond the others would size the placement
        missing = min(set(range(len(used) + 1)) - used)
        raise UsageError(f"FILE: {args.file} uses stage {num_stages - 1} but no pass of stage {missing}; "
                         "stages must be numbered 0, 1, 2, ... without gaps")
    if args.placement == "v":
        if args.chunks not in (None, 2):
            raise UsageError("--chunks: the v placement always has 2 chunks per device")
        if num_stages != 2 * devices:
            raise UsageError(f"--placement v: the file uses {num_stages} stages; a V on {devices} devices has "
                             f"{2 * devices} (try --placement looped)")
        return Placement.v_shape(devices)
    chunks = args.chunks if args.chunks is not None else max(1, -(-num_stages // devices))
    if chunks < 1 or num_stages != chunks * devices:
        raise UsageError(f"--chunks: {chunks} chunks on {devices} devices hold {chunks * devices} stages; "
                         f"the file uses {num_stages}")
    return Placement.looped(devices, chunks)

