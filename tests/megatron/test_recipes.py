"""Megatron-LM's own recipes under every schedule: its real ``pretrain_gpt.py``, CPU, 4 ranks.

The CPU-runnable flags of NVIDIA's example recipes in Megatron-LM core_v0.19.0 (``examples/llama/
train_llama3_8b_h100_fp8.sh``, ``examples/mixtral/train_mixtral_8x7b_distributed.sh``,
``examples/gpt3/train_gpt3_175b_distributed.sh``), scaled down: the Llama shape, the distributed
optimizer with DP overlap (``--overlap-grad-reduce --overlap-param-gather``), recomputation, and MoE
with expert parallelism (alltoall dispatcher, auxiliary loss). FP8, ``--moe-grouped-gemm`` and sequence
parallelism need Transformer Engine / apex (GPU, the TE issue).

Each recipe runs under Megatron's own 1F1B **without** its overlap and recomputation flags (the
reference: those flags change when work runs, never the maths) and under a schedule with every flag;
the lm loss must agree to 1e-5 at every iteration. So one comparison says both "same losses as
Megatron's 1F1B" and "the overlap flags do not change the losses". ``-m extended`` runs every recipe
under 1f1b (with its flags), zb-1p, v-min, v-half and v-zb (``docs/recipes.md`` has that run); the default
run keeps only the MoE gradient check (a 4-rank launch costs about a minute of a 2-core machine).

The gradient-exact checks of the same features against a one-process run (PP 2 and 4, MoE with EP 2)
are ``test_moe_recipe_gradients_exact`` here (megatron-core 0.19: 0.16.1's router needs TE) and
``tests/runtime/test_executor_exact.py`` (DP overlap, recomputation).
"""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest
from glue_support import LOSS, ROOT, cpu_env, launch_ranks
from test_real_client import client_dir  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow  # launches processes: not in the fast tier (-m "not slow")

TINY = ("--cpu --num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --train-iters 3 --lr 1e-3 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 128 --log-interval 1 --eval-interval 100 --eval-iters 0").split()
LLAMA_SHAPE = ("--swiglu --normalization RMSNorm --position-embedding-type rope --group-query-attention "
               "--num-query-groups 2 --disable-bias-linear --untie-embeddings-and-output-weights").split()
DP_OVERLAP = "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather".split()


class Recipe:
    """Scaled-down flags of one example recipe: the model and sizes, and the flags that only change
    when work runs (overlap, recomputation), which the reference run leaves out."""

    def __init__(self, model: str, timing: str):
        self.model, self.timing = model.split(), timing.split()


RECIPES = {
    # Llama 3: DP 2 x PP 2, distributed optimizer with DP overlap, per-token loss, selective recomputation.
    "llama3": Recipe(" ".join(LLAMA_SHAPE) + " --calculate-per-token-loss --pipeline-model-parallel-size 2 "
                     "--global-batch-size 16", " ".join(DP_OVERLAP) + " --recompute-granularity selective"),
    # Mixtral: EP 2 x PP 2 (inside DP 2), alltoall dispatcher, auxiliary loss, DP overlap.
    "mixtral": Recipe(" ".join(LLAMA_SHAPE) + " --num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type "
                      "aux_loss --moe-aux-loss-coeff 1e-2 --moe-token-dispatcher-type alltoall "
                      "--expert-model-parallel-size 2 --pipeline-model-parallel-size 2 --global-batch-size 16",
                      " ".join(DP_OVERLAP)),
    # GPT-3 175B: pipeline-heavy (PP 4 here), full recomputation.
    "gpt3": Recipe("--pipeline-model-parallel-size 4 --global-batch-size 16",
                   "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"),
}
ALL_SCHEDULES = ("1f1b", "zb-1p", "v-min", "v-half", "v-zb")
# Every recipe x schedule runs with -m extended (two 4-rank launches each, about three minutes of CI's
# 2-core machine); the default run keeps the MoE recipe's gradient exactness below (EP 2, DP overlap,
# every split schedule against one process).
# The Llama-3 and Mixtral recipes' features (the Llama shape, untied embeddings, per-token loss, the DP options,
# recomputation, MoE with EP 2) are factors of the pairwise feature matrix (test_feature_matrix.py), which crosses
# them with every schedule and with each other; here only GPT-3's PP 4 with full recomputation runs.
MATRIX_RECIPES = ("llama3", "mixtral")
CASES = [pytest.param(recipe, schedule, marks=pytest.mark.extended)
         for recipe in RECIPES if recipe not in MATRIX_RECIPES for schedule in ALL_SCHEDULES]
RUN_TIMEOUT = 300


def train(python: str, client, schedule: str, flags: list[str]) -> dict[int, float]:
    return losses_of(train_output(python, client, schedule, flags))


def train_output(python: str, client, schedule: str, flags: list[str]) -> str:
    """The ranks' output of a 3-iteration run that must succeed."""
    result = launch_ranks(python, 4, ["-m", "megatron_vshape.run", str(client / "pretrain_gpt.py")],
                          ["--pipeline-schedule", schedule, *TINY, *flags], timeout=RUN_TIMEOUT)
    assert result.returncode == 0, f"{schedule} exited {result.returncode}:\n{result.stdout[-5000:]}"
    return result.stdout


