"""Placement (which stages each device holds), costs, and the Schedule value."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

from . import inputs
from .actions import Action, Kind, Pair, VocabKind, parse_step


class ScheduleError(ValueError):
    """A schedule cannot be built for the requested parameters (message says how to fix it)."""


class PlacementKind(enum.Enum):
    LOOPED = "looped"  # device i holds stages i, i+d, i+2d, ... (1F1B, interleaved, ZB)
    V = "v"  # device i holds stages i and 2d-1-i


@dataclass(frozen=True)
class Placement:
    kind: PlacementKind
    stages_per_device: tuple[tuple[int, ...], ...]

    @classmethod
    def looped(cls, num_devices: int, chunks_per_device: int = 1) -> Placement:
        stages = tuple(
            tuple(device + chunk * num_devices for chunk in range(chunks_per_device))
            for device in range(num_devices)
        )
        return cls(PlacementKind.LOOPED, stages)

    @classmethod
    def v_shape(cls, num_devices: int) -> Placement:
        stages = tuple((device, 2 * num_devices - 1 - device) for device in range(num_devices))
        return cls(PlacementKind.V, stages)

    @property
    def num_devices(self) -> int:
        return len(self.stages_per_device)

    @property
    def chunks_per_device(self) -> int:
        return len(self.stages_per_device[0])

    @property
    def num_stages(self) -> int:
        return self.num_devices * self.chunks_per_device

    def device_of(self, stage: int) -> int:
        return self._device_of_stage[stage]

    def chunk_of(self, stage: int) -> int:
        """Index of ``stage`` among its device's stages (the megatron model-chunk index)."""
        return self.stages_per_device[self.device_of(stage)].index(stage)

    def __post_init__(self) -> None:
        # Derived lookup table; hot in simulation, so computed once per placement.
        table = [0] * sum(len(stages) for stages in self.stages_per_device)
        for device, stages in enumerate(self.stages_per_device):
            for stage in stages:
                table[stage] = device
        object.__setattr__(self, "_device_of_stage", tuple(table))

    @property
    def layer_scale(self) -> float:
        """Layers per stage in units of L/(2d) (one V chunk): the cost multiplier of a pass."""
        return 2.0 / self.chunks_per_device


STAGE_WORK_FIELDS = ("f", "b", "w", "memory")


def _out_of_range(work, names, in_range) -> list[str]:
    """``name=value`` of each of ``work``'s fields ``names`` that is not finite or not ``in_range``."""
    return [f"{name}={getattr(work, name)}" for name in names
            if not (math.isfinite(getattr(work, name)) and in_range(getattr(work, name)))]


@dataclass(frozen=True)
class StageWork:
    """Multipliers of one stage's F, B, W time and activation memory, relative to Costs' base values.

    A stage with the embedding or the LM head and loss does more work (and the head's logits hold
    more memory) than a stage of plain layers; 1.0 everywhere is the uniform model.
    """

    f: float = 1.0
    b: float = 1.0
    w: float = 1.0
    memory: float = 1.0
    # The stage's expert all-to-all relative to ``Costs.a2a`` (one V chunk's mean layers): its MoE layers over
    # the mean chunk's, 0 for a stage without one (the planner's +pairs rows, planner/moe_pairs.py).
    a2a: float = 1.0

    def __post_init__(self) -> None:
        # Zero or negative work breaks every "longer work, later end" argument the generators make.
        bad = _out_of_range(self, STAGE_WORK_FIELDS, lambda value: value > 0) + \
            _out_of_range(self, ("a2a",), lambda value: value >= 0)
        if bad:
            raise ScheduleError(f"per-stage multipliers must be finite numbers > 0 (a2a >= 0); got {', '.join(bad)}")

    @property
    def is_unit(self) -> bool:
        return self.f == self.b == self.w == self.memory == self.a2a == 1.0


VOCAB_WORK_FIELDS = ("f", "b", "w", "memory", "embedding", "tokens", "holder", "messages", "send")


