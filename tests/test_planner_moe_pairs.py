"""`vshape plan`'s rows with overlapped F&B pairs (``--overlap-moe-expert-parallel-comm``, planner/moe_pairs.py):
the all-to-all they hide is costs.py's expert-parallel all-to-all, the row's time is the simulator's for the
paired order, and the plan picks the row where the all-to-all is large and not where it is zero. Pure Python.

The model: a small Mixtral-like MoE (8 layers, 8 experts top-2, SwiGLU, GQA) on GPUs with 4 per node, so
that EP 8 crosses nodes, on 32 GPUs at PP 4.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_vshape.planner import cli
from megatron_vshape.planner.command import recipe_flags
from megatron_vshape.planner.costs import CostModel
from megatron_vshape.planner.hardware import GPUS
from megatron_vshape.planner.memory import activation_model, activation_peaks
from megatron_vshape.planner.model import GPTModel
from megatron_vshape.planner.moe_pairs import FLAG, PAIRING_SCHEDULES, pair_problem, paired_costs, run_a2a
from megatron_vshape.planner.parallel_layout import ParallelLayout
from megatron_vshape.planner.predict import predict, staged_costs
from megatron_vshape.planner.rows import row_kinds
from megatron_vshape.planner.search import Grid, _upper_bound, search
from megatron_vshape.planner.simcache import run_pipeline
from megatron_vshape.schedules.core.schedule import Costs
from megatron_vshape.schedules.core.simulator import simulate
from megatron_vshape.schedules.generators.registry import get_schedule

MOE = GPTModel("mixtral-like", 8, 1024, 8, 2048, vocab=32000, query_groups=2, swiglu=True, bias=False, rmsnorm=True,
               learned_positions=False, num_experts=8, moe_topk=2, ffn_hidden=3584, causal=True)
SLOW_LINKS = replace(GPUS["h100"], gpus_per_node=4)  # EP 8 crosses nodes: the all-to-all takes about an F (1.04)
FREE_LINKS = replace(GPUS["h100"], nvlink_bandwidth=1e30, internode_bandwidth=1e30)  # every a2a takes 0 s
LAYOUT = ParallelLayout(8, 1, 4, 1, 64, ep=8)  # DP 8 TP 1 PP 4, 16 microbatches


def test_pair_costs_hide_costs_pys_all_to_all_and_an_f_alone_costs_the_same():
    cost_model = CostModel(SLOW_LINKS)
    times = cost_model.pass_times(MOE, LAYOUT)
    assert times.a2a == cost_model._ep_all_to_all(MOE, LAYOUT) > 0.5 * times.f  # the all-to-all priced once
    layers = (1, 1, 1, 1, 1, 1, 1, 1)
    costs = staged_costs(times, MOE, layers, False, LAYOUT.pp, False)
    paired = paired_costs(costs, times, MOE, layers)
    assert paired.a2a_time() == pytest.approx(times.a2a)  # one layer per V chunk: one layer's all-to-all
    # an F or a B alone pays its all-to-all in full: the same time as in the row without pairs
    assert paired.f + paired.a2a_time() == pytest.approx(costs.f)
    assert paired.b + paired.a2a_time() == pytest.approx(costs.b)
    # a pair hides each all-to-all under the other's compute
    assert paired.pair_time(paired.f, paired.b) < costs.f + costs.b
    assert paired_costs(costs, cost_model.pass_times(MOE, replace(LAYOUT, ep=1)), MOE, layers) == costs  # nothing to hide
    # the all-to-all the plan's flags hand the run (--pipeline-costs a2a=X) is the one the row's pairs were placed for
    assert run_a2a(times) == pytest.approx(paired.a2a)
    assert run_a2a(cost_model.pass_times(MOE, replace(LAYOUT, ep=1))) == 0.0


def test_pair_row_is_the_simulators_time_and_memory_of_its_paired_order():
    cost_model = CostModel(SLOW_LINKS)
    for name in ("v-zb", "v-half"):
        row = predict(name, LAYOUT, MOE, cost_model, pairs=True)
        plain = predict(name, LAYOUT, MOE, cost_model)
        times = row.pass_times
        costs = paired_costs(staged_costs(times, MOE, row.layers_per_stage, False, LAYOUT.pp, False), times, MOE,
                             row.layers_per_stage)
        run = run_pipeline(name, LAYOUT.pp, LAYOUT.num_microbatches, costs, coarse=True,
                           staged_order=len(set(row.layers_per_stage)) > 1)
        order = run.sample.schedule
        assert not run.extrapolated and order.pairs, name
        result = simulate(order, costs)  # in seconds, with the row's own costs
        # (the planner simulates the cost ratios rounded to 1e-6)
        assert row.iteration_time == pytest.approx(result.makespan_total + row.dp_exposed + times.optimizer,
                                                   rel=1e-6)
        acts = activation_model(MOE, LAYOUT, 2 * LAYOUT.pp, False, "none", row.layers_per_stage)
        assert row.memory.peak_activation == pytest.approx(max(activation_peaks(result, acts)))
        # the same order without pairs, under the same costs, is slower: the pairs are why the row is faster
        unpaired = simulate(get_schedule(name, LAYOUT.pp, LAYOUT.num_microbatches, replace(costs, a2a=0.0)), costs)
        assert result.makespan_total < unpaired.makespan_total
        assert row.iteration_time < plain.iteration_time
        assert _upper_bound(name, LAYOUT, MOE, cost_model, pairs=True) >= row.mfu  # the search's bound holds


def _best_label(gpu) -> tuple[str, dict]:
    cost_model = CostModel(gpu)
    grid = Grid(tp=(1,), pp=(4,), micro_batch=(1,), ep=(1, 2, 4, 8))
    results = []
    for name in ("v-zb", "v-half"):
        for kind in row_kinds(name, MOE, vocab_rows=False):
            results += search([name], MOE, cost_model, 32, 64, grid, vocab_parallel=kind.vocab_parallel, pairs=kind.pairs)
    first = cli.report(results, False).splitlines()[0]
    return first.split("  ")[0].strip(), {r.label: r.best for r in results}


def test_plan_picks_pairs_where_the_all_to_all_is_large_and_not_where_it_is_zero():
    label, best = _best_label(SLOW_LINKS)
    assert label.endswith("+pairs"), best
    assert best["v-zb +pairs"].mfu > best["v-zb"].mfu and best["v-zb +pairs"].layout.ep > 1
    label, best = _best_label(FREE_LINKS)
    assert not label.endswith("+pairs"), best
    for name in ("v-zb", "v-half"):  # nothing to hide: the pair row is the same run, and the plain row wins ties
        assert best[f"{name} +pairs"].mfu <= best[name].mfu


def test_pair_rows_only_where_the_flag_runs_and_their_flags():
    assert PAIRING_SCHEDULES == ("v-min", "v-half", "v-zb", "v-auto") or set(PAIRING_SCHEDULES) == {
        "v-min", "v-half", "v-zb", "v-auto"}
    assert [k.pairs for k in row_kinds("v-zb", MOE)] == [False, False, True]
    assert not any(k.pairs for k in row_kinds("zb-1p", MOE))
    assert not any(k.pairs for k in row_kinds("v-zb", replace(MOE, num_experts=0)))
    assert "EP > 1" in pair_problem("v-zb", replace(LAYOUT, ep=1), MOE)
    assert "full recomputation" in pair_problem("v-zb", replace(LAYOUT, recompute="full"), MOE)
    assert "V schedules" in pair_problem("zb-1p", LAYOUT, MOE)
    assert pair_problem("v-zb", replace(LAYOUT, recompute="selective"), MOE) is None
    with pytest.raises(ValueError, match="EP > 1"):
        predict("v-zb", replace(LAYOUT, ep=1), MOE, CostModel(SLOW_LINKS), pairs=True)
    words = recipe_flags("v-zb", LAYOUT, (1,) * 8, pairs=True)
    assert words[-1] == FLAG and "--pipeline-vocab-parallel" not in words
    words = recipe_flags("v-zb", LAYOUT, (1,) * 8, pairs=True, a2a=0.6251)
    assert words[-3:] == [FLAG, "--pipeline-costs", "a2a=0.625"]
    assert "--pipeline-costs" not in recipe_flags("v-zb", LAYOUT, (1,) * 8, a2a=0.6251)  # no pairs: nothing to place
    assert FLAG not in recipe_flags("v-zb", LAYOUT, (1,) * 8)


def test_costs_a2a_is_what_the_registry_pairs_on():
    """The planner hands the a2a to the registry through Costs, as the simulator's own pairing takes it."""
    built = get_schedule("v-zb", 4, 16, Costs(1.0, 1.0, 1.0, a2a=1.0))
    assert built.pairs and not get_schedule("v-zb", 4, 16, Costs(1.0, 1.0, 1.0)).pairs



