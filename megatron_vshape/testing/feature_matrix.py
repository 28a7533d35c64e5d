"""The pairwise feature matrix: every pair of feature values a real run combines, through Megatron-LM's scripts.

Each factor is one thing a user turns on in a launch script (the schedule, ``--pipeline-vocab-parallel``,
tied embeddings, the DP options of NVIDIA's recipes, TP, recomputation, MoE with expert parallelism, the
layer layout, the layers' shape (GPT-2's or Llama-3's: SwiGLU, RMSNorm, RoPE, GQA), GPTModel or HybridModel,
per-token loss, bf16). The rows are a pairwise covering array
(``allpairspy``) under the constraints below, each stated with its reason: every pair of values that the
constraints allow appears in at least one row, and :data:`EXCLUDED` lists every pair that cannot.

A row trains 3 iterations (and one evaluation) on 4 CPU ranks through ``pretrain_gpt.py`` or
``pretrain_hybrid.py`` and must print the losses of Megatron's own 1F1B **without our flags** on the same
model (:meth:`Row.reference_flags`): the schedule, the vocabulary flag and the layout are ours; the DP
options and recomputation change when Megatron's work runs, never its maths, so rows that differ only in
those share one reference run.

This module only says what runs (pure Python besides ``allpairspy``); ``tests/megatron/test_feature_matrix*.py``
launch the rows and ``scripts/feature_matrix.py`` renders ``docs/recipes.md``'s table from their results.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

PP = 2
RANKS = 4  # the most a CI machine (2 cores) runs per launch
LAYERS = 8
SCHEDULES = ("1f1b", "interleaved-1f1b", "gpipe", "zb-h1", "zb-1p", "zb-2p", "v-min", "v-half", "v-zb", "v-auto")
V_SCHEDULES = ("v-min", "v-half", "v-zb", "v-auto")

FACTORS: dict[str, tuple] = {
    "schedule": SCHEDULES,
    "dp": ("none", "overlap-grad-reduce", "distributed-optimizer"),
    "recompute": ("none", "selective", "full"),
    "layout": ("uniform", "balanced", "explicit"),
    "vocab": (False, True),
    "tied": (True, False),
    "shape": ("gpt", "llama"),
    "tp": (1, 2),
    "moe": (False, True),
    "model": ("gpt", "hybrid"),
    "per_token_loss": (False, True),
    "bf16": (False, True),
}


@dataclass(frozen=True)
class Exclusion:
    """A pair of factor values no row may hold, and why; ``refusal``: the start of the one line a run with the
    pair is refused with at start-up (None: a pair this machine cannot hold, not one the plugin refuses)."""

    first: tuple[str, object]
    second: tuple[str, object]
    why: str
    refusal: str | None = None

    def forbids(self, values: dict) -> bool:
        return all(values.get(name, _ABSENT) == value for name, value in (self.first, self.second))


_ABSENT = object()

# The constraints, stated to the generator (each pair is excluded from every row) and printed in the docs.
EXCLUDED: tuple[Exclusion, ...] = (
    Exclusion(("layout", "balanced"), ("model", "hybrid"),
              "--pipeline-layout balanced does not weigh a hybrid pattern's layers yet (refused in one line)",
              refusal="--pipeline-layout balanced does not weigh --hybrid-layer-pattern layers yet"),
    Exclusion(("moe", True), ("tp", 2),
              "megatron-core's MoE layer refuses to train at TP > 1 without --sequence-parallel, which --cpu cannot "
              "take (refused in one line)",
              refusal="--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel"),
    Exclusion(("tp", 2), ("dp", "overlap-grad-reduce"),
              "TP 2 x DP 2 x PP 2 needs 8 ranks (at most 4 here; at TP 2 the run is DP 1)"),
    Exclusion(("tp", 2), ("dp", "distributed-optimizer"),
              "TP 2 x DP 2 x PP 2 needs 8 ranks (at most 4 here; at TP 2 the run is DP 1)"),
)

# Not factors, with the reason (the docs list them next to the matrix).
NOT_RUN = (
    ("--sequence-parallel", "--cpu refuses it: megatron-core's torch norms (the only ones without apex or TE) "
     "assert on sequence parallelism; the executor's TP 2 x SP exactness runs in-process "
     "(tests/runtime/test_executor_exact.py) with a norm that supports it"),
    ("--overlap-moe-expert-parallel-comm", "runs under the V schedules (overlapped F&B pairs through Megatron's "
     "combined 1F1B step) and refused under the other split schedules; not a factor: it needs bf16 and MoE with EP 2 "
     "together, so its own launches run it "
     "(tests/megatron/test_moe_overlap_train.py, gradient-exact: tests/runtime/test_combined_step.py)"),
    ("FP8, --tp-comm-overlap, TE kernels", "need a GPU"),
)


@dataclass(frozen=True)
class Row:
    """One run of the matrix."""

    schedule: str
    dp: str
    recompute: str
    layout: str
    vocab: bool
    tied: bool
    shape: str
    tp: int
    moe: bool
    model: str
    per_token_loss: bool
    bf16: bool

    @property
    def name(self) -> str:
        parts = [self.schedule, f"dp-{self.dp}", f"rc-{self.recompute}", f"layout-{self.layout}",
                 "vocab" if self.vocab else None, "tied" if self.tied else "untied", self.shape, f"tp{self.tp}",
                 "moe" if self.moe else None, self.model, "per-token" if self.per_token_loss else None,
                 "bf16" if self.bf16 else "fp32"]
        return ",".join(p for p in parts if p)

    @property
    def dp_size(self) -> int:
        return RANKS // (PP * self.tp)

    @property
    def script(self) -> str:
        return "pretrain_hybrid.py" if self.model == "hybrid" else "pretrain_gpt.py"

    @property
    def num_stages(self) -> int:
        return 2 * PP if self.schedule in V_SCHEDULES or self.schedule == "interleaved-1f1b" else PP

    # --- flags ------------------------------------------------------------------------------------

    @property
    def layout_in_pattern(self) -> bool:
        """interleaved-1f1b on HybridModel takes its chunks from the pattern's '|' segments (Megatron derives
        the virtual stages from them), so the layout goes there instead of into the flags."""
        return self.model == "hybrid" and self.schedule == "interleaved-1f1b"

    def _pattern(self, segmented: bool) -> str:
        symbols = ("*E" if self.moe else "*-") * (LAYERS // 2)
        if not segmented:
            return symbols
        counts = ([LAYERS // self.num_stages] * self.num_stages if self.layout == "uniform"
                  else [int(n) for n in explicit_layout(self.num_stages).split(",")])
        starts = list(itertools.accumulate([0, *counts]))
        return "|".join(symbols[a:b] for a, b in zip(starts, starts[1:]))

    def model_flags(self, segmented: bool = False) -> list[str]:
        """Megatron's flags that define the model and its maths (the reference shares them; ``segmented``: the
        row's own hybrid pattern, with its layout as '|' segments)."""
        flags = ["--cpu", "--pipeline-model-parallel-size", str(PP), "--hidden-size", "64", "--num-attention-heads", "4",
                 "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
                 "--global-batch-size", "16", "--train-iters", "3", "--lr", "1e-3", "--mock-data",
                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--log-interval", "1",
                 "--eval-interval", "3", "--eval-iters", "1"]
        if self.model == "hybrid":
            flags += ["--hybrid-layer-pattern", self._pattern(segmented)]
        else:
            flags += ["--num-layers", str(LAYERS)]
        if not self.tied:
            flags.append("--untie-embeddings-and-output-weights")
        if self.shape == "llama":  # the layers of NVIDIA's Llama-3 recipe
            flags += ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                      "--group-query-attention", "--num-query-groups", "2"]
        if self.tp > 1:
            flags += ["--tensor-model-parallel-size", str(self.tp)]
        if self.moe:
            flags += ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
                      "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2",
                      "--expert-model-parallel-size", "2", "--disable-bias-linear"]
            if self.tp > 1:  # EP with TP: the experts are not TP-sharded (EP x ETP within TP x DP)
                flags += ["--expert-tensor-parallel-size", "1"]
        if self.per_token_loss:
            flags.append("--calculate-per-token-loss")
        if self.bf16:
            flags.append("--bf16")
        return flags

    def timing_flags(self) -> list[str]:
        """Megatron's flags that change when its work runs, not its maths."""
        flags = {"none": [], "overlap-grad-reduce": ["--overlap-grad-reduce"],
                 "distributed-optimizer": ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                           "--overlap-param-gather"]}[self.dp]
        flags += {"none": [], "selective": ["--recompute-granularity", "selective"],
                  "full": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "1"]}[self.recompute]
        return flags

    def own_flags(self) -> list[str]:
        """Ours: the schedule, the vocabulary flag, the layout (and the virtual stages interleaving needs)."""
        flags = ["--pipeline-schedule", self.schedule]
        if self.schedule == "interleaved-1f1b" and not self.layout_in_pattern:
            flags += ["--num-virtual-stages-per-pipeline-rank", "2"]
        if self.vocab:
            flags.append("--pipeline-vocab-parallel")
        if self.layout_in_pattern:  # the '|' segments of the pattern (model_flags) carry it
            return flags
        if self.layout == "balanced":
            flags += ["--pipeline-layout", "balanced"]
        elif self.layout == "explicit":
            flags += ["--pipeline-layout", explicit_layout(self.num_stages)]
        return flags

    def flags(self) -> list[str]:
        return [*self.model_flags(segmented=self.layout_in_pattern), *self.timing_flags(), *self.own_flags()]

    def reference_key(self) -> tuple:
        """Rows with the same model flags share Megatron's reference run."""
        return (self.script, *self.model_flags())

    def reference_flags(self) -> list[str]:
        return [*self.model_flags(), "--pipeline-schedule", "1f1b"]

    def tolerance(self) -> float:
        """Relative, per printed loss. fp32: 1e-5 (the rows print Megatron's losses to the last digit or
        within 2e-7). bf16 rounds each sum once, so another order of the same sums can differ in the last
        bit, and the reference leaves out the DP options (Megatron's own 1F1B with the distributed optimizer
        is 1.1e-5 from it in bf16 with MoE). 1e-4 for dense models (the vocabulary shards sum the softmax
        statistics and the hidden state's gradient per shard, docs/vocab_parallel.md "Numerics"; measured at
        most 3.8e-5, with the flag at TP 2: four shards), 3e-4 with MoE, whose router sends a token whose
        top-2 scores differ by less than one bf16 rounding to another expert, which moves that token's loss
        by O(1) (measured up to 1.0e-4). The maths itself is held exactly by the fp32 rows (all within
        2.3e-7) and by the one-process gradient checks."""
        if not self.bf16:
            return 1e-5
        return 3e-4 if self.moe else 1e-4

    def as_dict(self) -> dict:
        return asdict(self)


