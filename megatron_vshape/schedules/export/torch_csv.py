"""Export to, and import from, the CSV schedule format of ``torch.distributed.pipelining``.

PyTorch's runtime (``PipelineScheduleMulti._load_csv`` and ``_PipelineScheduleRuntime._load_csv``,
checked against torch 2.13) reads a "compute_only" CSV:

* one row per pipeline rank, in rank order (row ``r`` is rank ``r``);
* one cell per action, in the order the rank runs them: ``{stage}{type}{microbatch}`` with a
  *global* stage index, e.g. ``0F1`` = stage 0 forward of microbatch 1;
* types: ``F`` forward, ``I`` input-gradient backward (our ``B``), ``W`` weight-gradient
  backward (our ``W``), ``B`` full backward (input and weight gradient together);
* an empty cell is a bubble (``None``); rows may have different lengths.

What PyTorch requires of such a schedule (``_validate_schedule``):

* every stage runs exactly ``n_microbatches`` forwards;
* every ``I`` has its ``W`` (equal counts per stage), and ``B + (I + W) / 2 == n_microbatches``:
  so our W passes *must* be present; a W may only come after the ``I`` of the same stage and
  microbatch on that rank, and an ``I``/``B`` only after its ``F``;
* one stage lives on one rank (the stage-to-rank map is inferred from the CSV, so both the
  looped and the V placement load as they are);
* the lowering to sends/receives (``_add_send_recv``) and its dry run
  (``_simulate_comms_compute``) must make progress, i.e. the per-rank order must be free of
  deadlocks. Adjacent stages on one rank (the tip of the V) exchange nothing.

:func:`to_torch_csv` writes our B as ``I`` and our W as ``W`` (exact), or, with
``merge_backward=True``, writes a B immediately followed by its W as one full ``B`` (what
PyTorch's own ``_merge_bw`` does; cheaper at run time). By default it merges exactly for the
schedules with ``Schedule.fused_backward`` (GPipe, 1F1B, interleaved 1F1B), whose B+W pairs
are one ordinary backward. :func:`from_torch_csv` reads either: a full ``B`` becomes our B
followed by W, and a file whose backwards are all full ``B`` gives a ``fused_backward``
schedule (so 1F1B round-trips with the same simulated timing). Communication and FSDP actions
(``SEND_F``, ``RECV_B``, ``UNSHARD``, ``REDUCE_GRAD``, ...) of a "compute_comms" dump are
skipped, and an ``OVERLAP_F_B`` cell ``(0F1;3B0)OVERLAP_F_B`` contributes its sub-actions in
order.

No torch import here: the format is plain text.
"""

from __future__ import annotations

import csv
import io
import re

from ..core import inputs
from ..core.actions import Action, Kind
from ..core.schedule import Placement, Schedule, ScheduleError

_CELL_RE = re.compile(r"^(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)$")
_OVERLAP_RE = re.compile(r"^\((.*)\)(\w+)$")
_TO_TORCH = {Kind.F: "F", Kind.B: "I", Kind.W: "W"}
# Longest stage or microbatch index read (10^9 - 1): beyond any real schedule, and it keeps int()
# away from Python's digit limit. Larger but still absurd indices are caught by the checks below.
_MAX_DIGITS = 9


def to_torch_csv(schedule: Schedule, merge_backward: bool | None = None) -> str:
    """The schedule as PyTorch's compute-only CSV, one row per rank.

    ``merge_backward`` (default: ``schedule.fused_backward``) writes each B that is directly
    followed by its W as one full backward ``B`` cell.
    """
    if merge_backward is None:
        merge_backward = schedule.fused_backward
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for program in schedule.programs:
        writer.writerow(_row(program, merge_backward))
    return out.getvalue()


def _row(program: tuple[Action, ...], merge_backward: bool) -> list[str]:
    cells = []
    i = 0
    while i < len(program):
        action = program[i]
        nxt = program[i + 1] if i + 1 < len(program) else None
        if (
            merge_backward
            and action.kind is Kind.B
            and nxt == Action(Kind.W, action.stage, action.microbatch)
        ):
            cells.append(f"{action.stage}B{action.microbatch}")
            i += 2
            continue
        cells.append(f"{action.stage}{_TO_TORCH[action.kind]}{action.microbatch}")
        i += 1
    return cells


