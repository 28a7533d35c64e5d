"""``vshape check-flags``: NVIDIA's Llama-3 8B FP8 recipe (model, FP8, CP 2, sequence parallel, DP overlap)
checked with V schedules before a job, under a declared Transformer Engine version.

The recipe's flags are copied from Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh (its model,
FP8 and DDP arrays); the parallel sizes are the issue's (TP 2, CP 2, PP 4: 16 ranks). One process
(megatron-core 0.19, which has megatron.training) checks every line, importing Megatron once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from glue_support import ROOT, cpu_env

RECIPE_MODEL = ("--use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
                "--group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 "
                "--max-position-embeddings 8192 --position-embedding-type rope --rotary-base 1000000 "
                "--rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --normalization RMSNorm "
                "--init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p "
                "--untie-embeddings-and-output-weights --disable-bias-linear")
RECIPE_TRAINING = ("--micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000 --lr 0.00015 --min-lr 0.00001 "
                   "--lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --bf16 --grad-reduce-in-bf16 "
                   "--cross-entropy-loss-fusion --calculate-per-token-loss --mock-data --tokenizer-type NullTokenizer "
                   "--vocab-size 128256 --eval-iters 32 --eval-interval 100")
RECIPE_FP8 = "--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather"
RECIPE_DDP = "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
PARALLEL = "--tensor-model-parallel-size 2 --context-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 4"
LLAMA = " ".join((RECIPE_MODEL, RECIPE_TRAINING, RECIPE_FP8, RECIPE_DDP, PARALLEL)).split()

CASES = {  # name: (vshape check-flags arguments before "--", flags after it)
    "v-half TE 2.8": (["--te-version", "2.8"], LLAMA + ["--pipeline-schedule", "v-half"]),
    "v-zb TE 2.8": (["--te-version", "2.8"], LLAMA + ["--pipeline-schedule", "v-zb"]),
    "v-half TE 2.2": (["--te-version", "2.2"], LLAMA + ["--pipeline-schedule", "v-half"]),
    "v-zb TE 2.8 tp-comm-overlap": (["--te-version", "2.8"], LLAMA + ["--pipeline-schedule", "v-zb", "--tp-comm-overlap"]),
    "v-half TE 2.2 tp-comm-overlap": (["--te-version", "2.2"], [f for f in LLAMA if not f.startswith("--fp8")
                                      and f not in ("hybrid", "1024", "max")] + ["--pipeline-schedule", "v-half",
                                                                                 "--tp-comm-overlap"]),
    "v-half no TE": (["--te-version", "none"], LLAMA + ["--pipeline-schedule", "v-half"]),
    "v-half bad layers": (["--te-version", "2.8"], LLAMA + ["--pipeline-schedule", "v-half", "--num-layers", "30"]),
}
# --pipeline-vocab-parallel at TP 2 with the recipe's DP flags (no CP: the flag refuses it), as the planner
# recommends it: megatron-core 0.19 sets --tensor-parallel-num-weight-shards to the TP size by default.
VOCAB_TP2 = [*RECIPE_MODEL.split(), *RECIPE_TRAINING.split(), *RECIPE_DDP.split(), "--tensor-model-parallel-size", "2",
             "--sequence-parallel", "--pipeline-model-parallel-size", "4", "--pipeline-schedule", "v-half",
             "--pipeline-vocab-parallel"]
CASES["vocab TP 2"] = (["--te-version", "2.8"], VOCAB_TP2)
CASES["vocab TP 2 GTP 4"] = (["--te-version", "2.8"], [*VOCAB_TP2, "--tensor-parallel-num-weight-shards", "4"])

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402  (the TE loss runs scripts/gpu_check.sh launches)

for _name, _gpus, _extra, _schedule, _, *_compared_only in gpu_check.TE_LOSS_RUNS:
    for _sched, _more in ((_schedule, " ".join(_compared_only).split()), ("1f1b", [])):
        CASES[f"gpu_check {_name} {_sched}"] = (["--te-version", "2.8", "--world-size", str(_gpus)],
                                                [*gpu_check.LOSS_MODEL.split(), *_extra.split(), "--pipeline-schedule", _sched,
                                                 *_more])

DRIVER = textwrap.dedent("""
    import contextlib, io, json, sys
    from megatron_vshape.cli import main
    results = {}
    for name, (own, flags) in json.loads(sys.stdin.read()).items():
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["check-flags", *own, "--", *flags])
        lines = [ln for ln in (out.getvalue() + err.getvalue()).splitlines() if ln.startswith(("accepted", "vshape:"))]
        results[name] = [code, lines]
    print("RESULT" + json.dumps(results))