@dataclass(frozen=True)
class VocabWork:
    """The vocabulary layers' work under vocabulary parallelism, spread evenly over the pipeline devices.

    ``f``, ``b``, ``w``: the output layer and loss's forward, input-gradient and weight-gradient time
    over the WHOLE vocabulary, as multiples of one V chunk's F, B and W (Costs' base values; the Llama-3
    8B head at PP 8 is about 0.92 of each). ``memory``: what one microbatch's output layer holds from its
    H pass to its G pass over the whole vocabulary (the logits' gradient and the final hidden state), in
    units of one V chunk F's activation. Each of ``p`` shards does 1/p of it. The embedding's lookup is
    taken as free (its collectives run on the vocabulary queue beside the passes). ``embedding`` and
    ``tokens``: the memory of one microbatch's embedding (b x s x h in the pipeline dtype) and of its tokens
    (b x s, 8 bytes each), in the same units: the first stage's device holds a few embeddings and their
    gradients, every device a few microbatches' tokens (:func:`.vocab_embedding.buffer_events`; the
    simulator's memory timeline counts them). ``holder``: what the H of the last stage's device takes
    beyond the others' (the script's loss function and the wait for the hidden gradient's reduce, which only
    that device needs: runtime/vocab_h.py), as a multiple of one V chunk's F; the other devices' G passes
    wait for the end of that H (the loss gradient it broadcasts). ``messages``: how many message times
    (``Costs.comm``) every H waits for in its collectives (the hidden state's broadcast and the statistics'
    gather: 2 by default). ``send``: the hidden gradient's reduce's send buffer (fp32 t x h) that a device other
    than the last stage's holds from its H until its next H or G(k) (:func:`.vocab_embedding.send_events`: one
    at most), in the units of ``embedding``.
    """

    f: float = 0.0
    b: float = 0.0
    w: float = 0.0
    memory: float = 0.0
    embedding: float = 0.0
    tokens: float = 0.0
    holder: float = 0.0
    messages: float = 2.0
    send: float = 0.0

    def __post_init__(self) -> None:
        bad = _out_of_range(self, VOCAB_WORK_FIELDS, lambda value: value >= 0)
        if bad:
            raise ScheduleError(f"vocabulary work must be finite numbers >= 0; got {', '.join(bad)}")

    @classmethod
    def parse(cls, text: str, flag: str = "--vocab-parallel") -> VocabWork:
        """``"time=0.92"`` (f, b and w alike) or ``"f=0.9,b=0.9,w=1.1,memory=0.3,embedding=0.02,tokens=0.001"``;
        omitted keys are 0."""
        values: dict[str, float] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, raw = item.partition("=")
            key = key.strip().lower()
            names = VOCAB_WORK_FIELDS[:3] if key == "time" else (key,)
            if not sep or not set(names) <= set(VOCAB_WORK_FIELDS):
                raise inputs.InputError(f"{flag}: bad item {item[:40]!r}; use e.g. time=0.92 or f=0.9,b=0.9,w=1,memory=0.3")
            value = inputs.comm_cost(f"{flag}: {key}", raw.strip())
            for name in names:
                if name in values:
                    raise inputs.InputError(f"{flag}: {name} is given twice")
                values[name] = value
        return cls(**values)

    def shard_times(self, costs: Costs, shards: int) -> tuple[float, float]:
        """(H, G) time of one shard's passes of one microbatch: H is the forward and the input gradient
        plus ``messages`` messages' worth of collectives (the final hidden state out and the statistics'
        gather; the last stage's device's H takes :meth:`holder_time` more), G the weight gradient."""
        h = (costs.f * self.f + costs.b * self.b) / shards + self.messages * costs.comm
        return h, costs.w * self.w / shards

    def holder_time(self, costs: Costs) -> float:
        """What the last stage's device's H takes beyond :meth:`shard_times`' H."""
        return costs.f * self.holder

    def shard_memory(self, shards: int) -> float:
        return self.memory / shards