def explicit_layout(stages: int) -> str:
    """An uneven layer count per stage (the first and last stages lighter, as for a head-heavy model)."""
    counts = {2: (3, 5), 4: (1, 3, 3, 1)}[stages]
    assert sum(counts) == LAYERS
    return ",".join(map(str, counts))


def allowed(values: dict) -> bool:
    """Whether a (partial) row holds no excluded pair: the generator's filter."""
    return not any(exclusion.forbids(values) for exclusion in EXCLUDED)


# The default tier's rows: one per schedule, every value of every factor, and only two models (the
# factors that change the maths: TP, MoE, embeddings, shape, GPTModel or HybridModel, per-token loss, dtype), so
# that its 10 rows need 2 reference runs. The covering array below is built around them.
_MODEL_A = dict(tp=1, moe=True, tied=True, shape="llama", model="gpt", per_token_loss=True, bf16=True)
_MODEL_B = dict(tp=2, moe=False, tied=False, shape="gpt", model="hybrid", per_token_loss=False, bf16=False)
DEFAULT_ROWS: tuple[Row, ...] = tuple(Row(schedule=schedule, dp=dp, recompute=recompute, layout=layout, vocab=vocab,
                                          **model) for schedule, model, dp, recompute, layout, vocab in (
    ("1f1b", _MODEL_A, "none", "none", "uniform", False),
    ("interleaved-1f1b", _MODEL_B, "none", "selective", "explicit", True),
    ("gpipe", _MODEL_A, "overlap-grad-reduce", "full", "balanced", True),
    ("zb-h1", _MODEL_B, "none", "full", "uniform", False),
    ("zb-1p", _MODEL_A, "distributed-optimizer", "selective", "explicit", False),
    ("zb-2p", _MODEL_B, "none", "none", "explicit", True),
    ("v-min", _MODEL_A, "distributed-optimizer", "full", "uniform", True),
    ("v-half", _MODEL_B, "none", "selective", "uniform", True),
    ("v-zb", _MODEL_A, "overlap-grad-reduce", "none", "balanced", True),
    ("v-auto", _MODEL_A, "distributed-optimizer", "selective", "balanced", False),
))