""")


@pytest.fixture(scope="module")
def verdicts(mc19_python):
    result = subprocess.run([mc19_python, "-c", DRIVER], input=json.dumps(CASES), capture_output=True, text=True,
                            timeout=240, cwd=ROOT, env=cpu_env())
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("RESULT")]
    assert lines, result.stderr[-3000:]
    return json.loads(lines[0][len("RESULT"):])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["v-half", "v-zb"])
def test_llama3_8b_fp8_recipe_is_accepted_with_te_2_8_on_the_te_route(verdicts, schedule):
    code, lines = verdicts[f"{schedule} TE 2.8"]
    assert code == 0 and lines == [f"accepted: --pipeline-schedule {schedule}, layer spec "
                                   "megatron_vshape.megatron.layer_spec:gpt_te_split_layer_spec, split route: TE deferral"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_refusals_are_one_line_exit_2_and_name_the_flag(verdicts):
    code, lines = verdicts["v-half TE 2.2"]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("vshape: error: --fp8-format needs Transformer Engine's")
    assert "TE >= 2.3" in lines[0]
    code, lines = verdicts["v-half TE 2.2 tp-comm-overlap"]
    assert code == 2 and lines[0].startswith("vshape: error: --tp-comm-overlap conflicts with --pipeline-schedule v-half")
    code, lines = verdicts["v-half no TE"]
    assert code == 2 and lines[0].startswith("vshape: error: --fp8-format"), lines
    code, lines = verdicts["v-half bad layers"]
    assert code == 2 and lines[0].startswith("vshape: error: --num-layers 30"), lines


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp_comm_overlap_is_accepted_on_the_te_route(verdicts):
    code, lines = verdicts["v-zb TE 2.8 tp-comm-overlap"]
    assert code == 0 and lines[0].endswith("split route: TE deferral"), lines


def test_check_flags_needs_the_double_dash_and_a_valid_version(capsys):
    from megatron_vshape.cli import main

    assert main(["check-flags", "--te-version", "2.8"]) == 2
    assert "give the training flags after '--'" in capsys.readouterr().err
    assert main(["check-flags", "--te-version", "two", "--", "--num-layers", "2"]) == 2
    assert "--te-version: expected X.Y or X.Y.Z (e.g. 2.8), got 'two'" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_gpu_check_te_runs_pass_the_start_up_checks(verdicts):
    """What scripts/gpu_check.sh launches must get past the checks (TE route for the split schedule)."""
    for name, _, _, schedule, *_ in gpu_check.TE_LOSS_RUNS:
        code, lines = verdicts[f"gpu_check {name} {schedule}"]
        assert code == 0 and lines[0].endswith("split route: TE deferral"), (name, lines)
        code, lines = verdicts[f"gpu_check {name} 1f1b"]
        assert code == 0 and lines[0].endswith("split route: no split on Transformer Engine"), (name, lines)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_vocabulary_flag_at_tp_2_is_accepted_and_real_weight_sharding_refused(verdicts):
    code, lines = verdicts["vocab TP 2"]
    assert code == 0 and lines[0].startswith("accepted: --pipeline-schedule v-half"), lines
    code, lines = verdicts["vocab TP 2 GTP 4"]
    assert code == 2 and lines == ["vshape: error: --pipeline-vocab-parallel: --tensor-parallel-num-weight-shards "
                                   "above the TP size (2) shards Megatron's embedding weight itself; drop it (Megatron "
                                   "then takes the TP size)"], lines