@dataclass(frozen=True)
class Costs:
    """Time of one pass over L/(2d) layers (one V chunk), and of one point-to-point message.

    ``stages`` (optional) scales each stage's passes and activation memory, indexed by the
    schedule's global stage index; empty means every stage is alike (the uniform model).
    ``vocab``: the vocabulary layers' work when they run as vocabulary-parallel passes (then the stages'
    work is the layers' alone); None: no vocabulary passes.
    ``a2a``: the expert-parallel all-to-all time of each F and each B, as a multiple of that pass's F time
    (``f`` x the placement's layer scale; the stages' multipliers do not scale it: they model the embedding's
    and the head's extra work, which has no experts). An F or B alone exposes it in full; a pair
    (:class:`~.actions.Pair`) hides each pass's all-to-all under the other's compute (:meth:`pair_time`).
    0: no expert parallelism (every pre-existing result).
    """

    f: float = 1.0
    b: float = 1.0
    w: float = 1.0
    comm: float = 0.0
    stages: tuple[StageWork, ...] = ()
    vocab: VocabWork | None = None
    a2a: float = 0.0

    def __post_init__(self) -> None:
        # NaN passes every `<= 0` check and hangs the reorder; infinity makes all times equal.
        # The ranges are the caller's business (parse checks user text); finiteness is everyone's.
        bad = [f"{name}={getattr(self, name)}" for name in ("f", "b", "w", "comm", "a2a")
               if not math.isfinite(getattr(self, name))]
        if bad:
            raise ScheduleError(f"costs must be finite numbers; got {', '.join(bad)}")
        if self.a2a < 0:
            raise ScheduleError(f"costs: a2a (the all-to-all time per F and B) must be >= 0; got {self.a2a}")
        stages = tuple(self.stages)
        if not all(isinstance(work, StageWork) for work in stages):
            raise ScheduleError("Costs.stages must hold StageWork values (one per stage)")
        object.__setattr__(self, "stages", stages)
        if self.vocab is not None and not isinstance(self.vocab, VocabWork):
            raise ScheduleError("Costs.vocab must be a VocabWork (or None)")

    def of(self, kind: Kind, stage: int | None = None) -> float:
        """Time of one ``kind`` pass of one V chunk's layers on ``stage`` (base time when uniform)."""
        base = self.f if kind is Kind.F else self.b if kind is Kind.B else self.w
        if stage is None or not self.stages:
            return base
        work = self.stages[stage]
        return base * (work.f if kind is Kind.F else work.b if kind is Kind.B else work.w)

    def a2a_time(self, layer_scale: float = 1.0, stage: int | None = None) -> float:
        """The all-to-all time of one F or one B of a stage of ``layer_scale`` V chunks' layers (``stage``'s own
        multiplier ``StageWork.a2a`` where given)."""
        share = self.stages[stage].a2a if stage is not None and self.stages else 1.0
        return self.a2a * self.f * layer_scale * share

    def pair_time(self, forward: float, backward: float, layer_scale: float = 1.0,
                  stages: tuple[int, int] | None = None) -> float:
        """Time of an overlapped pair whose F computes for ``forward`` and whose B for ``backward`` (F's and B's
        stages ``stages``): their compute plus the part of each all-to-all that the other pass's compute does not
        hide."""
        f_stage, b_stage = stages if stages is not None else (None, None)
        a2a_f, a2a_b = self.a2a_time(layer_scale, f_stage), self.a2a_time(layer_scale, b_stage)
        return forward + backward + max(0.0, a2a_f - backward) + max(0.0, a2a_b - forward)

    def memory_of(self, stage: int) -> float:
        """Multiplier of ``stage``'s activation memory per microbatch (1.0 when uniform)."""
        return self.stages[stage].memory if self.stages else 1.0

    def without_vocab(self) -> Costs:
        """The costs of the transformer passes alone (what a generator schedules before the vocabulary
        passes are placed)."""
        return replace(self, vocab=None) if self.vocab is not None else self

    def with_stages(self, stages) -> Costs:
        """A copy with per-stage work ``stages`` (a sequence of StageWork; empty: uniform)."""
        return replace(self, stages=tuple(stages))

    @property
    def uniform(self) -> bool:
        """True when every stage is alike: the generators then run exactly today's code paths."""
        return all(work.is_unit for work in self.stages)

    def check_stages(self, num_stages: int, schedule: str = "this schedule") -> None:
        """Refuse per-stage work whose length is not the schedule's stage count."""
        if self.stages and len(self.stages) != num_stages:
            raise ScheduleError(
                f"per-stage costs give {len(self.stages)} stages but {schedule} has {num_stages} "
                f"(V: 2 per device; 1F1B/ZB: 1 per device; interleaved: chunks per device); "
                f"give one value per stage")

    @classmethod
    def parse(cls, text: str) -> Costs:
        """Parse ``"f=1,b=1.1,w=0.9,comm=0.05,a2a=0.5"``; omitted keys keep their defaults (a2a: 0).

        Each value must be finite and in range (see :mod:`.inputs`), else an InputError (a
        ValueError) naming the field, e.g. ``--costs: f: must be a finite number in [...]``.
        """
        values: dict[str, float] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, raw = item.partition("=")
            key = key.strip().lower()
            if not sep or key not in ("f", "b", "w", "comm", "a2a"):
                raise inputs.InputError(f"--costs: bad item {item[:40]!r}; use e.g. f=1,b=1,w=1,comm=0,a2a=0.5")
            check = inputs.comm_cost if key in ("comm", "a2a") else inputs.cost
            values[key] = check(f"--costs: {key}", raw.strip())
        return cls(**values)