# The factors that define a model (its maths): rows with the same values of these share Megatron's reference
# run. The matrix draws them from a few models that hold every pair of their values between them, so the
# references stay few (each costs a 4-rank launch).
MODEL_FACTORS = ("tied", "shape", "tp", "moe", "model", "per_token_loss", "bf16")


def models() -> tuple[dict, ...]:
    """A pairwise covering array of the model factors, starting with the default tier's two models."""
    from allpairspy import AllPairs

    generated = [dict(zip(MODEL_FACTORS, values)) for values in AllPairs(
        [FACTORS[n] for n in MODEL_FACTORS], filter_func=lambda partial: allowed(dict(zip(MODEL_FACTORS, partial))))]
    # (allpairspy's previously_tested can leave pairs out, so the two default models come on top)
    return (_MODEL_A, _MODEL_B, *(m for m in generated if m not in (_MODEL_A, _MODEL_B)))


def rows() -> tuple[Row, ...]:
    """The default tier's rows, then a pairwise covering array of the schedule, the DP options, recomputation,
    the layout, the vocabulary flag and the model (one of :func:`models`), then rows for any pair of factor
    values still missing (deterministic: allpairspy takes no seed and the factors are ordered)."""
    from allpairspy import AllPairs

    catalogue = models()
    run_factors = [n for n in FACTORS if n not in MODEL_FACTORS]

    def values_of(partial: Sequence) -> dict:
        values = dict(zip(run_factors, partial))
        if len(partial) > len(run_factors):
            values.update(catalogue[partial[len(run_factors)]])
        return values

    previous = [(*(getattr(row, n) for n in run_factors), catalogue.index({n: getattr(row, n) for n in MODEL_FACTORS}))
                for row in DEFAULT_ROWS]
    generated = [*DEFAULT_ROWS, *(Row(**values_of(values)) for values in AllPairs(
        [*(FACTORS[n] for n in run_factors), range(len(catalogue))],
        filter_func=lambda partial: allowed(values_of(partial)), previously_tested=previous))]
    return tuple(generated + _completion(generated, catalogue))


