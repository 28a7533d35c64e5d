"""Bad flag combinations fail with one line naming the flag and the fix (pure argparse, no torch)."""

import argparse

import pytest

from megatron_vshape.megatron import arguments as vargs
from megatron_vshape.megatron import checks as vchecks
from megatron_vshape.megatron import flags as vflags
from megatron_vshape.megatron.arguments import ConfigError, add_arguments, resolve_defaults, validate
from megatron_vshape.megatron.checks import problems


def megatron_like(**overrides) -> argparse.Namespace:
    """The Namespace Megatron's parser gives for the issue's CPU example (before its validate_args)."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--distributed-backend", default="nccl")
    parser.add_argument("--transformer-impl", default="transformer_engine")
    add_arguments(parser)
    args = parser.parse_args(["--pipeline-schedule", "v-half", "--cpu"])
    base = dict(
        world_size=4, tensor_model_parallel_size=1, pipeline_model_parallel_size=4, context_parallel_size=1,
        num_layers=8, micro_batch_size=2, global_batch_size=16, gradient_accumulation_fusion=True,
        overlap_grad_reduce=False, recompute_granularity=None, fp16=False,
    )
    for key, value in {**base, **overrides}.items():
        setattr(args, key, value)
    return args


def test_valid_example_passes_and_resolves_cpu_defaults():
    args = validate(megatron_like())
    assert args.distributed_backend == "gloo"
    assert args.transformer_impl == "local"
    assert args.gradient_accumulation_fusion is False
    assert args.schedule_invariant_dropout is True


def test_cpu_rejects_an_explicit_nccl_but_not_megatrons_default():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--distributed-backend", default="nccl", type=str)  # as Megatron's: typed
    add_arguments(parser)
    default = parser.parse_args(["--cpu"])
    assert default.distributed_backend == "nccl" and not vflags.was_given(default, "distributed_backend")
    assert validate(default).distributed_backend == "gloo"
    assert type(default.distributed_backend) is str
    with pytest.raises(ConfigError, match="--cpu needs the gloo backend"):
        validate(parser.parse_args(["--cpu", "--distributed-backend", "nccl"]))
    assert validate(parser.parse_args(["--cpu", "--distributed-backend", "gloo"])).distributed_backend == "gloo"


def test_defaults_keep_megatron_behaviour():
    args = resolve_defaults(megatron_like(pipeline_schedule=None, cpu=False))
    assert args.distributed_backend == "nccl"
    assert args.transformer_impl == "transformer_engine"
    assert args.gradient_accumulation_fusion is True
    assert args.schedule_invariant_dropout is False
    assert type(args.distributed_backend) is str and type(args.transformer_impl) is str


def test_v_schedule_accepts_paper_shapes_with_embedding_and_loss_counted():
    args = megatron_like(num_layers=30, world_size=16, pipeline_model_parallel_size=16, global_batch_size=32,
                         account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    assert problems(args) == []


def test_validate_is_idempotent_and_sets_two_v_chunks():
    args = validate(megatron_like())
    assert args.num_virtual_stages_per_pipeline_rank == 2
    assert validate(args) is args


def test_help_names_every_schedule_and_which_keep_megatron_functions():
    text = add_arguments(argparse.ArgumentParser()).format_help()
    for name in vflags.SCHEDULE_CHOICES:
        assert name in text
    assert "1f1b (one-forward-one-backward (Megatron's default); runs on Megatron's own function)" in " ".join(text.split())


BAD = {
    "unknown-schedule": (dict(pipeline_schedule="v-quarter"), "--pipeline-schedule"),
    "pp1": (dict(pipeline_model_parallel_size=1, world_size=1), "--pipeline-model-parallel-size >= 2"),
    "pp1-megatron-own": (dict(pipeline_schedule="1f1b", pipeline_model_parallel_size=1, world_size=1),
                         "--pipeline-model-parallel-size >= 2"),
    "world-not-multiple": (dict(world_size=6), "world size 6"),
    "v-layers": (dict(num_layers=12), "--num-layers 12 must be divisible by 2 x"),
    "v-min-layers": (dict(pipeline_schedule="v-min", num_layers=4), "--num-layers 4"),
    "memory-limit-zero": (dict(pipeline_schedule="v-auto", pipeline_memory_limit=0.0), "(0, 1]"),
    "memory-limit-above-one": (dict(pipeline_schedule="v-auto", pipeline_memory_limit=1.5), "(0, 1]"),
    "memory-limit-without-auto": (dict(pipeline_memory_limit=0.5), "only to --pipeline-schedule v-auto"),
    "too-few-microbatches": (dict(pipeline_schedule="interleaved-1f1b", num_virtual_stages_per_pipeline_rank=2,
                                  global_batch_size=4), "needs a multiple of 4 microbatches (Megatron's rule); got 2; "
                                  "use --global-batch-size 8 (4 microbatches)"),
    "batch-not-divisible": (dict(global_batch_size=15), "--global-batch-size 15 must be a multiple"),
    "interleaved-without-chunks": (dict(pipeline_schedule="interleaved-1f1b"), "--num-virtual-stages-per-pipeline-rank 2"),
    "1f1b-with-vpp": (dict(pipeline_schedule="1f1b", num_virtual_stages_per_pipeline_rank=2),
                      "drop --num-virtual-stages-per-pipeline-rank or use --pipeline-schedule interleaved-1f1b"),
    "zb-with-layout": (dict(pipeline_schedule="zb-1p", pipeline_model_parallel_layout="Et|t|t|tL"),
                       "--pipeline-model-parallel-layout gives each rank several model chunks"),
    "v-with-vpp": (dict(num_virtual_stages_per_pipeline_rank=2), "--num-virtual-stages-per-pipeline-rank cannot"),
    "v-with-layout": (dict(pipeline_model_parallel_layout="Et*4|t*4L"), "--pipeline-model-parallel-layout"),
    "v-uneven-first": (dict(decoder_first_pipeline_num_layers=1), "--decoder-first-pipeline-num-layers"),
    "v-embedding-split": (dict(num_layers=8, account_for_embedding_in_pipeline_split=True), "(+1 for embedding/loss = 9)"),
    "interleaved-short-group": (dict(pipeline_schedule="interleaved-1f1b", num_virtual_stages_per_pipeline_rank=2,
                                     global_batch_size=2 * 6), "gives 6 microbatches at PP=4: interleaved-1f1b with 4 "
                                     "devices needs a multiple of 4 microbatches"),
    "cpu-nccl": (dict(distributed_backend="nccl"), "--cpu needs the gloo backend"),
    "cpu-te": (dict(transformer_impl="transformer_engine"), "--transformer-impl local"),
    "cpu-fp16": (dict(fp16=True), "--fp16 is CUDA-only"),
    "cpu-sequence-parallel": (dict(tensor_model_parallel_size=2, world_size=8, sequence_parallel=True),
                              "--sequence-parallel needs apex"),
    "split-delay-wgrad": (dict(delay_wgrad_compute=True), "--delay-wgrad-compute conflicts"),
    "split-grouped-gemm": (dict(moe_grouped_gemm=True), "--moe-grouped-gemm conflicts"),
    # Issue 43: the V schedules run the flag (overlapped F&B pairs through Megatron's combined step); the one-chunk
    # schedules refuse it (Megatron's combined 1F1B needs virtual stages at PP > 1).
    "overlap-moe-comm-zb": (dict(pipeline_schedule="zb-1p", overlap_moe_expert_parallel_comm=True, bf16=True),
                            "--overlap-moe-expert-parallel-comm runs under the V schedules (v-min, v-half, v-zb, "
                            "v-auto) and Megatron's interleaved-1f1b: --pipeline-schedule zb-1p places one model chunk"),
    "overlap-moe-comm-gpipe": (dict(pipeline_schedule="gpipe", overlap_moe_expert_parallel_comm=True, bf16=True),
                               "--pipeline-schedule gpipe places one model chunk per pipeline rank"),
    "split-tp-overlap": (dict(cpu=False, distributed_backend=None, tp_comm_overlap=True), "--tp-comm-overlap conflicts"),
    # Issue 12: what iteration 1 used to find (a ScheduleError traceback naming the CLI's flag) and
    # what the first save used to find, now refused at start-up.
    "v-auto-unreachable-limit": (dict(pipeline_schedule="v-auto", pipeline_memory_limit=0.05),
                                 "--pipeline-schedule v-auto at PP=4 with 8 microbatches: --pipeline-memory-limit "
                                 "0.05 is below what v-auto reaches"),
    "microbatches-beyond-sane": (dict(global_batch_size=2 * 70000), "must be in [1, 65536]; got 70000"),
    "pipeline-costs-nan": (dict(pipeline_schedule="v-zb", pipeline_costs="f=nan"),
                           "--pipeline-costs: f: must be a finite number"),
    "pipeline-costs-a2a": (dict(pipeline_schedule="v-zb", pipeline_costs="f=1,a2a=0.5"),
                           "--pipeline-costs: a2a (the MoE all-to-all that overlapped F&B pairs hide) places pairs only "
                           "with --overlap-moe-expert-parallel-comm"),
    "save-under-a-file": (dict(save=__file__ + "/ckpt"), "exists and is not a directory"),
    "save-unwritable": (dict(save="/sys/vshape-ckpt"), "--save /sys/vshape-ckpt: cannot write into /sys"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_combination_fails_with_one_line_naming_flag(case):
    overrides, expected = BAD[case]
    args = megatron_like(**overrides)
    with pytest.raises(ConfigError) as info:
        validate(args)
    message = str(info.value)
    assert expected in message
    assert "\n" not in message
    assert "--memory-limit" not in message.replace("--pipeline-memory-limit", ""), "name the training flag"
    assert message.lstrip().startswith("--"), "the line must start with the flag it is about"
    assert ";" in message, "the line must say how to fix it"


def test_split_schedule_on_te_needs_te_and_refuses_what_megatron_linears_cannot_do():
    args = megatron_like(cpu=False, distributed_backend=None, transformer_impl="transformer_engine",
                         gradient_accumulation_fusion=True)
    sizes = vchecks.Sizes.from_args(args)

    def check(**kw):  # TE 2.2: the split layer spec (TE's own deferral needs 2.3)
        return vchecks.check_te_split(args, sizes, **{"te_version": lambda: (2, 2, 0), "wgrad_kernel": lambda: True, **kw})

    assert check() is None
    assert "install it or use --transformer-impl local" in check(te_version=lambda: None)
    assert "add --no-gradient-accumulation-fusion" in check(wgrad_kernel=lambda: False)
    args.fp8 = "hybrid"
    assert check().startswith("--fp8-format needs Transformer Engine's linear layers")
    # TE >= 2.3: TE's own linears defer W (the TE split spec): FP8 and no apex kernel needed.
    assert check(te_version=lambda: (2, 3, 0), wgrad_kernel=lambda: False) is None
    args.fp8 = None
    args.pipeline_schedule = "1f1b"  # Megatron's own schedule: TE's own spec, no check
    assert check(te_version=lambda: None) is None


def test_split_schedule_on_te_gets_the_split_layer_spec_unless_given_one():
    SPEC_ARG = vflags.SPLIT_SPEC_ARG  # noqa: N806

    args = vargs.resolve_defaults(megatron_like(cpu=False, distributed_backend=None,
                                                transformer_impl="transformer_engine", spec=None))
    assert args.spec == SPEC_ARG
    for overrides in (dict(pipeline_schedule="1f1b"), dict(transformer_impl="local"), dict(spec=["my.mod", "f"])):
        args = vargs.resolve_defaults(megatron_like(**{"cpu": False, "distributed_backend": None,
                                                      "transformer_impl": "transformer_engine", "spec": None,
                                                      **overrides}))
        assert args.spec != SPEC_ARG, overrides


def test_megatron_own_and_unsplit_schedules_allow_overlap_features():
    for name in ("1f1b", "gpipe"):
        args = megatron_like(pipeline_schedule=name, cpu=False, distributed_backend=None, overlap_grad_reduce=True)
        assert problems(args) == []


@pytest.mark.parametrize("name", ["zb-1p", "v-min", "v-half", "v-zb"])
def test_split_schedules_allow_dp_overlap_and_recomputation(name):
    """Megatron's recipes: DP overlap (buckets launch at their last W) and both recomputation modes."""
    for features in (dict(overlap_grad_reduce=True, overlap_param_gather=True, use_distributed_optimizer=True),
                     dict(recompute_granularity="selective"),
                     dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)):
        assert problems(megatron_like(pipeline_schedule=name, num_layers=8, **features)) == [], features