def looped_stage_work(costs: Costs, num_devices: int) -> tuple[StageWork, ...]:
    """Per-stage work of the same model cut into ``num_devices`` looped stages (1F1B's).

    The model's layers run in global stage order on every placement, so 1F1B's stage j holds
    V stages 2j and 2j+1 (interleaved: j*v .. j*v+v-1); each multiplier is their mean, as a
    looped stage's pass takes the time of its chunks together. Empty when ``costs`` are uniform.
    """
    if costs.uniform:
        return ()
    group, rest = divmod(len(costs.stages), num_devices)
    if rest or not group:
        raise ScheduleError(f"per-stage costs give {len(costs.stages)} stages, not a multiple of {num_devices} devices")
    chunks = [costs.stages[j * group:(j + 1) * group] for j in range(num_devices)]
    return tuple(
        StageWork(**{name: sum(getattr(w, name) for w in chunk) / group for name in (*STAGE_WORK_FIELDS, "a2a")})
        for chunk in chunks
    )


def one_f_one_b_peak(num_devices: int, costs: Costs = Costs()) -> float:
    """The worst device's peak activation under 1F1B, in memory units (one microbatch over L/d
    layers): device i holds d - i forwards of its stage, weighted by that stage's memory.
    The reference for every "x 1F1B's memory" cap (ZB-1P/2P, V-ZB, v-auto's limit); ``d``
    when costs are uniform."""
    if costs.uniform:
        return float(num_devices)
    stages = looped_stage_work(costs, num_devices)
    return max((num_devices - i) * work.memory for i, work in enumerate(stages))


def parse_stage_work(text: str, num_stages: int, flag: str = "--stage-costs") -> tuple[StageWork, ...]:
    """Parse ``"f=1.6,1,1,2.9;b=...;w=...;memory=..."`` into one StageWork per stage.

    Groups are separated by ``;``; each names a key (``f``, ``b``, ``w``, ``memory``, or ``time``
    for f, b and w together) and gives ``num_stages`` comma-separated multipliers in global stage
    order (V: stage 2d-1-i lives on device i). A key given once (``time=1.5,1,1,1.5``) sets those
    fields; omitted keys stay 1. Errors are one line naming ``flag``.
    """
    columns: dict[str, list[float]] = {}
    for group in filter(None, (part.strip() for part in text.split(";"))):
        key, sep, raw = group.partition("=")
        key = key.strip().lower()
        fields = STAGE_WORK_FIELDS[:3] if key == "time" else (key,)
        if not sep or not set(fields) <= set(STAGE_WORK_FIELDS):
            raise inputs.InputError(
                f"{flag}: bad group {group[:40]!r}; use e.g. f=2,1,1,2;memory=1,1,1,3 (keys f, b, w, memory, time)")
        values = [inputs.cost(f"{flag}: {key}[{i}]", item.strip()) for i, item in enumerate(raw.split(","))]
        if len(values) != num_stages:
            raise inputs.InputError(
                f"{flag}: {key} has {len(values)} values but the schedule has {num_stages} stages; give one per stage")
        for name in fields:
            if name in columns:
                raise inputs.InputError(f"{flag}: {name} is given twice")
            columns[name] = values
    if not columns:
        raise inputs.InputError(f"{flag}: empty; use e.g. f=2,1,1,2;memory=1,1,1,3")
    return tuple(
        StageWork(**{name: columns[name][stage] for name in columns}) for stage in range(num_stages)
    )


@dataclass(frozen=True)
class MemoryModel:
    """How one F's activations are released: ``b_release`` by B, the rest by W.

    The default (0.0) is the paper's simple model: B frees nothing, W frees everything.
    The authors' GPT model (F allocates 34h+5as per token, W releases 32h) corresponds to
    ``b_release = 1 - 32h / (34h + 5as)``; see :meth:`for_gpt`.
    """

    b_release: float = 0.0

    @classmethod
    def for_gpt(cls, hidden: int, heads: int, seq_length: int) -> MemoryModel:
        allocated = 34 * hidden + 5 * heads * seq_length
        return cls(b_release=1.0 - 32 * hidden / allocated)

    def delta(self, kind: Kind, activation: float) -> float:
        if kind is Kind.F:
            return activation
        if kind is Kind.B:
            return -activation * self.b_release
        return -activation * (1.0 - self.b_release)