def losses_of(output: str) -> dict[int, float]:
    losses = {int(i): float(v) for i, v in LOSS.findall(output)}
    assert sorted(losses) == [1, 2, 3], output[-3000:]
    return losses


@pytest.fixture(scope="module")
def references(mc19_python, client_dir) -> dict:  # noqa: F811 (client_dir: the fixture above)
    """Megatron's own 1F1B on each recipe, without the flags that only change when work runs (trained on
    first use: only the recipes whose tests run)."""
    cache: dict[str, dict[int, float]] = {}

    def reference(name: str) -> dict[int, float]:
        if name not in cache:
            cache[name] = train(mc19_python, client_dir, "1f1b", RECIPES[name].model)
        return cache[name]
    return reference


@pytest.mark.timeout(6 * RUN_TIMEOUT)
@pytest.mark.parametrize("recipe,schedule", CASES)
def test_recipe_trains_like_megatron_1f1b(mc19_python, client_dir, references, recipe, schedule):  # noqa: F811
    losses = train(mc19_python, client_dir, schedule, RECIPES[recipe].model + RECIPES[recipe].timing)
    for i, want in references(recipe).items():
        assert abs(losses[i] - want) <= 1e-5 * abs(want), (recipe, schedule, i, want, losses[i])


MOE_EXACT = textwrap.dedent("""
    import json, sys
    from megatron_vshape.testing.recipe_workers import RecipeSpec, run_recipe_check

    if __name__ == "__main__":
        out = {}
        pp = int(sys.argv[1])
        schedules = {2: ("1f1b", "zb-1p", "v-min", "v-half", "v-zb"), 4: ("1f1b", "v-half", "v-zb")}[pp]
        out[f"pp{pp}"] = run_recipe_check(RecipeSpec(
            schedules=schedules, pp=pp, dp=2, ep=2, num_experts=4, overlap_grad_reduce=True,
            sync_bucket_launch=True, iterations=2, recompute=("none", "selective")), timeout=400)
        print("RESULT" + json.dumps(out))
""")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("pp", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_moe_recipe_gradients_exact(mc19_python, tmp_path, pp):
    """MoE (4 experts, top-2, alltoall, aux loss) with EP 2 inside DP 2, at PP 2 and 4, with DP overlap and
    selective recomputation, two iterations: every gradient (experts and router included) equals a
    one-process run's, and every bucket launched before finalize_model_grads."""
    script = tmp_path / "moe_exact.py"
    script.write_text(MOE_EXACT)
    proc = subprocess.run([mc19_python, str(script), str(pp)], capture_output=True, text=True, timeout=560,
                          env=cpu_env(), cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-4000:]
    out = json.loads(lines[-1][len("RESULT"):])
    for config, rows in out.items():
        assert len(rows) == (10 if config == "pp2" else 6), (config, sorted(rows))
        for name, row in rows.items():
            assert row["num_losses"] == 8, (config, name, row)
            assert row["max_grad_rel_err"] <= 1e-6, (config, name, row)
            assert row["max_loss_abs_err"] <= 1e-6, (config, name, row)
            assert row["late_launches"] == [0, 0] and row["early_launches"] == [row["buckets"]] * 2, (config, name, row)
            assert name.startswith("1f1b") or row["wgrad_deferred"] > 0, (config, name, row)


# Megatron's combined interleaved 1F1B (--overlap-moe-expert-parallel-comm, which needs bf16 and virtual stages):
# PP 2 x 2 virtual stages, EP 2, 4 experts, top-2, alltoall. It runs its MoE dispatch and combine as schedule
# nodes on streams and events, which CPU mode's stand-ins serve (megatron_vshape/megatron/cpu_streams.py).
COMBINED_1F1B = ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
                 "--expert-model-parallel-size 2 --num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type "
                 "alltoall --global-batch-size 16 --bf16").split()


@pytest.mark.extended
@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_megatron_combined_interleaved_1f1b_trains_on_cpu(mc19_python, client_dir):  # noqa: F811
    """The reference run of issue 43 trains through pretrain_gpt.py with the flag on (without the stand-ins it
    stops at record_stream). Its bf16 losses are the plain interleaved order's: the schedule-invariant dropout
    reseeds the layers the combined step runs from the schedule plan (megatron/dropout_seed.py); before it did,
    the plan's nodes drew the masks from running RNG streams in their own order (iteration 1 printed 4.881532;
    V-ZB without the flag, the same model, 4.883769)."""
    result = launch_ranks(mc19_python, 4, ["-m", "megatron_vshape.run", str(client_dir / "pretrain_gpt.py")],
                          ["--pipeline-schedule", "interleaved-1f1b", *TINY, *COMBINED_1F1B,
                           "--overlap-moe-expert-parallel-comm"], timeout=RUN_TIMEOUT)
    assert result.returncode == 0, result.stdout[-5000:]
    assert "overlap_moe_expert_parallel_comm ................ True" in result.stdout
    combined = {int(i): float(v) for i, v in LOSS.findall(result.stdout)}
    plain = train(mc19_python, client_dir, "interleaved-1f1b", COMBINED_1F1B)
    assert sorted(combined) == [1, 2, 3] and combined[3] < combined[1], combined
    for i, want in plain.items():
        assert abs(combined[i] - want) <= 1e-5 * want, (i, want, combined[i], combined, plain)