@pytest.mark.parametrize("limit", [0.5, 1.0, None])
def test_v_auto_with_a_valid_or_default_limit_passes(limit):
    assert problems(megatron_like(pipeline_schedule="v-auto", pipeline_memory_limit=limit)) == []


def test_problems_lists_every_issue():
    found = problems(megatron_like(num_layers=12, distributed_backend="nccl", pipeline_memory_limit=2.0))
    assert len(found) == 3


def test_exit_on_error_prints_one_line_and_exits_2(capsys):
    def boom():
        raise ConfigError("--pipeline-schedule: bad; fix it")

    with pytest.raises(SystemExit) as info:
        vargs.exit_on_error(boom)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--pipeline-schedule: bad; fix it" in err


@pytest.mark.parametrize(("overrides", "message"), [
    ({"pipeline_costs": "f=1,b=x"}, "--pipeline-costs: b.*'x' is not a number"),
    ({"pipeline_watchdog": -1.0}, "--pipeline-watchdog must be a number of seconds >= 0"),
    ({"pipeline_watchdog": float("nan")}, "--pipeline-watchdog must be a number of seconds >= 0"),
    ({"pipeline_costs": "auto", "pipeline_schedule": "gpipe"}, "gpipe does not depend on them"),
    ({"pipeline_costs": "auto", "pipeline_schedule": "1f1b"}, "1f1b does not depend on them"),
    ({"pipeline_costs": "auto", "pipeline_costs_iters": 0}, "--pipeline-costs-iters must be >= 1"),
    ({"pipeline_costs_out": "/tmp/c.json"}, "--pipeline-costs-out writes measured costs"),
])
def test_pipeline_costs_flags_fail_with_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        validate(megatron_like(**overrides))
    assert "\n" not in str(err.value)