def from_torch_csv(
    text: str,
    name: str,
    placement: Placement,
    num_microbatches: int | None = None,
    fused_backward: bool | None = None,
) -> Schedule:
    """Parse PyTorch's CSV into a :class:`Schedule` on ``placement``.

    ``num_microbatches`` defaults to the largest microbatch index + 1. ``fused_backward``
    defaults to True when every backward in the file is a full ``B`` (no ``I``/``W``). Raises
    :class:`ScheduleError` for malformed cells, a row count that is not the placement's device
    count, or an action on a device that does not hold its stage, and an InputError (a ValueError)
    for a microbatch count the file cannot hold (fewer forwards of some stage than microbatches:
    checked before anything is sized by the count). Completeness and dependency order are left to
    :func:`~megatron_vshape.schedules.validate`.
    """
    programs = parse_torch_csv(text)
    if len(programs) != placement.num_devices:
        raise ScheduleError(
            f"torch CSV has {len(programs)} rows (ranks) but the placement has {placement.num_devices} "
            f"devices; pass the matching --stages"
        )
    for rank, program in enumerate(programs):
        for action in program:
            if action.stage >= placement.num_stages:
                raise ScheduleError(
                    f"torch CSV rank {rank}: stage {action.stage} does not exist "
                    f"({placement.num_stages} stages in a {placement.kind.value} placement)"
                )
            if placement.device_of(action.stage) != rank:
                raise ScheduleError(
                    f"torch CSV rank {rank}: {action} belongs to device {placement.device_of(action.stage)} "
                    f"in the {placement.kind.value} placement; check --placement"
                )
    if num_microbatches is None:
        microbatches = [a.microbatch for program in programs for a in program]
        num_microbatches = max(microbatches) + 1 if microbatches else 0
    inputs.check_microbatches_held((a for program in programs for a in program), placement.num_stages,
                                   num_microbatches, source="torch CSV")
    if fused_backward is None:
        fused_backward = _all_full_backward(text)
    return Schedule(name, placement, num_microbatches, tuple(programs), fused_backward=fused_backward)


def _all_full_backward(text: str) -> bool:
    kinds = {m.group(1) for m in re.finditer(r"\d+([FIBW])\d+", text)}
    return "B" in kinds and not kinds & {"I", "W"}


def parse_torch_csv(text: str) -> tuple[tuple[Action, ...], ...]:
    """The CSV's rows as our actions (row r = rank r), with no placement checks."""
    try:
        rows = list(csv.reader(io.StringIO(text)))
    except csv.Error as err:  # e.g. a field over the csv module's size limit
        raise ScheduleError(f"torch CSV: not readable as CSV ({err})") from None
    # A trailing blank line (or a file ending with several newlines) is not a rank.
    while rows and not any(cell.strip() for cell in rows[-1]):
        rows.pop()
    return tuple(
        tuple(action for col, cell in enumerate(row) for action in _parse_cell(cell, rank, col))
        for rank, row in enumerate(rows)
    )


def _parse_cell(cell: str, rank: int, col: int) -> list[Action]:
    cell = cell.strip()
    if not cell:
        return []
    overlap = _OVERLAP_RE.match(cell)
    if overlap is not None:
        return [a for sub in overlap.group(1).split(";") for a in _parse_cell(sub, rank, col)]
    match = _CELL_RE.match(cell)
    if match is None:
        raise ScheduleError(
            f"torch CSV rank {rank}, cell {col + 1}: cannot parse {cell!r} "
            f"(expected e.g. '0F1', '3I0', '3W0', '2B4')"
        )
    stage_text, kind, mb_text = match.groups()
    if kind not in ("F", "I", "B", "W"):
        return []  # communication / FSDP / grad-reduction actions: not part of our programs
    if not mb_text:
        raise ScheduleError(f"torch CSV rank {rank}, cell {col + 1}: {cell!r} has no microbatch index")
    if max(len(stage_text), len(mb_text)) > _MAX_DIGITS:
        raise ScheduleError(f"torch CSV rank {rank}, cell {col + 1}: index in {cell[:40]!r} has more than "
                            f"{_MAX_DIGITS} digits")
    stage, mb = int(stage_text), int(mb_text)
    if kind == "F":
        return [Action(Kind.F, stage, mb)]
    if kind == "I":
        return [Action(Kind.B, stage, mb)]
    if kind == "W":
        return [Action(Kind.W, stage, mb)]
    return [Action(Kind.B, stage, mb), Action(Kind.W, stage, mb)]  # full backward
