"""The picture of a diagnosis, drawn with matplotlib (the optional extra ``plot``) on Agg.

Panels, top to bottom, sharing the step axis: the loss with every incident shaded (numbered as in
the timeline, coloured by severity, red marks where the loss is NaN/Inf); the total gradient norm
(log scale); the loss scale (log scale) when logged; a heatmap of log10 per-layer gradient norms
(input side at the top, NaN in red) when logged. Curves come from the bounded `History`: each
bin draws its min-max band and its last value; each segment of a restarted run is its own curve.
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

from stabilizer.core.records import Severity
from stabilizer.core.signals import GRAD_NORM, GRAD_NORM_PREFIX, LOSS, LOSS_SCALE
from stabilizer.outputs.heatmap import draw_heatmap
from stabilizer.outputs.tensorboard import depth_order
from stabilizer.outputs.wording import counted
from stabilizer.replay.diagnose import Diagnosis
from stabilizer.replay.history import Bin, History

from .files import write_file
from .incidents import incidents

__all__ = ["PlotUnavailable", "plot_diagnosis", "require_matplotlib"]

_COLOURS = {
    Severity.INFO: "tab:gray",
    Severity.WARNING: "tab:orange",
    Severity.ERROR: "tab:red",
    Severity.CRITICAL: "darkred",
}
_SEGMENT_COLOURS = ("tab:blue", "tab:green", "tab:purple", "tab:brown", "tab:olive", "tab:cyan")
_LIMIT = 10**300  # steps and values beyond it are left out: floats end near 1.8e308
_INSTALL = "`--plot` needs matplotlib: pip install 'stabilizer-lightning[plot]'"


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed; the message says how to get it."""


def require_matplotlib() -> None:
    """Import matplotlib now, so that a missing install fails before a long read.

    Raises:
        PlotUnavailable: matplotlib cannot be imported.
    """
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    except ImportError:
        raise PlotUnavailable(_INSTALL) from None


def _curve(ax: Any, diagnosis: Diagnosis, key: str, log: bool) -> bool:
    """Draw ``key``, a colour per segment (band and last values); False when nothing to draw."""
    series = diagnosis.history.series(key)
    drawn = False
    for segment in diagnosis.segments:
        rows = [
            (step, low, high, last)
            for step, seg, low, high, last in zip(
                series.steps, series.segments, series.low, series.high, series.last, strict=True
            )
            if seg == segment.index and math.isfinite(last) and (last > 0 or not log)
        ]
        if not rows:
            continue
        steps, lows, highs, lasts = (list(map(float, column)) for column in zip(*rows, strict=True))
        colour = _SEGMENT_COLOURS[(segment.index - 1) % len(_SEGMENT_COLOURS)]
        label = f"segment {segment.index}" if len(diagnosis.segments) > 1 else None
        ax.fill_between(steps, lows, highs, color=colour, alpha=0.25, linewidth=0)
        ax.plot(steps, lasts, color=colour, linewidth=1.0, label=label)
        drawn = True
    if drawn and log:
        ax.set_yscale("log")
    return drawn


def _incidents(ax: Any, diagnosis: Diagnosis) -> None:
    """Shade each incident's steps and number it as the timeline does."""
    for incident in incidents(diagnosis):
        colour = _COLOURS.get(incident.worst.severity, "tab:gray")
        start = float(incident.start)
        end = float(incident.end) if incident.end is not None else start
        if end > start:
            ax.axvspan(start, end, color=colour, alpha=0.2, linewidth=0)
        else:
            ax.axvline(start, color=colour, alpha=0.6, linewidth=1.5)
        ax.text(  # staggered, so that incidents that start together stay readable
            start, 0.98 - 0.09 * (incident.number % 3), f"#{incident.number}",
            color=colour, fontsize=8, va="top",
            transform=ax.get_xaxis_transform(),
        )  # fmt: skip


def _nonfinite_marks(ax: Any, diagnosis: Diagnosis) -> None:
    series = diagnosis.history.series(LOSS)
    steps = [float(step) for step, bad in zip(series.steps, series.nonfinite, strict=True) if bad]
    if steps:
        ax.scatter(
            steps, [0.02] * len(steps), marker="^", color="red", s=12, label="NaN/Inf loss",
            transform=ax.get_xaxis_transform(), zorder=3,
        )  # fmt: skip


