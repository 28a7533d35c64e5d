"""`vshape plan` from Megatron's own flags: recipes, Megatron's parser, FLOPs against Megatron's formula.

The tests that need megatron.training (Megatron-LM's parser, ``num_floating_point_operations``,
``theoretical_memory_usage``) run in the 0.19.2 environment; the 0.16.1 one has megatron-core alone,
where the subset parser is what runs (tested here against the same recipes).
"""

from __future__ import annotations

import argparse
import functools
import math
import typing
from pathlib import Path

import pytest

from megatron_vshape.cli_parser import UsageError
from megatron_vshape.planner import CostModel, ParallelLayout, get_gpu, predict
from megatron_vshape.planner.command import recipe_flags as plan_flags
from megatron_vshape.planner.megatron_args import parse_flags
from megatron_vshape.planner.recipe import recipe_flags

EXAMPLES = Path(__file__).resolve().parents[2] / "shared/clients/megatron-lm-core_v0.19.0/examples"
LLAMA = EXAMPLES / "llama/train_llama3_8b_h100_fp8.sh"
MIXTRAL = EXAMPLES / "mixtral/train_mixtral_8x7b_distributed.sh"
GPT3 = EXAMPLES / "gpt3/train_gpt3_175b_distributed.sh"
needs_examples = pytest.mark.skipif(not LLAMA.exists(), reason="Megatron-LM examples not in ../shared/clients")


def _megatron_training():
    if not hasattr(typing, "override"):
        typing_extensions = pytest.importorskip("typing_extensions")
        typing.override = typing_extensions.override
    return pytest.importorskip("megatron.training.arguments", reason="megatron.training not installed (0.16.1 env)")


@functools.cache
def _parser() -> argparse.ArgumentParser:
    return _megatron_training().add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


def megatron_args(flags: list[str]) -> argparse.Namespace:
    """Megatron-LM's own parser over ``flags``, with validate_args' derived sizes (no distributed init)."""
    args = _parser().parse_args(flags)
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = int(4 * args.hidden_size * 2 / 3 / 64) * 64 if args.swiglu else 4 * args.hidden_size
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    args.padded_vocab_size = math.ceil(args.vocab_size / multiple) * multiple
    return args


BASE = ["--seq-length", "4096", "--vocab-size", "50257", "--micro-batch-size", "1", "--global-batch-size", "64"]
SHAPES = {
    "dense": ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16"],
    "gqa": ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--group-query-attention",
            "--num-query-groups", "4"],
    "swiglu": ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--swiglu"],
    "llama-8b": ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads",
                 "32", "--group-query-attention", "--num-query-groups", "8", "--kv-channels", "128", "--swiglu",
                 "--disable-bias-linear", "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights"],
    "mixtral": ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads",
                "32", "--group-query-attention", "--num-query-groups", "8", "--swiglu", "--num-experts", "8",
                "--moe-router-topk", "2", "--disable-bias-linear"],
    "moe-shared": ["--num-layers", "12", "--hidden-size", "2048", "--num-attention-heads", "16", "--num-experts",
                   "16", "--moe-router-topk", "4", "--moe-ffn-hidden-size", "1408",
                   "--moe-shared-expert-intermediate-size", "2816", "--moe-layer-freq", "2", "--swiglu"],
    "hybrid-mamba": ["--hidden-size", "2048", "--num-attention-heads", "16", "--hybrid-layer-pattern", "M*-M*-ME",
                     "--num-layers", "8", "--num-experts", "8", "--moe-router-topk", "2", "--group-query-attention",
                     "--num-query-groups", "8", "--mamba-num-heads", "64"],
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_flops_equal_megatrons_num_floating_point_operations(shape):
    """The MFU numerator is the number Megatron's throughput log uses, within 1 % (here: to 1e-9)."""
    flags = SHAPES[shape] + BASE
    args = megatron_args(flags)
    from megatron.training.training import num_floating_point_operations

    model = parse_flags(flags).model
    expected = num_floating_point_operations(args, 64)
    assert model.model_flops(64) == pytest.approx(expected, rel=1e-9), shape


def test_weight_memory_matches_megatrons_theoretical_memory_usage():
    """Parameters per GPU (dense model, PP 1 view) against compute_weight_and_optimizer_memory."""
    flags = SHAPES["llama-8b"] + BASE
    args = megatron_args(flags)
    args.world_size, args.data_parallel_size, args.expert_tensor_parallel_size = 8, 8, 1
    from megatron.training.theoretical_memory_usage import compute_weight_and_optimizer_memory

    model = parse_flags(flags).model
    megatron_bytes = compute_weight_and_optimizer_memory(args)
    # Megatron: 18 bytes/param without the distributed optimizer (6 + 12), the planner's bytes_per_param(1)
    assert model.total_params * 18 == pytest.approx(megatron_bytes, rel=0.01)


@needs_examples
@pytest.mark.parametrize("path, layers, experts, fp8", [(LLAMA, 32, 0, True), (MIXTRAL, 32, 8, False),
                                                        (GPT3, 96, 0, False)])
def test_recipes_read_with_shell_expansion_and_both_parsers_agree(path, layers, experts, fp8):
    words = recipe_flags(path)
    assert "--num-layers" in words and str(layers) == words[words.index("--num-layers") + 1]  # $NUM_LAYERS expanded
    subset = parse_flags(words, use_megatron=False)
    assert subset.model.layers == layers and subset.model.num_experts == experts and subset.fp8 == fp8
    assert subset.global_batch in (128, 256, 1536)
    real = parse_flags(words)  # Megatron-LM's parser where megatron.training imports, else the subset again
    if real.parser.startswith("megatron-lm"):
        assert real.model == subset.model and real.fp8 == subset.fp8 and real.global_batch == subset.global_batch


