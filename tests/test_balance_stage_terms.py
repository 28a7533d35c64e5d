"""balance.stage_work keeps what it reads from the model and each stage's layer sums (issue 44: the layout
search asks for thousands of layouts of one model): every layout's works must equal those computed afresh,
with nothing kept, for any model, layout, extras and flag, in any order of asking (the sums and the rest of
the arithmetic are the former stage_work's; tests/test_balance.py checks them against the FLOPs model)."""

import random
from dataclasses import replace

import pytest

from megatron_vshape.planner import balance
from megatron_vshape.planner.balance import StageExtras, stage_work
from megatron_vshape.planner.model import GPTModel

UNIFORM = GPTModel("head-heavy", 16, 64, 4, 32, 2048)
HYBRID = replace(GPTModel("hybrid", 16, 64, 4, 32, 2048), pattern="M*M-M*M-M*M-M*M-")  # layers differ


def afresh(model, layers, flash_attention=False, extras=None, vocab_parallel=False):
    """stage_work with nothing kept: a new reading of the model's terms for this one layout (no layer sums
    from earlier layouts, no terms of another call)."""
    return balance._StageTerms(model, flash_attention, extras, vocab_parallel).works(tuple(layers))


def random_layout(rng, total, stages):
    cuts = sorted(rng.randint(0, total) for _ in range(stages - 1))
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, total]))


@pytest.mark.parametrize("model", [UNIFORM, HYBRID], ids=["alike", "hybrid"])
def test_kept_terms_give_the_works_computed_afresh(model):
    assert len(set(model.layer_weights())) > 1 or model is UNIFORM  # the hybrid's layers do differ
    rng = random.Random(44)
    balance._stage_terms.cache_clear()
    extras = StageExtras((0.1, 0.2, 0.0), (2.0, 2.5, 1.5))
    for _ in range(300):  # the same (first layer, count) pairs come back in other layouts, as in the search
        layers = random_layout(rng, model.layers, rng.choice((2, 4, 8)))
        options = dict(flash_attention=rng.random() < 0.5, extras=rng.choice((None, extras)),
                       vocab_parallel=rng.random() < 0.3)
        assert stage_work(model, layers, **options) == afresh(model, layers, **options)


def test_models_with_the_same_layers_but_other_shapes_do_not_share_terms():
    """The terms are the model's: another hidden size or vocabulary gives other works for the same layout."""
    layers = (1, 3, 2, 2, 2, 2, 3, 1)
    other = replace(UNIFORM, vocab=4096)
    assert stage_work(UNIFORM, layers) == afresh(UNIFORM, layers)
    assert stage_work(other, layers) == afresh(other, layers)
    assert stage_work(other, layers) != stage_work(UNIFORM, layers)