def test_pipeline_costs_by_hand_and_auto_pass():
    assert validate(megatron_like(pipeline_costs="f=1,b=1.1,w=0.9,comm=0.05")).pipeline_costs
    assert validate(megatron_like(pipeline_costs="auto", pipeline_costs_iters=2)).pipeline_costs == "auto"


def test_watchdog_defaults_by_device_and_turns_off_with_zero():
    assert vchecks.watchdog_seconds(validate(megatron_like())) == 120.0  # --cpu
    assert vchecks.watchdog_seconds(megatron_like(cpu=False)) == 300.0
    assert vchecks.watchdog_seconds(validate(megatron_like(pipeline_watchdog=0.0))) == 0.0


def test_schedule_is_built_at_start_up_only_for_an_otherwise_valid_combination(monkeypatch):
    from megatron_vshape.megatron import startup_schedule
    from megatron_vshape.schedules.generators import registry

    startup_schedule.clear()
    built, real = [], registry.get_schedule
    monkeypatch.setattr(registry, "get_schedule", lambda *a, **kw: built.append(a[:3]) or real(*a, **kw))
    assert len(problems(megatron_like(num_layers=12))) == 1 and built == []  # other problem: no build
    assert problems(megatron_like()) == [] and built == [("v-half", 4, 8)]
    problems(megatron_like(pipeline_schedule="1f1b"))  # Megatron's own function: nothing of ours to build
    assert len(built) == 1


