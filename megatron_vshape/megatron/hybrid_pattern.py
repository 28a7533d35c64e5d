"""HybridModel's layer pattern and the pipeline stages a schedule runs it in.

megatron-core's ``HybridModel`` (Megatron-LM's ``pretrain_hybrid.py``) orders its layers by
``--hybrid-layer-pattern``: one symbol per layer (``*`` attention, ``-`` MLP, ``E`` MoE, ``M`` Mamba-2,
``G`` Gated DeltaNet, ``D`` DeepSeek sparse attention, ``+`` MLA), ``|`` between pipeline segments
and ``/`` before the multi-token-prediction part. Megatron takes segment ``vp_stage * PP + pp_rank``
for a chunk, derives the virtual pipeline size from the segment count, and refuses
``--num-virtual-stages-per-pipeline-rank`` and ``--pipeline-model-parallel-layout`` next to a pattern.

So on HybridModel the stages a schedule runs are the pattern's ``|`` segments, in global stage order:

* V schedules (2d stages: device i holds stages i and 2d-1-i) need 2d segments; Megatron then builds
  two chunks per rank by itself (virtual pipeline size 2), and :mod:`.hybrid_spec` makes chunk 1 of
  rank i take segment 2d-1-i (Megatron would take d+i).
* ``--pipeline-layout N0,N1,...`` (layers per stage, see :mod:`.layout`) is written into the pattern as
  ``|`` segments. If the pattern has its own ``|`` and the two disagree, the run is refused (one line).
* Without either, a V schedule splits the pattern evenly into 2d segments; 1F1B and ZB keep
  Megatron's own split of a pattern without ``|`` (PP even parts).

``M``, ``G`` and ``D`` need CUDA kernels (mamba-ssm, causal-conv1d, flash-linear-attention, TE): with
``--cpu`` they are refused in one line naming the symbol. The spec CPU mode builds is
:data:`HYBRID_LOCAL_SPEC_ARG` (megatron-core's torch layers); split schedules on Transformer Engine get
:data:`HYBRID_SPLIT_SPEC_ARG` (megatron linears, so B/W splits every GEMM, Mamba's in/out projections
included).

Pure Python (no torch, no megatron import): the checks run on every rank before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layout_flag import BALANCED, FLAG, format_layout, parse_layout
from ..schedules.core.inputs import InputError
from ..schedules.core.schedule import PlacementKind
from ..schedules.generators.registry import SCHEDULES

PATTERN_FLAG = "--hybrid-layer-pattern"
PIPE, MTP = "|", "/"
# Layers whose megatron-core implementation needs CUDA kernels (refused with --cpu).
CUDA_ONLY = {"M": "Mamba-2", "G": "Gated DeltaNet", "D": "DeepSeek sparse attention"}
CPU_SYMBOLS = "'*' (attention), '-' (MLP), 'E' (MoE)"
# Megatron's --spec values (module, attribute) for HybridModel; see megatron_vshape.megatron.hybrid_spec.
HYBRID_LOCAL_SPEC_ARG = ["megatron_vshape.megatron.hybrid_spec", "hybrid_local_stack_spec"]
HYBRID_SPLIT_SPEC_ARG = ["megatron_vshape.megatron.hybrid_spec", "hybrid_split_stack_spec"]


@dataclass(frozen=True)
class HybridPattern:
    """A parsed ``--hybrid-layer-pattern``: the main pattern's ``|`` segments and the MTP suffix."""

    segments: tuple[str, ...]
    mtp: str = ""  # "" or the text from the first "/" on, kept verbatim

    @classmethod
    def parse(cls, text: str) -> HybridPattern:
        main, sep, rest = text.partition(MTP)
        return cls(tuple(main.split(PIPE)), sep + rest)

    @property
    def layers(self) -> str:
        """The main pattern's layer symbols, without ``|``."""
        return "".join(self.segments)

    @property
    def has_pipes(self) -> bool:
        return len(self.segments) > 1

    @property
    def counts(self) -> tuple[int, ...]:
        """Layers per segment."""
        return tuple(len(s) for s in self.segments)

    def split(self, counts) -> HybridPattern:
        """The same layers cut into segments of ``counts`` layers (they must sum to the layer count)."""
        layers, out, start = self.layers, [], 0
        for n in counts:
            out.append(layers[start:start + n])
            start += n
        assert start == len(layers), (counts, layers)
        return HybridPattern(tuple(out), self.mtp)

    def text(self) -> str:
        return PIPE.join(self.segments) + self.mtp


def pattern_text(args) -> str | None:
    """The hybrid pattern of the run (Megatron's deprecated ``--hybrid-override-pattern`` too), or None."""
    return getattr(args, "hybrid_layer_pattern", None) or getattr(args, "hybrid_override_pattern", None)


def is_hybrid(args) -> bool:
    return pattern_text(args) is not None


def _is_v(name: str | None) -> bool:
    return name in SCHEDULES and SCHEDULES[name].placement is PlacementKind.V


