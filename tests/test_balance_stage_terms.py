"""balance.stage_work keeps what it reads from the model and each stage's layer sums (issue 44: the layout
search asks for thousands of layouts of one model): every layout's works must equal those computed afresh,
layer by layer, for any model, layout, extras and flag, in any order of asking."""

import random
from dataclasses import replace

import pytest

from megatron_vshape.planner import balance
from megatron_vshape.planner.balance import MIN_STAGE_WORK, StageExtras, stage_work
from megatron_vshape.planner.model import GPTModel
from megatron_vshape.schedules.core.schedule import StageWork

UNIFORM = GPTModel("head-heavy", 16, 64, 4, 32, 2048)
HYBRID = replace(GPTModel("hybrid", 16, 64, 4, 32, 2048), pattern="M*M-M*M-M*M-M*M-")  # layers differ


def afresh(model, layers, flash_attention=False, extras=None, vocab_parallel=False):
    """stage_work as it was before its terms were kept: everything read from the model for this call."""
    num_stages = len(layers)
    unit = model.layers / num_stages
    extras = StageExtras() if vocab_parallel else extras or StageExtras.from_flops(model)
    act = model.activation_bytes(1, 1, flash_attention)
    logits = 0.0 if vocab_parallel else model.logits_bytes(1, 1)
    weights = model.layer_weights(flash_attention)
    out, start = [], 0
    for stage, count in enumerate(layers):
        first, last = stage == 0, stage == num_stages - 1
        own = [sum(w[i] for w in weights[start:start + count]) for i in range(4)]
        start += count
        work = [x + (e if first else 0.0) + (h if last else 0.0) for x, e, h in zip(own, extras.embedding, extras.head)]
        memory = own[3] * act + (logits if last else 0.0)
        ratios = [x / unit for x in work] + [memory / (unit * act)]
        out.append(StageWork(*(max(r, MIN_STAGE_WORK) for r in ratios)))
    return tuple(out)


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
