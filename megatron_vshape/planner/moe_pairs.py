"""Overlapped F&B pairs in the plan (``--overlap-moe-expert-parallel-comm`` under a V schedule, issue 43).

With expert parallelism every F and every B of a MoE layer runs a dispatch and a combine all-to-all
(:meth:`.costs.CostModel.pass_times` puts them inside F and B, as ``PassTimes.a2a``). A pair runs one
microbatch's F with another microbatch's B on one device, each all-to-all under the other pass's compute.
The plan's row with pairs (named ``SCHEDULE +pairs``) is costed by the simulator's own pair costing:

* the costs (:func:`paired_costs`): F and B without the all-to-all, and the all-to-all apart, as
  ``Costs.a2a`` in units of the V chunk's F (so an F or B alone pays it in full, a pair only what the other
  pass's compute does not hide: ``Costs.pair_time``);
* the order: the registry's, built under those costs (``schedules/generators/pairing.py``: pairs only where
  the family's memory bound allows, and only if the paired order is faster); the planner's memory estimate
  walks that order's timeline, so the row's peak is the paired order's.

Each stage pays its own MoE layers' all-to-all (:func:`stage_a2a_shares`, ``StageWork.a2a``): uneven layer
counts, dense layers, the embedding and the head change it. The row without pairs keeps the all-to-all
inside F and B, where a stage's multiplier scales it with the stage's compute (the head's included), so an
F alone on the head's stage costs that much more there than here.

Where the flag cannot run (:func:`pair_problem`, Megatron's and the executor's rules), there is no row.
"""

from __future__ import annotations

from dataclasses import replace

from ..schedules.core.schedule import Costs, PlacementKind
from ..schedules.generators.registry import SCHEDULES
from .costs import PassTimes
from .model import GPTModel
from .parallel_layout import ParallelLayout

FLAG = "--overlap-moe-expert-parallel-comm"
LABEL = "+pairs"  # a row with the flag: "v-zb +pairs"
# The schedules whose executor runs the pairs: two model chunks per rank (megatron/moe_overlap.py refuses
# the flag under the others in one line).
PAIRING_SCHEDULES = tuple(name for name, spec in SCHEDULES.items() if spec.placement is PlacementKind.V)


def offered(name: str, model: GPTModel) -> bool:
    """Whether the plan has a ``+pairs`` row for schedule ``name`` (a recomputing "-r" name has none)."""
    return name in PAIRING_SCHEDULES and model.num_experts > 0


def pair_problem(name: str, layout: ParallelLayout, model: GPTModel) -> str | None:
    """Why ``layout`` cannot run ``name`` with the flag (Megatron's config check, the executor), or None."""
    if name not in PAIRING_SCHEDULES:
        return f"{FLAG} pairs under the V schedules ({', '.join(PAIRING_SCHEDULES)}) alone"
    if not model.num_experts:
        return f"{FLAG} needs MoE layers (--num-experts)"
    if layout.ep == 1:
        return f"{FLAG} needs expert parallelism (EP > 1): without it there is no all-to-all to hide"
    if layout.recompute == "full":
        return f"{FLAG}: Megatron refuses full recomputation with it"
    return None


def paired_costs(costs: Costs, times: PassTimes, model: GPTModel, layers_per_stage: tuple[int, ...] = ()) -> Costs:
    """``costs`` (per V chunk, the all-to-all inside F and B as ``times`` has it) with the all-to-all apart:
    F and B their compute alone, ``a2a`` the mean chunk's all-to-all per F and per B in units of that F, and each
    stage's own share of it (``StageWork.a2a``: its MoE layers' all-to-all over the mean chunk's) where the
    stages hold ``layers_per_stage`` layers."""
    if times.a2a <= 0:
        return costs
    per_chunk = costs.f / times.f  # mean layers per V chunk (costs.f = layers x times.f)
    a2a = per_chunk * times.a2a
    f, b = costs.f - a2a, costs.b - a2a
    stages = costs.stages
    if layers_per_stage and stages:
        shares = stage_a2a_shares(model, layers_per_stage)
        stages = tuple(replace(work, a2a=share) for work, share in zip(stages, shares))
    return replace(costs, f=f, b=b, a2a=a2a / f, stages=stages)


def run_a2a(times: PassTimes) -> float:
    """The all-to-all a run's pairs are to be placed for (``--pipeline-costs a2a=X`` in the plan's flags): per F
    and per B, in units of a layer's F compute, which is the unit the run's costs count F in. Without it the run
    places its pairs for ``moe_overlap.DEFAULT_A2A`` (1 x F), whatever the plan costed."""
    compute = times.f - times.a2a
    return times.a2a / compute if times.a2a > 0 and compute > 0 else 0.0


def stage_a2a_shares(model: GPTModel, layers_per_stage: tuple[int, ...]) -> tuple[float, ...]:
    """Each stage's all-to-all over the mean stage's: the top-k token copies its MoE layers move (a dense layer
    moves none; the embedding and the head none)."""
    tokens = [layer.a2a_tokens for layer in model.layer_costs]
    mean = sum(tokens) / len(layers_per_stage)
    out, start = [], 0
    for count in layers_per_stage:
        out.append(sum(tokens[start:start + count]) / mean)
        start += count
    return tuple(out)

