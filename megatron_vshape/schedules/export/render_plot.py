"""Pictures of a simulated schedule, in the style of the paper's figures (needs matplotlib).

:func:`plot_schedule` draws devices as rows (device 0 on top) and time on x; every pass is a box
coloured by kind (F blue, B teal, W purple), lighter for a device's first model chunk and darker
for its later ones (the second leg of the V), with the microbatch number inside when it fits.
Idle time stays white. :func:`plot_memory` draws each device's activation memory over time.

matplotlib is imported inside the functions, so this module (and the package) imports without
it. We draw on a bare :class:`matplotlib.figure.Figure` (Agg canvas): no pyplot, no global
backend switch, safe in headless jobs and in threads.
"""

from __future__ import annotations

from pathlib import Path

from ..core.actions import Kind, VocabKind
from ..core.simulator import SimulationResult

# (light, dark) per kind: the light shade is chunk 0, the dark one the last chunk.
_PALETTE = {
    Kind.F: ("#9cc3ee", "#2b62a8"),
    Kind.B: ("#92dcc0", "#16866a"),
    Kind.W: ("#cfbdf0", "#6a45b0"),
    VocabKind.H: ("#f5b971", "#f5b971"),  # one shade: a vocabulary shard is no model chunk
    VocabKind.G: ("#f2df8c", "#f2df8c"),
}
_KIND_NAME = {Kind.F: "F (forward)", Kind.B: "B (input grad)", Kind.W: "W (weight grad)",
              VocabKind.H: "H (vocabulary: output layer and loss, all devices together)",
              VocabKind.G: "G (vocabulary weight grad)"}
_FORMATS = {".png", ".svg", ".pdf"}


def _mix(light: str, dark: str, t: float) -> tuple[float, float, float]:
    from matplotlib.colors import to_rgb

    a, b = to_rgb(light), to_rgb(dark)
    return tuple(x + (y - x) * t for x, y in zip(a, b))


def _chunk(placement, action) -> int:
    """The model chunk a pass's box is shaded by (vocabulary passes: their own colour, chunk 0)."""
    return 0 if isinstance(action.kind, VocabKind) else placement.chunk_of(action.stage)


def _colour(kind: Kind, chunk: int, chunks: int) -> tuple[float, float, float]:
    light, dark = _PALETTE[kind]
    return _mix(light, dark, chunk / (chunks - 1) if chunks > 1 else 0.55)


def _text_colour(rgb) -> str:
    luminance = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]
    return "white" if luminance < 0.55 else "#1a1a1a"


def check_image_path(path, flag: str = "-o") -> Path:
    """``path`` as a Path if its suffix names a format we write, else ValueError naming ``flag``."""
    path = Path(path)
    if path.suffix.lower() not in _FORMATS:
        raise ValueError(f"{flag}: cannot tell the image format of {str(path)!r}; end the name in .png, .svg or .pdf")
    return path


def _default_title(result: SimulationResult) -> str:
    s = result.schedule
    return (
        f"{s.name}   d={s.num_devices}, m={s.num_microbatches}   "
        f"bubble {result.bubble_rate:.1%}   peak activation memory {result.peak_memory_max:.3g}"
    )


