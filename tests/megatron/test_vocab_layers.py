"""Vocabulary parallelism on Megatron's model chunks (megatron/vocab_layers.py), on gloo ranks.

* The surgery and the initial scatter: every rank's shard is the rows of the weights a one-process
  GPTModel with the same seed has (schedule-invariant init, so the plain pipeline starts from them too);
  the stripped chunks hold no output layer and no word-embedding weight, and their sharded state dicts
  give those keys only through the shard layers.
* One microbatch driven by hand through the stripped chunks, as the executor will run it: the loss and
  every parameter's gradient (after Megatron's finalize_model_grads) equal the one-process GPTModel with
  Megatron's own output layer and loss, and so does Megatron's optimizer's grad norm.
* torch_dist checkpoints move between runs with and without the flag, bitwise.

Controls run the same checks on a broken variant (a shard at the wrong rows, a missing W, shards not
marked tensor-parallel) and must see them fail.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

import pytest

from megatron_vshape.megatron.flags import ConfigError
from megatron_vshape.testing.tiny_gpt import ModelSettings

SEED = 1234
MODEL = ModelSettings(seed=SEED)  # 8 layers, hidden 32, vocab 64, sequence 16, microbatch 2
TOLERANCE = 1e-6
BF16_TOLERANCE = 3e-2  # against the one-process model in bf16: its own rounding, another summation order
TIMEOUT = 240


@dataclass(frozen=True)
class Case:
    tp: int
    pp: int
    v: bool  # V placement (two chunks per rank) or looped
    tied: bool
    chunks: int = 1  # looped: chunks per rank (2: interleaved-1f1b's placement)
    sequence_parallel: bool = False
    rope: bool = False
    dtype: str = "fp32"  # bf16: bf16 weights under Float16Module, gradients in fp32 (as --bf16)
    control: str | None = None  # "wrong-offset", "no-w": a broken variant the checks must catch

    @property
    def name(self) -> str:
        placement = "v" if self.v else "looped" + (str(self.chunks) if self.chunks > 1 else "")
        parts = [f"tp{self.tp}-pp{self.pp}", placement, "tied" if self.tied else "untied"]
        parts += ["sp"] * self.sequence_parallel + ["rope"] * self.rope + [self.dtype] * (self.dtype != "fp32")
        return "-".join(parts + [self.control] * bool(self.control))

    @property
    def variant(self) -> tuple[bool, bool, str]:
        return self.tied, self.rope, self.dtype

    def placement(self):
        from megatron_vshape.schedules.core.schedule import Placement

        return Placement.v_shape(self.pp) if self.v else Placement.looped(self.pp, self.chunks)

    @property
    def tolerance(self) -> float:
        return TOLERANCE if self.dtype == "fp32" else BF16_TOLERANCE


# PP 2 (with DP 2 on the 4 ranks) in every placement, tied and untied; PP 4 and TP 2 x PP 2 in both placements,
# one tied and one untied each; TP 2 x PP 2 under sequence parallelism, also with rotary embeddings (the
# first stage's lookup is then reduce-scattered).
CASES = [Case(1, 2, v, tied) for v in (False, True) for tied in (False, True)]
CASES += [Case(1, 4, False, False), Case(1, 4, True, True), Case(2, 2, False, True), Case(2, 2, True, False)]
CASES += [Case(2, 2, True, False, sequence_parallel=True), Case(2, 2, False, True, sequence_parallel=True, rope=True)]
CASES += [Case(1, 2, True, False, dtype="bf16")]  # the dtypes through Float16Module
CASES += [Case(1, 2, False, True, chunks=2)]  # interleaved: the last stage is chunk 1 of the last rank
CONTROLS = [Case(2, 2, True, False, control=c) for c in ("wrong-offset", "no-w")]


# --- in the ranks ---------------------------------------------------------------------------------------


def _settings(case_or_variant) -> ModelSettings:
    variant = case_or_variant.variant if isinstance(case_or_variant, Case) else case_or_variant
    return replace(MODEL, tied_embeddings=variant[0], dtype=variant[2])


def _build(config, settings: ModelSettings, rope: bool, pre, post, vp_stage, pgs, num_stages: int):
    """testing.tiny_gpt.build_gpt, with rotary position embeddings on request."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_vshape.testing.tiny_gpt import layer_spec

    return GPTModel(config=config, transformer_layer_spec=layer_spec(config, settings.num_layers // num_stages),
                    vocab_size=settings.vocab_size, max_sequence_length=settings.seq_length,
                    pre_process=pre, post_process=post, share_embeddings_and_output_weights=settings.tied_embeddings,
                    position_embedding_type="rope" if rope else "learned_absolute", vp_stage=vp_stage,
                    pg_collection=pgs)


def _reference(variant) -> dict:
    """One process, Megatron's own output layer and loss: weights, loss and gradients of microbatch 0."""
    import torch

    from megatron_vshape.megatron.dropout_seed import invariant_init
    from megatron_vshape.testing.tiny_gpt import make_config, microbatch, torch_dtype

    settings, rope = _settings(variant), variant[1]
    with invariant_init(SEED, 0):
        gpt = _build(make_config(settings, 1, 1, None, False), settings, rope, True, True, None, None, 1)
    gpt = gpt.to(torch_dtype(settings.dtype))  # as Float16Module does (the torch norms are built in fp32)
    batch = microbatch(settings, 0)
    per_token = gpt(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    loss = per_token.float().mean()
    loss.backward()
    grads = {n: p.grad.detach().float() for n, p in gpt.named_parameters()}
    return {"weights": {n: p.detach().clone() for n, p in gpt.named_parameters()}, "grads": grads,
            "loss": loss.item(), "grad_norm": torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()}


def _chunks(case: Case, placement):
    """This rank's chunks, built through ChunkBuilder as megatron.training's get_model builds them."""
    from megatron.core import parallel_state

    from megatron_vshape.megatron.model_chunks import ChunkBuilder
    from megatron_vshape.runtime.placement import chunk_specs
    from megatron_vshape.testing.tiny_gpt import make_config

    settings = _settings(case)
    vp = placement.chunks_per_device if placement.chunks_per_device > 1 else None
    config = make_config(settings, case.pp, case.tp, vp, case.sequence_parallel)
    schedule = "v-half" if case.v else "interleaved-1f1b" if vp else "zb-1p"
    args = argparse.Namespace(pipeline_schedule=schedule, schedule_invariant_init=True, seed=SEED,
                              pipeline_model_parallel_layout=None, pipeline_vocab_parallel=True,
                              virtual_pipeline_model_parallel_size=vp)
    builder = ChunkBuilder(args)
    chunks = []
    for spec in chunk_specs(placement, parallel_state.get_pipeline_model_parallel_rank()):
        def make(pre, post, vp_stage, pgs):
            return _build(config, settings, case.rope, pre, post, vp_stage, pgs, placement.num_stages)

        chunks.append(builder.build(make, spec.pre_process, spec.post_process, spec.vp_stage, None))
    return config, chunks


def _wrong_offset():
    """A patch of VocabShard.of that gives every pipeline rank its neighbour's rows."""
    from megatron_vshape.runtime import vocab_parallel

    original = vocab_parallel.VocabShard.of.__func__

    def of(cls, padded_vocab, tp_size, tp_rank, pp_size, pp_rank):
        return original(cls, padded_vocab, tp_size, tp_rank, pp_size, (pp_rank + 1) % pp_size)

    return vocab_parallel.VocabShard, "of", classmethod(of), vocab_parallel.VocabShard.__dict__["of"]


def _rel_err(got, want) -> float:
    scale = want.double().norm().item()
    diff = (got.double() - want.double()).norm().item()
    return diff / scale if scale > 0 else diff


def _global_names(chunk) -> dict[str, str]:
    from megatron_vshape.testing.workers import global_param_names

    return global_param_names(chunk)


def _tp_rows(full, param, tp_rank: int, tp_size: int):
    if tp_size > 1 and getattr(param, "tensor_model_parallel", False):
        return full.chunk(tp_size, dim=param.partition_dim)[tp_rank]
    return full


def _surgery_report(case, chunks, layers, ref) -> dict:
    """The shard's rows, what is left of the chunks and their checkpoint keys."""
    import torch
    from megatron.core import parallel_state

    from megatron_vshape.megatron.vocab_hooks import EmbeddingInput
    from megatron_vshape.megatron.vocab_layers import EMBEDDING_KEY, LAYERS_NAME, OUTPUT_KEY

    rows = slice(layers.shard.start, layers.shard.end)
    want_out = ref["weights"]["embedding.word_embeddings.weight" if case.tied else "output_layer.weight"]
    report = {
        "shard": (layers.shard.start, layers.shard.end),
        "embedding_exact": torch.equal(layers.embedding_weight, ref["weights"]["embedding.word_embeddings.weight"][rows]),
        "output_exact": torch.equal(layers.output_weight, want_out[rows]),
        "tied_is_one_parameter": layers.output_weight is layers.embedding_weight,
        "stray": [], "other_weights_err": 0.0, "vocab_keys": [], "embedding_input_on": [], "final_output_on": [],
    }
    tp_rank, tp_size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    for index, chunk in enumerate(chunks):
        names = _global_names(chunk)
        for name, param in chunk.named_parameters():
            if name.startswith(LAYERS_NAME + "."):
                continue
            if "output_layer" in name or "word_embeddings" in name:
                report["stray"].append(name)
                continue
            full = ref["weights"][names[name]]
            want = _tp_rows(full, param, tp_rank, tp_size)
            got = param.detach().to(want.dtype)  # bf16: the torch norms and position embeddings are fp32 until Float16Module
            report["other_weights_err"] = max(report["other_weights_err"], (got.float() - want.float()).abs().max().item())
        if hasattr(chunk, "output_layer") or getattr(chunk, "share_embeddings_and_output_weights", False):
            report["stray"].append(f"chunk {index}: output_layer / tied flag left")
        if getattr(chunk, "pre_process", False) and not isinstance(chunk.embedding.word_embeddings, EmbeddingInput):
            report["stray"].append(f"chunk {index}: word_embeddings left")
        for key, item in chunk.sharded_state_dict().items():
            if getattr(item, "key", None) in (EMBEDDING_KEY, OUTPUT_KEY):
                report["vocab_keys"].append((index, key, item.key, tuple(item.global_shape), tuple(item.global_offset)))
    report["embedding_input"] = layers.embedding_input is not None
    report["final_output"] = layers.final_output is not None
    return report


def _run_microbatch(case, placement, chunks, layers, ref) -> dict:
    """Forward and backward of microbatch 0 by hand, as the executor will run them."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from megatron_vshape.testing.tiny_gpt import microbatch, torch_dtype

    settings = _settings(case)
    config = chunks[0].config
    bf16 = case.dtype == "bf16"
    wrapped = [Float16Module(config, chunk) if bf16 else chunk for chunk in chunks]  # as get_model wraps
    model = [DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=bf16), chunk)
             for chunk in wrapped]
    for m in model:
        m.zero_grad_buffer()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_rank = pp_group.rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()

    def peer(pp_index: int) -> int:
        return dist.get_global_rank(pp_group, pp_index)

    batch = microbatch(settings, 0)
    tokens, b, s, h = batch["tokens"], settings.micro_batch_size, settings.seq_length, settings.hidden_size
    last = placement.num_stages - 1

    # The embedding: every rank's part, summed over TP then PP; the first stage gets the sum.
    embedded = layers.embed(tokens)
    for group in layers.groups:
        dist.all_reduce(embedded, group=group)
    chunk_shape = (s // tp if case.sequence_parallel else s, b, h)
    dtype = torch_dtype(settings.dtype)  # between stages; the last stage's output is fp32 (Float16Module)
    saved, leaf, hidden = {}, None, None
    for stage in range(placement.num_stages):
        if placement.device_of(stage) != pp_rank:
            continue
        chunk = chunks[placement.chunk_of(stage)]
        if stage == 0:
            leaf = layers.embedding_input.set(embedded)
            stage_input = None
        else:
            prev = placement.device_of(stage - 1)
            if prev != pp_rank:
                hidden = torch.empty(chunk_shape, dtype=dtype)
                dist.recv(hidden, peer(prev), group=pp_group)
            stage_input = hidden.detach().requires_grad_(True)
            chunk.set_input_tensor(stage_input)
        output = model[placement.chunk_of(stage)](tokens, batch["position_ids"], batch["attention_mask"],
                                                  labels=batch["labels"] if stage == last else None)
        saved[stage] = (stage_input, output)
        hidden = output
        if stage < last and placement.device_of(stage + 1) != pp_rank:
            dist.send(output.detach().contiguous(), peer(placement.device_of(stage + 1)), group=pp_group)

    # The last stage's hidden state and labels go to every pipeline rank.
    holder = placement.device_of(last)
    final = torch.empty(s, b, h)
    labels = torch.zeros(b, s, dtype=torch.long)
    labels_recorded = None
    if pp_rank == holder:
        final = saved[last][1].detach().clone()
        recorded = layers.final_output.take()
        labels_recorded = bool(torch.equal(recorded.labels, batch["labels"])) and len(layers.final_output) == 0
        labels = recorded.labels.clone()
    dist.broadcast(final, peer(holder), group=pp_group)
    dist.broadcast(labels, peer(holder), group=pp_group)

    # S and T on every rank: the mean token loss, as tiny_gpt's loss function.
    out = layers.output_forward(final, labels)
    loss = out.loss.mean().item()
    grad_loss = torch.full_like(out.loss, 1.0 / out.loss.numel())
    grad_hidden, output_w = layers.output_backward(out, grad_loss)
    if case.control != "no-w":
        output_w()

    # The chunks' backward, last stage first.
    grad = None
    for stage in reversed(range(placement.num_stages)):
        if placement.device_of(stage) != pp_rank:
            continue
        stage_input, output = saved[stage]
        if stage == last:
            grad = grad_hidden
        elif placement.device_of(stage + 1) != pp_rank:
            grad = torch.empty(output.shape, dtype=output.dtype)
            dist.recv(grad, peer(placement.device_of(stage + 1)), group=pp_group)
        torch.autograd.backward(output, grad)
        if stage > 0:
            grad = stage_input.grad
            if placement.device_of(stage - 1) != pp_rank:
                dist.send(grad.contiguous(), peer(placement.device_of(stage - 1)), group=pp_group)

    # The embedding's W: the gradient of the first stage's embedding output, on every rank.
    grad_embedded = leaf.grad.clone() if pp_rank == placement.device_of(0) else torch.empty(b, s, h, dtype=embedded.dtype)
    dist.broadcast(grad_embedded, peer(placement.device_of(0)), group=pp_group)
    if case.control != "no-w":
        layers.embedding_weight_grad(tokens, grad_embedded)
    finalize_model_grads(model)

    # Every parameter's gradient against the one-process model's.
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    errors = {}
    rows = slice(layers.shard.start, layers.shard.end)
    for chunk in chunks:
        names = _global_names(chunk)
        for name, param in chunk.named_parameters():
            if name == "vocab_parallel.embedding_weight":
                want = ref["grads"]["embedding.word_embeddings.weight"][rows]
            elif name == "vocab_parallel.output_weight":
                want = ref["grads"]["output_layer.weight"][rows]
            else:
                want = _tp_rows(ref["grads"][names[name]], param, tp_rank, tp)
            errors[name if name.startswith("vocab_parallel.") else names[name]] = _rel_err(param.main_grad, want)

    def grad_norm_err() -> float:  # Megatron's optimizer's grad norm (the clip path) against the reference's
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=1e-3, clip_grad=1.0, bf16=bf16, params_dtype=dtype), model)
        optimizer.prepare_grads()
        return abs(float(optimizer.get_grad_norm()) - ref["grad_norm"]) / ref["grad_norm"]

    result = {"loss_err": abs(loss - ref["loss"]) / abs(ref["loss"]), "grad_errors": errors, "labels_recorded": labels_recorded,
              "grad_norm_err": grad_norm_err()}
    if tp > 1:  # the control: shards not marked tensor-parallel count on TP rank 0 only
        for param in layers.parameters():
            del param.tensor_model_parallel
        result["unmarked_grad_norm_err"] = grad_norm_err()
    return result


def model_rank(rank: int, world_size: int, cases: list[Case]) -> dict:
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_vshape.megatron.cpu_mode import enable_cpu_mode
    from megatron_vshape.runtime.vocab_iteration import vocab_layers_of

    enable_cpu_mode()
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(SEED)
    refs = {variant: _reference(variant) for variant in sorted({case.variant for case in cases})}
    parallel_state.destroy_model_parallel()
    results = {}
    for case in cases:
        parallel_state.initialize_model_parallel(case.tp, case.pp)
        model_parallel_cuda_manual_seed(SEED)
        placement = case.placement()
        patch = _wrong_offset() if case.control == "wrong-offset" else None
        if patch is not None:
            setattr(patch[0], patch[1], patch[2])
        try:
            _, chunks = _chunks(case, placement)
            layers = vocab_layers_of(chunks)
            report = _surgery_report(case, chunks, layers, refs[case.variant])
            report.update(_run_microbatch(case, placement, chunks, layers, refs[case.variant]))
        finally:
            if patch is not None:
                setattr(patch[0], patch[1], patch[3])
        report["megatron"] = parallel_state.__file__
        report["pp_rank"] = parallel_state.get_pipeline_model_parallel_rank()
        report["tp_rank"] = parallel_state.get_tensor_model_parallel_rank()
        results[case.name] = report
        parallel_state.destroy_model_parallel()
        torch.distributed.barrier()
    return results


# --- the tests ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_runs() -> dict:
    from megatron_vshape.testing.spawn import spawn

    per_rank = spawn(model_rank, 4, (CASES + CONTROLS,), timeout=TIMEOUT)
    return {name: [ranks[name] for ranks in per_rank] for name in per_rank[0]}


def _surgery_failures(case: Case, ranks: list[dict]) -> list[str]:
    from megatron_vshape.megatron.vocab_layers import EMBEDDING_KEY, OUTPUT_KEY

    failures = []
    vocab, hidden = MODEL.vocab_size, MODEL.hidden_size
    per_rank = vocab // (case.tp * case.pp)
    for rank, r in enumerate(ranks):
        start = (r["tp_rank"] * case.pp + r["pp_rank"]) * per_rank
        vocab_keys = [tuple(tuple(x) if isinstance(x, list) else x for x in entry) for entry in r["vocab_keys"]]
        if tuple(r["shard"]) != (start, start + per_rank):
            failures.append(f"rank {rank}: rows {r['shard']}, not [{start}, {start + per_rank})")
        if not (r["embedding_exact"] and r["output_exact"]):
            failures.append(f"rank {rank}: the shard is not the one-process model's rows")
        if r["tied_is_one_parameter"] != case.tied:
            failures.append(f"rank {rank}: tied={case.tied} but one parameter={r['tied_is_one_parameter']}")
        if r["stray"] or r["other_weights_err"] != 0.0:
            failures.append(f"rank {rank}: left {r['stray']}, other weights off by {r['other_weights_err']}")
        keys = [EMBEDDING_KEY] + [OUTPUT_KEY] * (not case.tied)
        want = [(0, f"vocab_parallel.{n}_weight", key, (vocab, hidden), (start, 0))
                for n, key in zip(("embedding", "output"), keys)]
        if sorted(vocab_keys) != sorted(want):  # (tuples become lists through the main probe's JSON)
            failures.append(f"rank {rank}: checkpoint entries {vocab_keys}, not {want}")
        holds_first, holds_last = r["pp_rank"] == 0, r["pp_rank"] == (0 if case.v else case.pp - 1)
        if (r["embedding_input"], r["final_output"]) != (holds_first, holds_last):
            failures.append(f"rank {rank}: hooks {r['embedding_input'], r['final_output']}")
    return failures


def _gradient_failures(ranks: list[dict], tolerance: float = TOLERANCE) -> list[str]:
    failures = []
    for rank, r in enumerate(ranks):
        bad = {name: err for name, err in r["grad_errors"].items() if not err <= tolerance}
        if r["loss_err"] > tolerance * 10 or bad or r["grad_norm_err"] > tolerance or r["labels_recorded"] is False:
            failures.append(f"rank {rank}: loss off by {r['loss_err']:.2e}, grad norm by {r['grad_norm_err']:.2e}, "
                            f"labels recorded {r['labels_recorded']}, gradients off: {bad}")
    return failures


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_surgery_shards_are_the_one_process_models_rows(model_runs, case):
    assert _surgery_failures(case, model_runs[case.name]) == []


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_one_microbatch_by_hand_gives_megatrons_loss_and_every_gradient(model_runs, case):
    ranks = model_runs[case.name]
    assert _gradient_failures(ranks, case.tolerance) == []
    assert sum(len(r["grad_errors"]) for r in ranks) > 0
    # the last stage's rank saw the labels
    assert [r["labels_recorded"] for r in ranks].count(True) == 4 // case.pp  # TP x DP ranks of the last stage


@pytest.mark.slow
def test_the_checks_catch_a_wrong_row_offset_a_missing_w_and_unmarked_shards(model_runs):
    wrong = model_runs["tp2-pp2-v-untied-wrong-offset"]
    failures = _surgery_failures(CONTROLS[0], wrong)
    assert any("rows (" in f for f in failures) and any("not the one-process model's rows" in f for f in failures)
    assert any("checkpoint entries" in f for f in failures)
    assert _gradient_failures(wrong) and all(r["loss_err"] > 1e-3 for r in wrong)
    no_w = model_runs["tp2-pp2-v-untied-no-w"]
    for r in no_w:  # everything else is exact; the vocabulary weights have no gradient
        assert r["grad_errors"]["vocab_parallel.embedding_weight"] > 0.5
        assert r["grad_errors"]["vocab_parallel.output_weight"] > 0.5
        others = [err for name, err in r["grad_errors"].items() if not name.startswith("vocab_parallel.")]
        assert max(others) <= TOLERANCE
    for case in CASES:  # without tensor_model_parallel, TP rank 1's rows drop out of the norm
        if case.tp > 1:
            assert all(r["unmarked_grad_norm_err"] > 1e-3 for r in model_runs[case.name]), case.name


# --- checkpoints ----------------------------------------------------------------------------------------


def _plain_chunks(placement, tied: bool, seed: int):
    """A run without the flag (Megatron's own embedding and output layer), initialised from ``seed``."""
    import torch

    from megatron_vshape.runtime.placement import build_model_chunks
    from megatron_vshape.testing.tiny_gpt import build_gpt, make_config

    settings = replace(MODEL, tied_embeddings=tied)
    vp = None if placement.chunks_per_device == 1 else placement.chunks_per_device
    config = make_config(settings, placement.num_devices, 1, vp, False)
    torch.manual_seed(seed)
    return build_model_chunks(placement, torch.distributed.get_rank(), lambda spec, pgs: build_gpt(
        config, settings, spec.pre_process, spec.post_process, spec.vp_stage, pgs, placement.num_stages))


def _vocab_chunks(placement, tied: bool, seed: int, freed: list | None = None):
    """``freed``: gets whether Megatron's full embedding and output weights are gone after the surgery."""
    import gc
    import weakref

    import torch

    from megatron_vshape.megatron.vocab_surgery import install_vocab_parallel
    from megatron_vshape.runtime.vocab_iteration import vocab_layers_of

    chunks = _plain_chunks(placement, tied, seed)
    full = [weakref.ref(c.embedding.word_embeddings.weight) for c in chunks if c.pre_process]
    full += [weakref.ref(c.output_layer.weight) for c in chunks if c.post_process]
    install_vocab_parallel(chunks, placement)
    gc.collect()
    if freed is not None:
        freed.append(bool(full) and all(ref() is None for ref in full))
    layers = vocab_layers_of(chunks)
    with torch.no_grad():  # distinct values on every rank, nothing an initialisation could match
        gen = torch.Generator().manual_seed(seed * 31 + torch.distributed.get_rank())
        for param in layers.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    return chunks, layers


def _save(chunks, path) -> None:
    import queue

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    path.mkdir(exist_ok=True)  # both ranks
    # torch_dist's writer creates its results queue from a multiprocessing Manager (a server process),
    # which the spawn harness's daemonic ranks may not start; a synchronous save only puts into it and
    # gets from it in this process, so a plain queue does.
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    dist_checkpointing.save({f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}, str(path))


def _load(chunks, path) -> None:
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load({f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}, str(path))
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(state[f"model{i}"])  # as megatron.training's load_checkpoint does


def _gathered(tensor):
    """Every pipeline rank's ``tensor`` (this test runs PP 2, TP 1: the pipeline is the world), concatenated."""
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.detach().contiguous())
    return torch.cat(parts)


def _broadcast(tensor, src: int):
    import torch.distributed as dist

    tensor = tensor.detach().clone()
    dist.broadcast(tensor, src)
    return tensor


def checkpoint_rank(rank: int, world_size: int, root: str) -> dict:
    import pathlib

    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_vshape.megatron.cpu_mode import enable_cpu_mode
    from megatron_vshape.schedules.core.schedule import Placement

    enable_cpu_mode()
    parallel_state.initialize_model_parallel(1, 2)
    model_parallel_cuda_manual_seed(SEED)
    root = pathlib.Path(root)
    v, looped = Placement.v_shape(2), Placement.looped(2)
    results = {}
    for tied in (False, True):
        name = "tied" if tied else "untied"
        # vocabulary parallel (V placement) -> plain (looped)
        freed = []
        chunks, layers = _vocab_chunks(v, tied, seed=11, freed=freed)
        embedding, output = _gathered(layers.embedding_weight), _gathered(layers.output_weight)
        _save(chunks, root / f"{name}-vocab")
        plain = _plain_chunks(looped, tied, seed=12)
        _load(plain, root / f"{name}-vocab")
        got = {}
        if rank == 0:
            got["embedding"] = torch.equal(plain[0].embedding.word_embeddings.weight, embedding)
        if rank == 1:  # the last stage's output layer (tied: Megatron's replica of the embedding)
            got["output"] = torch.equal(plain[0].output_layer.weight, output)
        results[f"{name}: vocab -> plain"] = got
        results[f"{name}: full weights freed"] = freed if rank == 0 else [True]  # rank 0 of a V holds both

        # plain (looped) -> vocabulary parallel (V), and the same at the wrong rows
        plain = _plain_chunks(looped, tied, seed=13)
        _save(plain, root / f"{name}-plain")
        full_embedding = _broadcast(plain[0].embedding.word_embeddings.weight if rank == 0 else
                                    torch.empty(MODEL.vocab_size, MODEL.hidden_size), 0)
        full_output = full_embedding if tied else _broadcast(
            plain[0].output_layer.weight if rank == 1 else torch.empty(MODEL.vocab_size, MODEL.hidden_size), 1)
        for control in (None, "wrong-offset"):
            patch = _wrong_offset() if control else None
            if patch is not None:
                setattr(patch[0], patch[1], patch[2])
            try:
                chunks, layers = _vocab_chunks(v, tied, seed=14)
                _load(chunks, root / f"{name}-plain")
            finally:
                if patch is not None:
                    setattr(patch[0], patch[1], patch[3])
            rows = slice(rank * 32, rank * 32 + 32)  # the true rows of pipeline rank `rank`
            results[f"{name}: plain -> vocab" + (f" ({control})" if control else "")] = {
                "embedding": torch.equal(layers.embedding_weight, full_embedding[rows]),
                "output": torch.equal(layers.output_weight, full_output[rows])}
    results["megatron"] = parallel_state.__file__
    parallel_state.destroy_model_parallel()
    return results


def _check_checkpoints(per_rank: list[dict]) -> None:
    for tied in ("untied", "tied"):
        assert per_rank[0][f"{tied}: vocab -> plain"] == {"embedding": True}
        assert per_rank[1][f"{tied}: vocab -> plain"] == {"output": True}
        assert per_rank[0][f"{tied}: full weights freed"] == [True]
        for rank in (0, 1):
            assert per_rank[rank][f"{tied}: plain -> vocab"] == {"embedding": True, "output": True}
            # the control: shards at the wrong rows load the wrong rows
            assert per_rank[rank][f"{tied}: plain -> vocab (wrong-offset)"] == {"embedding": False, "output": False}


@pytest.mark.slow
def test_checkpoints_move_between_runs_with_and_without_vocabulary_parallelism(tmp_path):
    from megatron_vshape.testing.spawn import spawn

    _check_checkpoints(spawn(checkpoint_rank, 2, (str(tmp_path),), timeout=TIMEOUT))


# --- Megatron-LM main -----------------------------------------------------------------------------------

MAIN_CASES = [Case(1, 2, True, True), Case(2, 2, True, False, sequence_parallel=True)]
MAIN_PROBE = """
import json, sys
import test_vocab_layers as t
from megatron_vshape.testing.spawn import spawn
models = spawn(t.model_rank, 4, (t.MAIN_CASES,), timeout=t.TIMEOUT)
checkpoints = spawn(t.checkpoint_rank, 2, (sys.argv[1],), timeout=t.TIMEOUT)
print("PROBE" + json.dumps({"models": models, "checkpoints": checkpoints}, default=str))
"""


@pytest.mark.slow
@pytest.mark.extended  # 20-25 s of a 2-core machine, most of it one more import of torch and megatron
def test_megatron_lm_main_too(megatron_main, tmp_path):
    """The surgery, the microbatch by hand and the checkpoints on Megatron-LM main (0.20), every rank
    importing the checkout's megatron (an interpreter of its own: the fork server imports megatron once)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from core_versions import checkout_env

    here = Path(__file__).parent
    env = checkout_env(megatron_main, here.parent.parent)
    env["PYTHONPATH"] = f"{env['PYTHONPATH']}:{here}"
    result = subprocess.run([sys.executable, "-c", MAIN_PROBE, str(tmp_path)], capture_output=True, text=True,
                            timeout=2 * TIMEOUT, cwd=tmp_path, env=env)
    found = [line for line in result.stdout.splitlines() if line.startswith("PROBE")]
    assert result.returncode == 0 and found, result.stderr[-4000:]
    out = json.loads(found[-1][len("PROBE"):])
    core = str(megatron_main.resolve() / "megatron" / "core")
    for case in MAIN_CASES:
        ranks = [rank[case.name] for rank in out["models"]]
        assert all(r["megatron"].startswith(core) for r in ranks), ranks[0]["megatron"]
        assert _surgery_failures(case, ranks) == [] and _gradient_failures(ranks) == []
    assert all(rank["megatron"].startswith(core) for rank in out["checkpoints"])
    _check_checkpoints(out["checkpoints"])


# --- sizes and refusals (pure Python) -------------------------------------------------------------------


def _args(**overrides) -> argparse.Namespace:
    base = dict(pipeline_schedule="v-half", pipeline_vocab_parallel=True, ckpt_format="torch_dist",
                mtp_num_layers=None, tensor_model_parallel_size=2, pipeline_model_parallel_size=4,
                context_parallel_size=1, vocab_size=50257, make_vocab_size_divisible_by=128, padded_vocab_size=None)
    return argparse.Namespace(**{**base, **overrides})


def _refusal(args, core_version: str = "0.19.2") -> str:
    from megatron_vshape.megatron.vocab_checks import check_vocab_parallel

    with pytest.raises(ConfigError) as err:
        check_vocab_parallel(args, core_version=core_version)
    text = str(err.value)
    assert "\n" not in text and text.startswith("--pipeline-vocab-parallel")
    return text


def test_vocab_sizes_must_split_into_equal_shards():
    from megatron_vshape.megatron.vocab_checks import check_vocab_sizes, padded_vocab_size

    check_vocab_sizes(64, 2, 4)
    check_vocab_sizes(padded_vocab_size(50257, 128, 8), 8, 4)  # 128 is a multiple of PP 4
    with pytest.raises(ConfigError, match=r"\(48 rows\) does not split into 32 equal shards \(TP 2 x PP 16\).*"
                                          r"--make-vocab-size-divisible-by to a multiple of 16, e.g. 48"):
        check_vocab_sizes(48, 2, 16, divisible_by=24)
    # Megatron's padding with the default 128 leaves 50304 = 393 x 128 rows: not a multiple of PP 5
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert "e.g. 640" in _refusal(_args(tensor_model_parallel_size=1, pipeline_model_parallel_size=5))
    assert "e.g. 640" in _refusal(_args(padded_vocab_size=50304, tensor_model_parallel_size=1,
                                        pipeline_model_parallel_size=5))


def test_check_vocab_parallel_accepts_what_it_supports():
    from megatron_vshape.megatron.vocab_checks import check_vocab_parallel

    check_vocab_parallel(_args(), core_version="0.19.2")
    check_vocab_parallel(_args())  # the installed megatron-core
    check_vocab_parallel(_args(pipeline_schedule="zb-1p", sequence_parallel=True, untie_embeddings_and_output_weights=True),
                         core_version="0.20.0rc0+d98e8a64")
    check_vocab_parallel(_args(pipeline_schedule="interleaved-1f1b"), core_version="0.19.2")  # run by our executor
    check_vocab_parallel(_args(hybrid_layer_pattern="*-*E*-*E"), core_version="0.19.2")  # HybridModel
    # megatron-core 0.19's validation sets --tensor-parallel-num-weight-shards to the TP size when not given:
    # TP's own sharding, not weight sharding (it refused every TP > 1 run through the scripts)
    check_vocab_parallel(_args(tensor_parallel_num_weight_shards=2, gtp_weight_remat_size=1), core_version="0.19.2")


@pytest.mark.parametrize("overrides, core_version, words", [
    ({}, "0.16.1", "needs megatron-core 0.19.2 or Megatron-LM main; 0.16.x is not supported"),
    ({"pipeline_schedule": None}, "0.19.2", "not in Megatron's default schedule; choose a --pipeline-schedule"),
    ({"ckpt_format": "torch"}, "0.19.2", "not --ckpt-format torch; use --ckpt-format torch_dist"),
    ({"mtp_num_layers": 1}, "0.19.2", "drop --mtp-num-layers"),
    ({"hybrid_layer_pattern": "M*M*/MM"}, "0.19.2", "multi-token-prediction part of --hybrid-layer-pattern"),
    ({"context_parallel_size": 2}, "0.19.2", "drop --context-parallel-size"),
    ({"defer_embedding_wgrad_compute": True}, "0.19.2", "drop --defer-embedding-wgrad-compute"),
    ({"use_mup": True}, "0.19.2", "drop --use-mup"),
    ({"logit_dtype": "fp32"}, "0.19.2", "drop --output-logit-dtype"),
    ({"use_megatron_fsdp": True}, "0.19.2", "drop --use-megatron-fsdp"),
    ({"init_model_with_meta_device": True}, "0.19.2", "drop --init-model-with-meta-device"),
    ({"tensor_parallel_num_weight_shards": 4}, "0.19.2", "--tensor-parallel-num-weight-shards above the TP size (2)"),
    ({"tensor_parallel_num_weight_shards": 4, "gtp_weight_remat_size": 2}, "0.19.2", "drop it (Megatron then takes"),
    ({"vocab_size": 50257, "pipeline_model_parallel_size": 3}, "0.19.2", "does not split into 6 equal shards"),
], ids=lambda value: value if isinstance(value, str) else None)
def test_check_vocab_parallel_refuses_in_one_line(overrides, core_version, words):
    assert words in _refusal(_args(**overrides), core_version)


# --- the shard layers alone (one process, no collective) ------------------------------------------------


class _Group:
    """The two questions the shard layers ask a process group."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _layers(tied: bool, pp_rank: int = 1):
    from megatron_vshape.megatron.vocab_layers import VocabShardLayers

    return VocabShardLayers(64, 8, tied=tied, tp_group=_Group(2, 1), pp_group=_Group(2, pp_rank), dp_cp_group=_Group(1, 0))


def test_shard_parameters_are_marked_as_tensor_parallel_rows_and_tied_ones_are_one():
    import torch

    untied, tied = _layers(False), _layers(True)
    assert (untied.shard.start, untied.shard.end) == (48, 64)  # TP rank 1's second half
    assert [name for name, _ in untied.named_parameters()] == ["embedding_weight", "output_weight"]
    assert [name for name, _ in tied.named_parameters()] == ["embedding_weight"]
    for param in untied.parameters():
        assert (param.tensor_model_parallel, param.partition_dim, param.partition_stride) == (True, 0, 1)
        assert param.is_embedding_or_output_parameter and not getattr(param, "shared", False)
    assert tied.output_weight is tied.embedding_weight
    previous = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)  # .to() then makes new parameters
    try:
        tied.double()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(previous)
    assert tied.output_weight is tied.embedding_weight and tied.output_weight.dtype == torch.float64


def test_embedding_lookup_and_its_weight_gradient_land_in_this_ranks_rows():
    import torch

    layers = _layers(False)
    with torch.no_grad():
        layers.embedding_weight.copy_(torch.arange(16 * 8, dtype=torch.float32).view(16, 8))
    tokens = torch.tensor([[47, 48, 63, 3]])
    partial = layers.embed(tokens)
    assert partial.shape == (1, 4, 8) and not partial.requires_grad
    assert torch.equal(partial[0, 1], layers.embedding_weight[0]) and torch.equal(partial[0, 2], layers.embedding_weight[15])
    assert partial[0, 0].abs().sum() == 0 and partial[0, 3].abs().sum() == 0  # rows other ranks hold
    grad = torch.ones(1, 4, 8)
    task = layers.embedding_weight_grad_task(tokens, grad)
    assert task.weight is layers.embedding_weight and layers.embedding_weight.grad is None
    task()
    assert layers.embedding_weight.grad[[0, 15]].eq(1).all() and layers.embedding_weight.grad[1:15].eq(0).all()
    layers.embedding_weight.main_grad = torch.zeros(16, 8)  # as Megatron's DDP gives it
    layers.embedding_weight_grad(tokens, 2 * grad)
    layers.embedding_weight_grad(tokens, grad)
    assert layers.embedding_weight.main_grad[0].eq(3).all() and layers.embedding_weight.grad[0].eq(1).all()
    with pytest.raises(RuntimeError, match="ran twice"):
        task()


def test_a_refusal_that_needs_megatrons_derived_values_comes_before_any_model_is_built():
    """Megatron's validate_args derives values the start-up checks cannot see (here GTP's remat size, from a
    weight-shard count only Megatron resolves): install() runs those checks again, as one line."""
    from megatron_vshape.megatron.arguments import validate_after_megatron

    validate_after_megatron(_args(tensor_parallel_num_weight_shards=2, gtp_weight_remat_size=1))
    with pytest.raises(ConfigError, match="--pipeline-vocab-parallel: --tensor-parallel-num-weight-shards above"):
        validate_after_megatron(_args(tensor_parallel_num_weight_shards=None, gtp_weight_remat_size=2))