@needs_examples
def test_llama_recipe_conditionals_and_arrays():
    words = recipe_flags(LLAMA)
    # DTYPE=fp8 makes the if-branch add its array; MOCK data takes the if-branch, not the else
    assert words[words.index("--fp8-format") + 1] == "hybrid"
    assert "--mock-data" in words and "--data-path" not in words
    assert words[words.index("--vocab-size") + 1] == "128256"


def test_bad_recipe_and_missing_flags_are_one_line_errors(tmp_path):
    with pytest.raises(UsageError, match="--from-recipe .*no such file"):
        recipe_flags(tmp_path / "none.sh")
    script = tmp_path / "r.sh"
    script.write_text("A=1\necho $A\n")
    with pytest.raises(UsageError, match=r"no line runs a \*\.py"):
        recipe_flags(script)
    with pytest.raises(UsageError, match="--hidden-size is required"):
        parse_flags(["--num-layers", "2"], use_megatron=False)


def test_any_layer_count_gets_an_uneven_layout_for_every_v_schedule():
    """Llama-3 8B (32 layers: 32 + 2 does not divide 8 stages) on PP 4: no divisibility rule hides it."""
    model = parse_flags(SHAPES["llama-8b"] + ["--seq-length", "8192", "--vocab-size", "128256"],
                        use_megatron=False).model
    cost = CostModel(get_gpu("h100"), 0.5, fp8=True)
    for name in ("v-half", "v-zb", "1f1b"):
        pred = predict(name, ParallelLayout(4, 2, 4, 1, 64, recompute="selective"), model, cost, flash_attention=True)
        assert sum(pred.layers_per_stage) == 32 and len(pred.layers_per_stage) == (4 if name == "1f1b" else 8)
        assert 0 < pred.mfu < 1 and not pred.oom


def test_recompute_and_overlap_change_the_prediction_the_right_way():
    model = parse_flags(SHAPES["llama-8b"] + ["--seq-length", "8192", "--vocab-size", "128256"],
                        use_megatron=False).model
    layout = ParallelLayout(8, 1, 4, 1, 128)
    plain = predict("v-half", layout, model, CostModel(get_gpu("h100"), 0.5), True)
    full = predict("v-half", ParallelLayout(8, 1, 4, 1, 128, recompute="full"), model, CostModel(get_gpu("h100"), 0.5), True)
    overlap = predict("v-half", layout, model, CostModel(get_gpu("h100"), 0.5, overlap_grad_reduce=True,
                                                         overlap_param_gather=True), True)
    assert full.memory.peak_activation < plain.memory.peak_activation and full.iteration_time > plain.iteration_time
    assert overlap.dp_exposed < plain.dp_exposed and overlap.iteration_time < plain.iteration_time
    with pytest.raises(ValueError, match="--fp8-format: A100"):
        CostModel(get_gpu("a100"), fp8=True)


def test_printed_flags_parse_with_megatrons_parser_and_the_plugins():
    """The answer is a command: Megatron's real parser (plus the plugin's flags) takes every word."""
    arguments = _megatron_training()
    from megatron_vshape.megatron.arguments import add_arguments

    parser = add_arguments(arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    words = plan_flags("v-half", ParallelLayout(2, 2, 4, 1, 512, cp=2, ep=1, recompute="full"), (3, 4, 4, 5, 5, 4, 4, 3))
    args = parser.parse_args(SHAPES["llama-8b"] + BASE[:4] + words)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size) == (2, 4, 2)
    assert args.pipeline_schedule == "v-half" and args.pipeline_layout == "3,4,4,5,5,4,4,3"
    assert args.recompute_granularity == "full" and args.recompute_num_layers == 1
    assert args.global_batch_size == 512 and args.sequence_parallel


def test_plan_from_megatron_flags_prints_a_row_and_a_command_per_schedule(capsys):
    """`vshape plan ... -- <Megatron flags>`: every schedule, V-Half and V-ZB included, gets a row and flags."""
    from megatron_vshape.planner.cli import main as plan_main

    megatron = SHAPES["llama-8b"] + ["--seq-length", "2048", "--vocab-size", "128256", "--fp8-format", "hybrid"]
    narrow = ["--tp", "1", "--pp", "4", "--cp", "1", "--micro-batch", "1", "--recompute", "none,selective"]
    assert plan_main(["--gpus", "16", "--gpu", "h100", "--global-batch-size", "64", *narrow, "--no-layouts",
                      "--", *megatron]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if "MFU" in line}
    assert set(rows) == {"1f1b", "zb-1p", "v-min", "v-half", "v-zb"}, out
    commands = {line.split()[0]: line for line in out.splitlines() if "--pipeline-schedule" in line}
    for name in ("v-half", "v-zb"):
        words = commands[name].split()
        assert words[words.index("--pipeline-schedule") + 1] == name
        layout = [int(x) for x in words[words.index("--pipeline-layout") + 1].split(",")]
        assert len(layout) == 8 and sum(layout) == 32  # 32 layers on 8 V stages: uneven, no divisibility rule


def test_plan_grid_flags_need_megatron_flags(capsys):
    from megatron_vshape.planner.cli import main as plan_main

    assert plan_main(["--model", "9.6b", "--gpus", "16", "--global-batch", "64", "--cp", "2"]) == 2
    assert "--cp applies to Megatron flags" in capsys.readouterr().err
