"""Megatron's own flags (after ``vshape plan ... --``, or read from a recipe) -> the planner's inputs.

They are parsed with Megatron-LM's own parser (``megatron.training.arguments.add_megatron_arguments``)
where megatron.training is installed, so every flag has Megatron's name, type and default. Where it is
not (megatron-core alone, as in the 0.16.1 environment), :func:`subset_parser` reads the flags the
planner uses, with the same names, destinations and defaults; ``ParsedFlags.parser`` says which ran.
Flags that do not describe the model, the batch or the parallel setup are ignored.

The derived defaults are Megatron's ``validate_args`` (0.19): ``--ffn-hidden-size`` 4h, or
``int(8h/3 / 64) * 64`` with ``--swiglu``; ``--kv-channels`` h / heads; the query groups equal the
heads without ``--group-query-attention``; ``--moe-ffn-hidden-size`` defaults to the FFN size.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass

from ..cli_parser import UsageError
from .model import GPTModel

# --vocab-size is optional in Megatron: the tokenizer says it. The recipes' tokenizers:
TOKENIZER_VOCAB = {None: 50257, "GPT2BPETokenizer": 50257, "Llama2Tokenizer": 32000}


@dataclass(frozen=True)
class ParsedFlags:
    """What the planner takes from a recipe's flags."""

    model: GPTModel
    parser: str  # "megatron-lm <version>" or "subset (megatron.training not installed)"
    global_batch: int | None
    micro_batch: int | None
    fp8: bool
    flash_attention: bool
    recompute: str  # the recipe's own mode: none | selective | full
    distributed_optimizer: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    grad_reduce_in_bf16: bool
    sizes: dict[str, int]  # the recipe's parallel sizes (tp, pp, cp, ep), for reference
    notes: tuple[str, ...] = ()


class _RaisingParser(argparse.ArgumentParser):
    """argparse that raises a one-line UsageError instead of printing usage and exiting."""

    def error(self, message):
        raise UsageError(f"Megatron flags: {message}")


