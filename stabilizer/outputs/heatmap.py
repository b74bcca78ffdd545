"""The per-layer gradient-norm heatmap, one drawing for ``diagnose --plot`` and TensorBoard.

Layers are rows (input side at the top, ``other`` apart below a line: its depth is unknown),
steps the x axis, log10 of the norm the colour, with a colour bar; NaN is red, Inf white, and a
zero norm (no gradient at all) the bottom of the scale, as in the pixel image. `draw_heatmap`
draws into a matplotlib axis; `labelled_heatmap_png` makes the TensorBoard image from it when
matplotlib (the optional extra ``plot``) is installed, and otherwise falls back to the plain
pixel image of `stabilizer.outputs.tensorboard.heatmap_png` with the labels in its description.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from stabilizer.core.signals import OTHER

__all__ = [
    "draw_heatmap",
    "fallback_description",
    "heatmap_figure",
    "labelled_heatmap_png",
    "matplotlib_available",
    "warm_up",
]

_MAX_LABELS = 16  # y tick labels shown; deeper stacks label every n-th layer
_MIN_HEIGHT = 2.8  # inches: the y axis label, "layer (input side at the top)", stood up


def matplotlib_available() -> bool:
    """Whether matplotlib (with its Agg backend) can be imported."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    except ImportError:
        return False
    return True


def draw_heatmap(fig: Any, ax: Any, steps: Sequence[int], groups: Sequence[str], rows: Any) -> None:
    """Draw layers x steps into ``ax``: labelled rows, a step axis, a log10 colour bar.

    Args:
        fig: The matplotlib figure (for the colour bar).
        ax: The axis to draw in.
        steps: The step of each column (increasing).
        groups: The row labels, input side first (``other`` last, if present).
        rows: Values of shape (groups, steps).
    """
    from matplotlib import colormaps

    values = np.abs(np.asarray(rows, dtype=np.float64))
    with np.errstate(divide="ignore"):
        logged = np.log10(values)
    finite = np.isfinite(logged)
    low, high = (logged[finite].min(), logged[finite].max()) if finite.any() else (0.0, 1.0)
    logged[values == 0] = low  # no gradient at all: the bottom of the scale, not a fault
    logged[np.isinf(values)] = high + 1.0  # above the scale: white
    # floats, widened when one point, at any magnitude (steps may pass 2**63)
    first, last = (float(steps[0]), float(steps[-1])) if len(steps) else (0.0, 1.0)
    last = max(last, first + max(1.0, abs(first) * 1e-9))
    image = ax.imshow(
        np.ma.masked_invalid(logged), aspect="auto", interpolation="nearest",
        extent=(first, last, len(groups) - 0.5, -0.5), vmin=low, vmax=max(high, low + 1e-9),
        cmap=colormaps["viridis"].with_extremes(bad="red", over="white"),
    )  # fmt: skip
    every = max(1, len(groups) // _MAX_LABELS)
    ticks = sorted({*range(0, len(groups), every), len(groups) - 1})
    ax.set_yticks(ticks, [groups[i] for i in ticks], fontsize=7)
    if OTHER in groups:  # not the output end: set apart
        ax.axhline(groups.index(OTHER) - 0.5, color="white", linewidth=2)
    ax.set_ylabel("layer (input side at the top)")
    ax.set_xlabel("step")
    fig.colorbar(image, ax=ax, label="log10 grad norm", pad=0.01)


def heatmap_figure(steps: Sequence[int], groups: Sequence[str], rows: Any) -> Any:
    """The heatmap's matplotlib figure (matplotlib required): 0.22 inch a row, and never lower
    than its axis label is long, so that a small stack's label is not cut."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    height = max(_MIN_HEIGHT, 1.2 + 0.22 * len(groups))
    fig = Figure(figsize=(9, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    draw_heatmap(fig, ax, steps, groups, rows)
    ax.set_title("gradient norm per layer", fontsize=9)
    return fig


def labelled_heatmap_png(steps: Sequence[int], groups: Sequence[str], rows: Any) -> bytes | None:
    """The heatmap as a labelled PNG, or None without matplotlib (see `fallback_description`)."""
    if not matplotlib_available():
        return None
    out = io.BytesIO()
    heatmap_figure(steps, groups, rows).savefig(out, format="png")
    return out.getvalue()


@functools.cache
def warm_up() -> None:
    """Draw one tiny heatmap, once per process: matplotlib's first figure loads its fonts (a
    second or more on a CPU), one-time work that a live run's first heatmap would otherwise pay
    in the middle of its steps (and the monitor's cost meter count as per-step cost)."""
    labelled_heatmap_png([0, 1], ["embed"], [[1.0, 2.0]])


def fallback_description(steps: Sequence[int], groups: Sequence[str], rows: Any) -> str:
    """What the unlabelled pixel image shows: its rows top to bottom, steps, colour scale."""
    values = np.asarray(rows, dtype=np.float64)
    positive = values[np.isfinite(values) & (values > 0)]
    scale = (
        f"colour: log10 grad norm from {np.log10(positive.min()):.1f} (dark purple) to "
        f"{np.log10(positive.max()):.1f} (yellow)"
        if positive.size
        else "colour: no finite norm"
    )
    span = f"steps {steps[0]}–{steps[-1]} left to right" if len(steps) else "no steps"
    apart = f" ({OTHER}: depth unknown, not the output end)" if OTHER in groups else ""
    return (
        f"rows top to bottom: {', '.join(groups)}{apart}; {span}; {scale}; red: NaN, white: Inf "
        "(install matplotlib for a labelled image)"
    )