def _heatmap(fig: Any, ax: Any, diagnosis: Diagnosis, groups: list[str]) -> None:
    steps, rows = diagnosis.history.matrix(groups)
    draw_heatmap(fig, ax, steps, groups, rows)  # the drawing TensorBoard's image uses too
    ax.set_xlabel("")  # the shared step axis is labelled once, below


def _plottable(diagnosis: Diagnosis) -> tuple[Diagnosis, list[str]]:
    """``diagnosis`` less what no axis can draw, and a note on each kind of thing left out.

    Steps are ints of any size (a log may say ``step=10**400``), and a curve spanning ±1.8e308
    has no finite range: matplotlib draws floats in range, so those bins and values go.
    """
    bins, steps_out, values_out = [], 0, 0
    for one in diagnosis.history.bins:
        if not _fits(one.first_step, one.last_step):
            steps_out += 1
            continue
        wild = [key for key, entry in one.series.items() if _wild(key, entry)]
        if wild:
            values_out += len(wild)
            series = {
                k: [math.nan, math.nan, math.nan, e[3]] if k in wild else e
                for k, e in one.series.items()
            }
            one = Bin(one.first_step, one.last_step, one.segment, one.count, series)
        bins.append(one)
    found = diagnosis.findings
    findings = [item for item in found if _fits(item.finding.step, item.finding.end_step)]
    notes = [f"{steps_out} plot points at steps beyond ±1e300"] if steps_out else []
    notes += [f"{values_out} plot points with values beyond ±1e300"] if values_out else []
    if not notes and len(findings) == len(found):
        return diagnosis, []
    history = diagnosis.history
    kept = History(history.capacity)
    kept.bins, kept.width, kept.records = bins, history.width, history.records
    return replace(diagnosis, history=kept, findings=findings), notes


def _fits(*steps: int | None) -> bool:
    return all(step is None or -_LIMIT < step < _LIMIT for step in steps)


def _wild(key: str, entry: list[float]) -> bool:
    """A curve's min, max or last beyond `_LIMIT` (the heatmap draws log10 of any norm)."""
    return not key.startswith(GRAD_NORM_PREFIX) and any(abs(x) > _LIMIT for x in entry[:3])


def plot_diagnosis(diagnosis: Diagnosis, path: Path, force: bool = False) -> list[str]:
    """Draw the diagnosis and save it as a PNG at ``path`` (see `stabilizer.report.files`).

    Returns:
        Notes on what the picture leaves out, and matplotlib's warnings, one line each.

    Raises:
        PlotUnavailable: matplotlib is not installed.
        OSError: ``path`` cannot be written, or exists and ``force`` is off.
    """
    require_matplotlib()
    diagnosis, left_out = _plottable(diagnosis)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        png = _draw(diagnosis)
    write_file(path, png, force)
    notes = [f"note: {what} are left out of {path}" for what in left_out]
    return notes + [f"note: plot: {text}" for text in dict.fromkeys(str(w.message) for w in caught)]


def _draw(diagnosis: Diagnosis) -> bytes:
    """The PNG image of the diagnosis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    keys = diagnosis.history.keys()
    groups = depth_order(diagnosis.history.groups())
    panels = [LOSS, GRAD_NORM, *([LOSS_SCALE] if LOSS_SCALE in keys else [])]
    panels += ["heatmap"] if groups else []
    fig = Figure(figsize=(11, 2.4 * len(panels) + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, panel in zip(axes, panels, strict=True):
        if panel == "heatmap":
            _heatmap(fig, ax, diagnosis, groups)
            continue
        drawn = _curve(ax, diagnosis, panel, panel != LOSS)
        ax.set_ylabel(panel.replace("_", " "))
        if not drawn:
            ax.text(0.5, 0.5, f"no {panel} in this log", ha="center", transform=ax.transAxes)
        _incidents(ax, diagnosis)
    _nonfinite_marks(axes[0], diagnosis)
    if len(diagnosis.segments) > 1 or LOSS in diagnosis.history.nonfinite_keys():
        axes[0].legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("step")
    name = "standard input" if diagnosis.path == "-" else diagnosis.path
    records = counted(diagnosis.records, "record")
    fig.suptitle(f"{name} ({diagnosis.format}, {records})", fontsize=10)
    image = io.BytesIO()
    fig.savefig(image, dpi=100, format="png")
    return image.getvalue()