def subset_parser() -> argparse.ArgumentParser:
    """The flags the planner reads, named and defaulted as Megatron-LM 0.19 does."""
    p = _RaisingParser(prog="megatron flags", allow_abbrev=False, add_help=False)
    for flag, kind, default in (
        ("--num-layers", int, None), ("--hidden-size", int, None), ("--ffn-hidden-size", int, None),
        ("--num-attention-heads", int, None), ("--num-query-groups", int, 1), ("--kv-channels", int, None),
        ("--seq-length", int, None), ("--vocab-size", int, None), ("--make-vocab-size-divisible-by", int, 128),
        ("--num-experts", int, None), ("--moe-router-topk", int, 2), ("--moe-ffn-hidden-size", int, None),
        ("--moe-shared-expert-intermediate-size", int, None), ("--moe-layer-freq", int, 1),
        ("--hybrid-layer-pattern", str, None), ("--position-embedding-type", str, "learned_absolute"),
        ("--normalization", str, "LayerNorm"), ("--micro-batch-size", int, None), ("--global-batch-size", int, None),
        ("--tensor-model-parallel-size", int, 1), ("--pipeline-model-parallel-size", int, 1),
        ("--context-parallel-size", int, 1), ("--expert-model-parallel-size", int, 1), ("--fp8-format", str, None),
        ("--recompute-granularity", str, None), ("--recompute-method", str, None), ("--recompute-num-layers", int, None),
        ("--attention-backend", str, "auto"), ("--tokenizer-type", str, None), ("--mamba-state-dim", int, 128),
        ("--mamba-head-dim", int, 64), ("--mamba-num-groups", int, 8), ("--mamba-num-heads", int, None),
    ):
        dest = "fp8" if flag == "--fp8-format" else None
        p.add_argument(flag, type=kind, default=default, **({"dest": dest} if dest else {}))
    for flag in ("--group-query-attention", "--swiglu", "--untie-embeddings-and-output-weights",
                 "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                 "--grad-reduce-in-bf16", "--sequence-parallel", "--use-flash-attn"):
        p.add_argument(flag, action="store_true")
    p.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    p.add_argument("--recompute-modules", nargs="*", default=None)
    return p


@functools.cache
def megatron_parser() -> tuple[argparse.ArgumentParser, str]:
    """Megatron-LM's parser and its name, or the subset parser where megatron.training is missing."""
    from megatron_vshape.python_compat import bridge_typing_override

    bridge_typing_override()  # megatron.training imports typing.override (Python 3.12+); on 3.11 the bridge gives it
    try:
        from megatron.training.arguments import add_megatron_arguments
    except ImportError as error:
        return subset_parser(), f"subset (megatron.training not importable: {error.__class__.__name__})"
    from importlib.metadata import PackageNotFoundError, version
    try:
        release = version("megatron-core")
    except PackageNotFoundError:
        release = "?"
    parser = _RaisingParser(prog="megatron flags", allow_abbrev=False, add_help=False)
    return add_megatron_arguments(parser), f"megatron-lm {release}"


def _int_or_none(value):
    return int(value) if isinstance(value, int) else None


def relevant(argv: list[str]) -> tuple[list[str], int]:
    """The words of ``argv`` that set a flag the planner reads (with their values), and how many flags
    were dropped. A recipe's other flags may be malformed once its unset variables expand to nothing
    (``--save $CHECKPOINT_PATH`` with no path); they do not describe the model, so they are not parsed."""
    known = {o for a in subset_parser()._actions for o in a.option_strings}
    kept, dropped, keep = [], 0, False
    for word in argv:
        if word.startswith("--"):
            keep = word.split("=", 1)[0] in known
            dropped += not keep
        if keep:
            kept.append(word)
    return kept, dropped


def parse_flags(argv: list[str], use_megatron: bool = True) -> ParsedFlags:
    """Megatron flags -> the model and settings; UsageError (one line, naming the flag) if incomplete."""
    parser, name = megatron_parser() if use_megatron else (subset_parser(), "subset")
    argv, dropped = relevant(argv)
    args, _ = parser.parse_known_args(argv)
    get = lambda key, default=None: getattr(args, key, default)  # noqa: E731 (older Megatrons lack some)
    notes = []
    pattern_text = get("hybrid_layer_pattern")
    pattern, segments = None, ()
    if pattern_text:
        parts = pattern_text.split("/")[0].split("|")  # '/' starts Megatron's MTP part: not pipeline layers
        pattern = "".join(parts)
        segments = tuple(len(p) for p in parts) if len(parts) > 1 else ()
    layers = get("num_layers") or (len(pattern) if pattern else None)
    for key, flag in (("hidden_size", "--hidden-size"), ("num_attention_heads", "--num-attention-heads"),
                      ("seq_length", "--seq-length")):
        if not get(key):
            raise UsageError(f"Megatron flags: {flag} is required to plan (give it after --, or in the recipe)")
    if not layers:
        raise UsageError("Megatron flags: --num-layers (or --hybrid-layer-pattern) is required to plan")
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    ffn = get("ffn_hidden_size") or (int(4 * hidden * 2 / 3 / 64) * 64 if get("swiglu") else 4 * hidden)
    vocab = get("vocab_size")
    if vocab is None:
        tokenizer = get("tokenizer_type")
        if tokenizer not in TOKENIZER_VOCAB:
            raise UsageError(f"Megatron flags: --tokenizer-type {tokenizer} does not say its vocabulary; "
                             "add --vocab-size")
        vocab = TOKENIZER_VOCAB[tokenizer]
        notes.append(f"vocabulary {vocab} from --tokenizer-type {tokenizer or 'GPT2BPETokenizer (default)'}")
    freq = get("moe_layer_freq", 1)
    if not isinstance(freq, int):
        raise UsageError("Megatron flags: --moe-layer-freq as a list is not modelled; give an integer")
    experts = get("num_experts") or 0
    model = GPTModel(
        "megatron", layers, hidden, heads, get("seq_length"), vocab, ffn_hidden=ffn,
        query_groups=get("num_query_groups") if get("group_query_attention") else None,
        kv_channels=get("kv_channels"), swiglu=bool(get("swiglu")), bias=bool(get("add_bias_linear", True)),
        rmsnorm=get("normalization") == "RMSNorm",
        learned_positions=get("position_embedding_type", "learned_absolute") == "learned_absolute",
        num_experts=experts, moe_topk=get("moe_router_topk") or 2, moe_ffn_hidden=get("moe_ffn_hidden_size"),
        moe_shared_ffn=get("moe_shared_expert_intermediate_size") or 0, moe_layer_freq=freq, causal=True,
        pattern=pattern, segments=segments, mamba_state=get("mamba_state_dim") or 128,
        mamba_head_dim=get("mamba_head_dim") or 64, mamba_groups=get("mamba_num_groups") or 8,
        mamba_heads=get("mamba_num_heads") or 0,
        make_vocab_divisible_by=get("make_vocab_size_divisible_by") or 128,
        tied_embeddings=not get("untie_embeddings_and_output_weights", False))
    backend = str(get("attention_backend", "auto")).rsplit(".", 1)[-1].lower()  # AttnBackend enum or text
    granularity = get("recompute_granularity") or "none"
    sizes = {"tp": get("tensor_model_parallel_size", 1), "pp": get("pipeline_model_parallel_size", 1),
             "cp": get("context_parallel_size", 1), "ep": get("expert_model_parallel_size", 1)}
    if dropped:
        notes.append(f"{dropped} flags that do not describe the model, batch or parallel setup ignored")
    return ParsedFlags(model, name, _int_or_none(get("global_batch_size")), _int_or_none(get("micro_batch_size")),
                       bool(get("fp8")), backend not in ("unfused", "local"), granularity,
                       bool(get("use_distributed_optimizer")), bool(get("overlap_grad_reduce")),
                       bool(get("overlap_param_gather")), bool(get("grad_reduce_in_bf16")), sizes, tuple(notes))