SMALL_MOE = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "8", "--seq-length", "2048",
             "--num-experts", "8", "--moe-router-topk", "2", "--global-batch-size", "64", "--vocab-size", "32000"]
SMALL_GRID = ["--gpus", "32", "--gpu", "h100", "--tp", "2", "--pp", "4", "--cp", "1", "--micro-batch", "1",
              "--recompute", "none", "--schedules", "v-zb,zb-1p", "--no-vocab-parallel"]


def test_vshape_plan_prints_the_pair_rows_and_their_flag(capsys, monkeypatch):
    from megatron_vshape.planner import megatron_args

    monkeypatch.setattr(megatron_args, "megatron_parser", lambda: (megatron_args.subset_parser(), "subset"))
    assert cli.main([*SMALL_GRID, "--", *SMALL_MOE]) == 0
    out = capsys.readouterr().out
    rows = sorted(line[:16].strip() for line in out.splitlines() if " bubble " in line)
    assert rows == ["v-zb", "v-zb +pairs", "zb-1p"], out  # the pair row for the V schedule only
    commands = {line[:16].strip(): line.split() for line in out.splitlines() if "--pipeline-schedule" in line}
    pair_words = commands["v-zb +pairs"]
    assert FLAG in pair_words and FLAG not in commands["v-zb"] and FLAG not in commands["zb-1p"]
    # the run places its pairs for the all-to-all the row costed, not for the run's default of 1 x F
    given = Costs.parse(pair_words[pair_words.index("--pipeline-costs") + 1])
    assert 0 < given.a2a != 1.0 and (given.f, given.b, given.w) == (1.0, 1.0, 1.0)
    assert all("--pipeline-costs" not in commands[name] for name in ("v-zb", "zb-1p"))
    assert "v-zb +pairs      search's layout" in out
    assert cli.main([*SMALL_GRID, "--no-moe-pairs", "--", *SMALL_MOE]) == 0
    assert "+pairs" not in capsys.readouterr().out
    dense = SMALL_MOE[:SMALL_MOE.index("--num-experts")] + SMALL_MOE[SMALL_MOE.index("--global-batch-size"):]
    assert cli.main([*SMALL_GRID, "--", *dense]) == 0
    assert "+pairs" not in capsys.readouterr().out


def test_a_pair_row_without_a_layout_says_which_rule_stopped_it():
    from megatron_vshape.planner.explain import why_nothing

    cost_model, grid = CostModel(SLOW_LINKS), Grid(tp=(1,), pp=(4,), micro_batch=(1,), ep=(1,))
    (found,) = search(["v-zb"], MOE, cost_model, 32, 64, grid, pairs=True)
    assert found.best is None and found.label == "v-zb +pairs"
    assert "needs expert parallelism (EP > 1)" in why_nothing(found, MOE, cost_model, 32, 64, grid)
    # both the layout's rule (EP 8 over 4 experts) and the flag's (full recomputation): the layout's comes first
    four, both = replace(MOE, num_experts=4), replace(grid, ep=(8,), recompute=("full",))
    (found,) = search(["v-zb"], four, cost_model, 32, 64, both, pairs=True)
    assert "EP 8 must divide --num-experts 4" in why_nothing(found, four, cost_model, 32, 64, both)