def test_large_start_up_build_prints_progress_on_rank_0(monkeypatch, capsys):
    from megatron_vshape.schedules.core import inputs

    monkeypatch.setattr(inputs, "LARGE_PASSES", 10)
    monkeypatch.setenv("RANK", "0")
    assert problems(megatron_like()) == []
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "megatron-vshape: checking --pipeline-schedule v-half at PP=4 with 8 microbatches (192 passes) ..."
    assert "done in" in err[-1]
    monkeypatch.setenv("RANK", "1")
    assert problems(megatron_like()) == [] and capsys.readouterr().err == ""


def test_start_up_builds_the_run_schedule_once_from_the_runs_costs(monkeypatch):
    """The start-up checks (does it build; does it keep W in B's order for TE's deferral) judge the schedule
    the executor will run, built from --pipeline-costs, and build it once: at large sizes a build takes
    seconds (it was built twice, the W-order check from default costs)."""
    from megatron_vshape.megatron import startup_schedule
    from megatron_vshape.megatron.flags import TE_SPLIT_SPEC_ARG
    from megatron_vshape.schedules.core.schedule import Costs
    from megatron_vshape.schedules.generators import registry

    startup_schedule.clear()
    built, real = [], registry.get_schedule
    monkeypatch.setattr(registry, "get_schedule",
                        lambda *a, **kw: built.append((a[:3], a[3] if len(a) > 3 else kw.get("costs"))) or real(*a, **kw))
    args = megatron_like(cpu=False, distributed_backend=None, transformer_impl="transformer_engine", spec=None,
                         pipeline_costs="f=1,b=1.2,w=0.8,comm=0.1", vshape_te_version=(2, 8, 0))
    validate(args)
    assert args.spec == TE_SPLIT_SPEC_ARG  # the route that asked for the W order
    assert built == [(("v-half", 4, 8), Costs(f=1, b=1.2, w=0.8, comm=0.1))]