def plot_schedule(result: SimulationResult, path, title: str | None = None, labels: bool = True) -> Path:
    """Write the schedule picture to ``path`` (.png, .svg or .pdf) and return the path."""
    path = check_image_path(path)
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    schedule = result.schedule
    placement = schedule.placement
    devices = schedule.num_devices
    chunks = placement.chunks_per_device
    total = result.makespan_total or 1.0

    width = min(max(8.0, 0.22 * total), 40.0)
    row = 0.42 if devices <= 16 else max(0.08, 8.0 / devices)
    height = 1.7 + row * devices
    fig = Figure(figsize=(width, height), layout="constrained")
    ax = fig.add_subplot()

    groups: dict[tuple[Kind, int], list[tuple[float, float, int]]] = {}
    for action, iv in result.timeline.items():
        key = (action.kind, _chunk(placement, action))
        groups.setdefault(key, []).append((iv.start, iv.end - iv.start, iv.device))

    bar = 0.86
    line = 0.5 if devices <= 32 else 0.0
    for (kind, chunk), boxes in sorted(groups.items(), key=lambda kv: (kv[0][0].value, kv[0][1])):
        colour = _colour(kind, chunk, chunks)
        for device in range(devices):
            spans = [(start, dur) for start, dur, dev in boxes if dev == device]
            if spans:
                ax.broken_barh(spans, (device - bar / 2, bar), facecolors=colour,
                               edgecolors="#303030", linewidth=line)

    ax.set_xlim(0, total)
    ax.set_ylim(devices - 0.5, -0.5)  # device 0 on top
    step = max(1, devices // 16)
    ax.set_yticks(range(0, devices, step))
    ax.set_yticklabels([f"device {d}" for d in range(0, devices, step)])
    ax.set_xlabel("time (cost units)")
    for spine in ("top", "right"):
        ax.spines[spine].set_visible(False)
    ax.tick_params(axis="y", length=0)
    ax.set_title(title if title is not None else _default_title(result), loc="left", fontsize=11)

    if labels:
        _label_boxes(fig, ax, result, total, width, row, chunks)

    handles = []
    for kind in (Kind.F, Kind.B, Kind.W, *(VocabKind if schedule.vocab_parallel else ())):
        if chunks == 1 or isinstance(kind, VocabKind):
            handles.append(Patch(facecolor=_colour(kind, 0, 1), edgecolor="#303030", label=_KIND_NAME[kind]))
        else:
            for chunk in range(chunks):
                handles.append(Patch(facecolor=_colour(kind, chunk, chunks), edgecolor="#303030",
                                     label=f"{kind.value}, chunk {chunk}"))
    handles.append(Patch(facecolor="white", edgecolor="#909090", label="idle"))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 7), frameon=False,
               fontsize=9)
    fig.savefig(path, dpi=150 if path.suffix.lower() == ".png" else None)
    return path


def _label_boxes(fig, ax, result, total, width, row, chunks) -> None:
    """Print the microbatch number in each box that is wide and tall enough for it."""
    placement = result.schedule.placement
    # Width of the axes in points is approximately the figure width minus the y-label margin.
    points_per_unit = (width - 1.1) * 72.0 / total
    fontsize = min(8.0, row * 72.0 * 0.55)
    if fontsize < 4.0:
        return
    for action, iv in result.timeline.items():
        text = str(action.microbatch)
        box_points = (iv.end - iv.start) * points_per_unit
        if box_points < fontsize * 0.62 * len(text) + 2.0:
            continue
        colour = _colour(action.kind, _chunk(placement, action), chunks)
        ax.text((iv.start + iv.end) / 2, iv.device, text, ha="center", va="center",
                fontsize=fontsize, color=_text_colour(colour))


def plot_memory(result: SimulationResult, path, title: str | None = None) -> Path:
    """Write a step plot of each device's activation memory over time to ``path``."""
    path = check_image_path(path)
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    schedule = result.schedule
    devices = schedule.num_devices
    total = result.makespan_total or 1.0
    fig = Figure(figsize=(min(max(8.0, 0.12 * total), 24.0), 4.2), layout="constrained")
    ax = fig.add_subplot()
    cmap = colormaps["viridis"]
    for device, timeline in enumerate(result.memory_timeline):
        # Several events at one instant (a release, then an allocation) draw as one step.
        level_at: dict[float, float] = {}
        for time, level in timeline:
            level_at[time] = level
        xs = list(level_at) + [total]
        ys = list(level_at.values())
        ys.append(ys[-1] if ys else 0.0)
        colour = cmap(device / max(1, devices - 1))
        label = f"device {device} (peak {result.peak_memory[device]:.3g})" if devices <= 12 else None
        ax.step(xs, ys, where="post", color=colour, linewidth=1.4, label=label)
    ax.axhline(result.peak_memory_max, color="#b03030", linestyle="--", linewidth=0.8)
    ax.set_xlim(0, total)
    ax.set_ylim(0, result.peak_memory_max * 1.1 or 1.0)
    ax.set_xlabel("time (cost units)")
    ax.set_ylabel("activation memory\n(microbatches x L/d layers)")
    for spine in ("top", "right"):
        ax.spines[spine].set_visible(False)
    if title is None:
        s = schedule
        title = (f"{s.name}   d={s.num_devices}, m={s.num_microbatches}   activation memory per device"
                 f" (peak {result.peak_memory_max:.3g}, dashed)")
    ax.set_title(title, loc="left", fontsize=11)
    if devices <= 12:
        fig.legend(loc="outside right upper", fontsize=8, frameon=False)
    fig.savefig(path, dpi=150 if path.suffix.lower() == ".png" else None)
    return path