def cpu_problem(args) -> str | None:
    """``--cpu`` with a layer whose implementation needs CUDA kernels."""
    text = pattern_text(args)
    if text is None or not getattr(args, "cpu", False):
        return None
    for symbol, name in CUDA_ONLY.items():
        if symbol in text:
            return (f"{PATTERN_FLAG}: '{symbol}' ({name}) layers need CUDA kernels, which --cpu does not have; "
                    f"on CPU use {CPU_SYMBOLS}")
    return None


def stage_counts(args, pp: int) -> tuple[int, ...] | None:
    """Layers per global stage the run's schedule gets, or None for Megatron's own even split.

    Raises :class:`InputError` (one line) when the pattern, ``--pipeline-layout`` and the schedule disagree.
    """
    pattern = HybridPattern.parse(pattern_text(args))
    name = getattr(args, "pipeline_schedule", None)
    total = len(pattern.layers)
    if name == "interleaved-1f1b":
        stages = len(pattern.segments)  # Megatron derives the chunks from the segments
        if not pattern.has_pipes:
            raise InputError(f"--pipeline-schedule interleaved-1f1b on HybridModel takes its chunks from the '|' "
                             f"segments of {PATTERN_FLAG}; give PP x chunks segments")
    else:
        stages = 2 * pp if _is_v(name) else pp
    layout = getattr(args, "pipeline_layout", None)
    given = None
    if layout is not None and layout.strip().lower() not in ("uniform",):
        if layout.strip().lower() == BALANCED:
            raise InputError(f"{FLAG} {BALANCED} does not weigh {PATTERN_FLAG} layers yet; give the layers per "
                             f"stage as counts N0,N1,... or as '|' segments in the pattern")
        given = parse_layout(layout, total, stages)
    if pattern.has_pipes:
        if len(pattern.segments) != stages:
            raise InputError(f"{PATTERN_FLAG} has {len(pattern.segments)} '|' segments but --pipeline-schedule "
                             f"{name} at PP {pp} runs {stages} stages; give {stages} segments, or none for an "
                             "even split")
        if given is not None and given != pattern.counts:
            raise InputError(f"{FLAG} {format_layout(given)} disagrees with the '|' segments of {PATTERN_FLAG} "
                             f"({format_layout(pattern.counts)} layers); drop one of them or make them agree")
        return pattern.counts
    if given is not None:
        return given
    if _is_v(name):
        if total % stages:
            raise InputError(f"{PATTERN_FLAG} has {total} layers, not divisible by the {stages} stages of {name} "
                             f"(2 x PP); give {stages} '|' segments or {FLAG} N0,...,N{stages - 1}")
        return (total // stages,) * stages
    return None


def check(args, pp: int) -> str | None:
    """The pattern against --cpu, the schedule and --pipeline-layout (one line, or None)."""
    if not is_hybrid(args):
        return None
    found = cpu_problem(args)
    if found or getattr(args, "pipeline_schedule", None) is None:
        return found
    try:
        stage_counts(args, pp)
    except InputError as err:
        return str(err)
    return None


def apply(args) -> None:
    """Write the stages into the pattern as ``|`` segments (before Megatron's validate_args).

    Megatron derives the virtual pipeline (2 chunks on a V) from the segments and refuses the flags that
    would set it otherwise, so ``--num-virtual-stages-per-pipeline-rank`` is cleared here.
    """
    if not is_hybrid(args) or getattr(args, "pipeline_schedule", None) is None:
        return
    args.num_virtual_stages_per_pipeline_rank = None
    counts = stage_counts(args, getattr(args, "pipeline_model_parallel_size", None) or 1)
    if counts is None:
        return
    args.hybrid_layer_pattern = HybridPattern.parse(pattern_text(args)).split(counts).text()
    args.hybrid_override_pattern = None  # Megatron refuses both; its deprecated alias is now in the pattern


def spec_arg(args, split_schedule: bool) -> list[str] | None:
    """Megatron's ``--spec`` for HybridModel: a spec the user gave stays; else torch layers with
    ``--transformer-impl local`` (``--cpu``), the split spec for a B/W-split schedule on Transformer
    Engine, and Megatron's own default (None) otherwise."""
    spec = getattr(args, "spec", None)
    if spec not in (None, HYBRID_LOCAL_SPEC_ARG, HYBRID_SPLIT_SPEC_ARG):
        return spec
    if getattr(args, "transformer_impl", None) == "local":
        return list(HYBRID_LOCAL_SPEC_ARG)
    return list(HYBRID_SPLIT_SPEC_ARG) if split_schedule else None


def describe(args) -> str | None:
    """One line for the start-up log: the pattern's stages and where they run."""
    text = pattern_text(args)
    if text is None or getattr(args, "pipeline_schedule", None) is None:
        return None
    pattern = HybridPattern.parse(text)
    where = " (V: device i holds stages i and 2d-1-i)" if _is_v(args.pipeline_schedule) else ""
    return f"hybrid pattern stages: {' | '.join(pattern.segments)}{where}"