@dataclass(frozen=True)
class Schedule:
    """One ordered program of actions per device, plus the placement it runs on."""

    name: str
    placement: Placement
    num_microbatches: int
    programs: tuple[tuple[Action, ...], ...]
    meta: dict = field(default_factory=dict, compare=False, hash=False)
    # True for schedules that never split the backward (GPipe, 1F1B, interleaved): each W directly
    # follows its B and the runtime runs the pair as one ordinary backward, so the input gradient
    # leaves the device only when the pair ends.
    fused_backward: bool = False
    # True when the programs also hold the vocabulary passes (H and G of every shard and microbatch;
    # see actions.VocabKind and generators/vocab_passes.py).
    vocab_parallel: bool = False
    # Overlapped F&B pairs (actions.Pair). Each pair's halves are adjacent in their device's program, forward
    # first: the program order stays a legal serial order, and the ledger counts the F's allocation before the
    # B's release (what an overlapped pair can hold at once). The validator checks both.
    pairs: frozenset[Pair] = frozenset()

    @property
    def num_devices(self) -> int:
        return self.placement.num_devices

    def steps(self, device: int) -> list[Action | Pair]:
        """``device``'s program with each pair as one step (what runs as one unit)."""
        program = self.programs[device]
        if not self.pairs:
            return list(program)
        backward_of = {pair.forward: pair for pair in self.pairs}
        out: list[Action | Pair] = []
        i = 0
        while i < len(program):
            pair = backward_of.get(program[i])
            if pair is not None and i + 1 < len(program) and program[i + 1] == pair.backward:
                out.append(pair)
                i += 2
            else:
                out.append(program[i])
                i += 1
        return out

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    def device_of(self, action: Action) -> int:
        if isinstance(action.kind, VocabKind):
            return action.stage  # a vocabulary shard lives on the device of its index
        return self.placement.device_of(action.stage)

    @property
    def vocab_shards(self) -> int:
        """Vocabulary shards (one per device) when the programs hold vocabulary passes, else 0."""
        return self.num_devices if self.vocab_parallel else 0

    def pass_cost(self, action: Action, costs: Costs) -> float:
        if isinstance(action.kind, VocabKind):
            h, g = vocab_pass_times(costs, self.num_devices)
            if action.kind is VocabKind.G:
                return g
            holder = self.placement.device_of(self.num_stages - 1)
            return h + (costs.vocab.holder_time(costs) if action.stage == holder else 0.0)
        return costs.of(action.kind, action.stage) * self.placement.layer_scale

    def activation(self, stage: int | None = None, costs: Costs | None = None) -> float:
        """Activation of one F in memory units (one microbatch over L/d layers), times
        ``costs.memory_of(stage)`` when both are given."""
        if costs is None or stage is None:
            return self.placement.layer_scale / 2.0
        return stage_activation(self.placement, stage, costs)

    def work_per_device(self, costs: Costs) -> list[float]:
        costs.check_stages(self.num_stages, self.name)
        return [sum(self.pass_cost(a, costs) for a in program) for program in self.programs]

    def to_text(self) -> str:
        """One line per device, steps separated by spaces, a pair as ``F3.7&B5.2`` (round-trips with from_text)."""
        return "\n".join(" ".join(str(step) for step in self.steps(device)) for device in range(self.num_devices))

    @classmethod
    def from_text(cls, text: str, name: str, placement: Placement) -> Schedule:
        lines = [[parse_step(tok) for tok in line.split()] for line in text.strip().splitlines()]
        if len(lines) != placement.num_devices:
            raise ScheduleError(f"{len(lines)} program lines for {placement.num_devices} devices")
        pairs = frozenset(step for steps in lines for step in steps if isinstance(step, Pair))
        programs = tuple(
            tuple(a for step in steps for a in (step if isinstance(step, Pair) else (step,))) for steps in lines
        )
        microbatches = {a.microbatch for program in programs for a in program}
        vocab = any(isinstance(a.kind, VocabKind) for program in programs for a in program)
        return cls(name, placement, max(microbatches) + 1 if microbatches else 0, programs, vocab_parallel=vocab,
                   pairs=pairs)


def vocab_pass_times(costs: Costs, shards: int) -> tuple[float, float]:
    """(H, G) time of one shard's vocabulary passes; ScheduleError when ``costs`` carry no vocabulary work."""
    if costs.vocab is None:
        raise ScheduleError("this schedule holds vocabulary passes: give their costs (Costs.vocab, "
                            "--vocab-parallel on the command line)")
    return costs.vocab.shard_times(costs, shards)


def stage_activation(placement: Placement, stage: int, costs: Costs) -> float:
    """One F's activation on ``stage``, in memory units (one microbatch over L/d layers)."""
    return placement.layer_scale / 2.0 * costs.memory_of(stage)