# The matrix's launches are spread over this many test files (tests/megatron/test_feature_matrix_rows_*.py).
# CI's pytest-xdist workers take whole files (``--dist loadfile``), so one file would run every launch on
# one worker while the other sits idle.
SHARDS = 4


def shards(matrix: Sequence[Row] | None = None, count: int = SHARDS) -> tuple[tuple[Row, ...], ...]:
    """``matrix`` (default :func:`rows`) in ``count`` parts, each holding whole models: rows that share
    Megatron's reference run stay together, so each reference is launched once per tier. Balanced by
    launches (rows plus one reference per model), per tier (the default tier's rows, then the others):
    greedy, largest model first, into the part whose busier tier stays least busy."""
    matrix = rows() if matrix is None else matrix
    groups: dict[tuple, list[Row]] = {}
    for row in matrix:
        groups.setdefault(row.reference_key(), []).append(row)

    def launches(group: Sequence[Row]) -> tuple[int, int]:
        default = sum(row in DEFAULT_ROWS for row in group)
        extended = len(group) - default
        return default + (default > 0), extended + (extended > 0)

    loads = [(0, 0)] * count
    parts: list[list[Row]] = [[] for _ in range(count)]
    for group in sorted(groups.values(), key=lambda g: (-sum(launches(g)), matrix.index(g[0]))):
        cost = launches(group)
        best = min(range(count), key=lambda i: (max(loads[i][0] + cost[0], loads[i][1] + cost[1]), sum(loads[i]), i))
        loads[best] = (loads[best][0] + cost[0], loads[best][1] + cost[1])
        parts[best].extend(group)
    return tuple(tuple(sorted(part, key=matrix.index)) for part in parts)


def _completion(matrix: Sequence[Row], catalogue: Sequence[dict]) -> list[Row]:
    """Rows for the pairs the generator left out (allpairspy's filter can strand a few): each new row takes
    as many of them as agree, a model of the catalogue that agrees too, and the first allowed value of every
    other factor."""
    missing = uncovered_pairs(matrix)
    added: list[Row] = []
    while missing:
        values: dict = {}
        for pair in list(missing):
            trial = {**values, **dict(pair)}
            if (all(values.get(k, v) == v for k, v in pair) and allowed(trial)
                    and any(_agrees(model, trial) for model in catalogue)):
                values = trial
        values.update(next(model for model in catalogue if _agrees(model, values)))
        for name, choices in FACTORS.items():
            if name not in values:
                values[name] = next(v for v in choices if allowed({**values, name: v}))
        added.append(Row(**values))
        missing = uncovered_pairs([*matrix, *added])
    return added


def _agrees(model: dict, values: dict) -> bool:
    return all(values.get(name, value) == value for name, value in model.items()) and allowed({**values, **model})


def uncovered_pairs(matrix: Sequence[Row]) -> list[tuple[tuple[str, object], tuple[str, object]]]:
    """Every allowed pair of factor values that no row of ``matrix`` holds (empty for a covering array)."""
    held = set()
    for row in matrix:
        values = {f.name: getattr(row, f.name) for f in fields(Row)}
        for a, b in itertools.combinations(FACTORS, 2):
            held.add(((a, values[a]), (b, values[b])))
    missing = []
    for a, b in itertools.combinations(FACTORS, 2):
        for va, vb in itertools.product(FACTORS[a], FACTORS[b]):
            if allowed({a: va, b: vb}) and ((a, va), (b, vb)) not in held:
                missing.append(((a, va), (b, vb)))
    return missing
