"""TensorBoard output: scalars, a custom-scalars layout, a grad-norm heatmap and the findings.

Every function returns a `Summary` proto built with TensorBoard's own compiled protos, so this
module needs neither torch nor Lightning (nor PIL: the heatmap is encoded as PNG with zlib).
Hand a summary to any `SummaryWriter`, the small protocol that both torch's
``SummaryWriter._get_file_writer()`` and `EventWriter` (`stabilizer.outputs.event_file`) satisfy:

    writer.add_summary(custom_scalars_layout(), 0)  # once per run
    writer.add_summary(scalar_summary(record.values), record.step)

Tags are the signal keys under ``stability/``; the layout puts the per-layer gradient norms
(``stability/grad_norm/<group>``) on one multi-line chart, which TensorBoard's plain scalars view
cannot do.
"""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Protocol

import numpy as np
from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import metadata as custom_scalar_metadata
from tensorboard.plugins.text import metadata as text_metadata

from stabilizer.core.records import Finding
from stabilizer.core.signals import (
    ACT_ABSMAX_PREFIX,
    CLIP_VAL,
    CLIPPED,
    EMBED,
    GRAD_NORM,
    GRAD_NORM_PREFIX,
    HEAD,
    LOSS,
    LOSS_SCALE,
    SKIPPED,
    TB_PREFIX,
    UPDATE_RATIO_PREFIX,
    block_index,
)

from .event_file import EventWriter

__all__ = [
    "FINDINGS_TAG",
    "HEATMAP_DESCRIPTION",
    "HEATMAP_TAG",
    "EventWriter",
    "SummaryWriter",
    "custom_scalars_layout",
    "depth_order",
    "findings_text",
    "heatmap_png",
    "heatmap_summary",
    "image_summary",
    "png_size",
    "scalar_summary",
]

FINDINGS_TAG = TB_PREFIX + "findings"  # text: the findings table
HEATMAP_TAG = TB_PREFIX + "grad_norm_heatmap"  # image: log10 grad norm, layers x steps

# matplotlib's viridis at 17 evenly spaced points (CC0); interpolated linearly in between.
_VIRIDIS = np.array(
    [
        [68, 1, 84], [72, 24, 106], [71, 45, 123], [66, 64, 134], [59, 82, 139], [51, 99, 141],
        [44, 114, 142], [38, 130, 142], [33, 145, 140], [31, 160, 136], [40, 174, 128],
        [63, 188, 115], [94, 201, 98], [132, 212, 75], [173, 220, 48], [216, 226, 25],
        [253, 231, 37],
    ],
    dtype=np.float64,
)  # fmt: skip
_NAN_RGB = (228, 26, 28)  # red: not in viridis, so a NaN cell stands out
_INF_RGB = (255, 255, 255)  # white: +inf or -inf
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class SummaryWriter(Protocol):
    """Anything that writes a `Summary` at a step: torch's ``FileWriter``, `EventWriter`."""

    def add_summary(self, summary: Summary, global_step: int | None = None) -> None:
        """Write ``summary`` as an event at ``global_step``."""


def scalar_summary(values: Mapping[str, float]) -> Summary:
    """One scalar per signal, tagged ``stability/<key>``: ``{"loss": 2.5}`` → ``stability/loss``.

    TensorBoard stores each value as float32; NaN and Inf are kept as such.

    Args:
        values: Plain floats keyed by signal keys without the prefix (a `StepRecord`'s values).
    """
    return Summary(
        value=[
            Summary.Value(tag=TB_PREFIX + key, simple_value=float(value))
            for key, value in values.items()
        ]
    )


def _tag(key: str) -> str:
    return re.escape(TB_PREFIX + key)


def _chart(title: str, *regexes: str) -> layout_pb2.Chart:
    # TensorBoard matches a tag regex with re.match: anchored at the start only, so end with $.
    return layout_pb2.Chart(title=title, multiline=layout_pb2.MultilineChartContent(tag=regexes))


DEPTH_GROUPS = r"(?:embed|block_\d+|head|other)"
"""The standard depth groups of any depth: runs of 4 and 12 layers share one chart."""


def custom_scalars_layout(
    groups: Sequence[str] | None = None,
    keys: Collection[str] | None = None,
) -> Summary:
    """The custom-scalars layout: one ``stability`` category of multi-line charts.

    Write it once per run (TensorBoard merges the layouts of the runs in a logdir by category
    title and keeps the first chart of a title: so a chart's regex must fit every run). The
    charts, each a list of tag regexes:

    - ``gradient norm per layer``: every ``stability/grad_norm/<group>`` (not the total);
    - ``gradient norm (total) and clip threshold``: ``stability/grad_norm``, ``stability/clip_val``;
    - ``loss``; ``loss scale``; ``clipped and skipped steps`` (``clipped``, ``skipped``);
    - ``update ratio per layer``: every ``stability/update_ratio/<group>``;
    - ``activation max |x|``: every ``stability/act_absmax/<module>``.

    Args:
        groups: The run's depth groups. The standard ones (`DEPTH_GROUPS`, any depth) are
            always matched; other names (a ``grouping=`` of the user's) are added. None: any.
        keys: The signal keys the run logs: ``loss scale`` is written only when ``loss_scale``
            is among them, ``update ratio per layer`` only with an ``update_ratio/`` key (no
            empty charts). None: all charts.
    """
    if groups is None:
        group = r"[^/]+"
    else:
        extra = [re.escape(g) for g in groups if not re.fullmatch(DEPTH_GROUPS, g)]
        group = "(?:" + "|".join([DEPTH_GROUPS, *extra]) + ")"

    def has(prefix: str) -> bool:
        return keys is None or any(key.startswith(prefix) for key in keys)

    charts = [
        _chart("gradient norm per layer", _tag(GRAD_NORM_PREFIX) + group + "$"),
        _chart(
            "gradient norm (total) and clip threshold", _tag(GRAD_NORM) + "$", _tag(CLIP_VAL) + "$"
        ),
        _chart("loss", _tag(LOSS) + "$"),
        *([_chart("loss scale", _tag(LOSS_SCALE) + "$")] if has(LOSS_SCALE) else []),
        _chart("clipped and skipped steps", _tag(CLIPPED) + "$", _tag(SKIPPED) + "$"),
        *(
            [_chart("update ratio per layer", _tag(UPDATE_RATIO_PREFIX) + group + "$")]
            if has(UPDATE_RATIO_PREFIX)
            else []
        ),
        _chart("activation max |x|", _tag(ACT_ABSMAX_PREFIX) + ".*"),
    ]
    layout = layout_pb2.Layout(category=[layout_pb2.Category(title="stability", chart=charts)])
    tensor = tensor_pb2.TensorProto(
        dtype="DT_STRING",
        string_val=[layout.SerializeToString()],
        tensor_shape=tensor_shape_pb2.TensorShapeProto(),
    )
    value = Summary.Value(
        tag=custom_scalar_metadata.CONFIG_SUMMARY_TAG,
        tensor=tensor,
        metadata=custom_scalar_metadata.create_summary_metadata(),
    )
    return Summary(value=[value])


def depth_order(groups: Iterable[str]) -> list[str]:
    """Depth groups from the input side to the output side: embed, blocks by index, head, rest.

    ``depth_order(["head", "block_10", "embed", "block_02"])`` is
    ``["embed", "block_02", "block_10", "head"]``; unknown names come last, sorted.
    """

    def key(group: str) -> tuple[int, int, str]:
        index = block_index(group)
        if group == EMBED:
            return (0, 0, group)
        if index is not None:
            return (1, index, group)
        return (2, 0, group) if group == HEAD else (3, 0, group)

    return sorted(groups, key=key)


def _colours(matrix: np.ndarray, vmin: float | None, vmax: float | None) -> np.ndarray:
    """RGB uint8 of shape (rows, cols, 3): viridis over [vmin, vmax], red NaN, white ±inf."""
    finite = np.isfinite(matrix)
    if vmin is None:
        vmin = float(matrix[finite].min()) if finite.any() else 0.0
    if vmax is None:
        vmax = float(matrix[finite].max()) if finite.any() else vmin + 1.0
    span = vmax - vmin if vmax > vmin else 1.0
    position = np.clip((np.where(finite, matrix, vmin) - vmin) / span, 0.0, 1.0)
    position *= len(_VIRIDIS) - 1
    lower = np.minimum(position.astype(np.int64), len(_VIRIDIS) - 2)
    frac = (position - lower)[..., None]
    rgb = _VIRIDIS[lower] * (1.0 - frac) + _VIRIDIS[lower + 1] * frac  # (rows, cols, 3)
    rgb[np.isnan(matrix)] = _NAN_RGB
    rgb[np.isinf(matrix)] = _INF_RGB
    out: np.ndarray = np.rint(rgb).astype(np.uint8)
    return out


def _log10(values: np.ndarray, vmin: float | None) -> np.ndarray:
    """log10 of the magnitudes; a zero goes to the bottom of the scale, not to -inf (a fault)."""
    with np.errstate(divide="ignore"):
        logged = np.log10(np.abs(values))
    finite = np.isfinite(logged)
    floor = vmin if vmin is not None else (float(logged[finite].min()) if finite.any() else 0.0)
    return np.where(values == 0, floor, logged)


def _bin_columns(matrix: np.ndarray, max_cols: int) -> np.ndarray:
    """At most ``max_cols`` columns, each the max of a run of steps; NaN in a run stays NaN."""
    cols = matrix.shape[1]
    if cols <= max_cols:
        return matrix
    starts = np.linspace(0, cols, max_cols, endpoint=False).astype(np.int64)
    return np.maximum.reduceat(matrix, starts, axis=1)


def _png(rgb: np.ndarray) -> bytes:
    """The PNG file of an 8-bit RGB image of shape (height, width, 3)."""
    height, width, _ = rgb.shape
    # Each scanline starts with its filter type; 0 is "none".
    raw = np.concatenate([np.zeros((height, 1), np.uint8), rgb.reshape(height, width * 3)], axis=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    idat = zlib.compress(raw.tobytes(), 6)
    return _PNG_SIGNATURE + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def heatmap_png(
    matrix: np.ndarray,
    *,
    log10: bool = True,
    vmin: float | None = None,
    vmax: float | None = None,
    cell: tuple[int, int] = (4, 12),
    max_size: tuple[int, int] = (2048, 1200),
) -> bytes:
    """A layers x steps heatmap as PNG: one row per depth group, one column per step.

    Row 0 is drawn at the top, so pass rows input side first (see `depth_order`). Colours follow
    viridis from dark purple (``vmin``) to yellow (``vmax``); NaN cells are red and ±inf cells
    white. Past ``max_size[0] // cell[0]`` steps, neighbouring steps share a column that shows
    their maximum (a NaN among them shows). Rows get thinner when there are too many for
    ``max_size[1]``.

    Args:
        matrix: Values of shape (layers, steps), for example gradient norms.
        log10: Colour by log10 of the values (a zero norm maps to the bottom of the scale).
        vmin: The value at the bottom of the colour scale (after log10); default: the finite min.
        vmax: The value at the top of the colour scale; default: the finite max.
        cell: The smallest cell, (width, height) in pixels; small matrices get wider cells.
        max_size: The largest image, (width, height) in pixels.

    Raises:
        ValueError: ``matrix`` is not 2-D or is empty, or a size is below 1.
    """
    values = np.asarray(matrix, dtype=np.float64)
    if values.ndim != 2 or values.size == 0:
        raise ValueError(f"`matrix` must be 2-D and non-empty, got shape {values.shape}")
    if min(*cell, *max_size) < 1:
        raise ValueError(f"`cell` and `max_size` must be >= 1, got {cell} and {max_size}")
    if log10:
        values = _log10(values, vmin)
    values = _bin_columns(values, max(1, max_size[0] // cell[0]))
    rows, cols = values.shape
    cell_w = max(cell[0], min(32, 512 // cols))  # widen short runs up to a readable width
    cell_h = max(1, min(cell[1], max_size[1] // rows))
    rgb = _colours(values, vmin, vmax)
    rgb = np.repeat(np.repeat(rgb, cell_h, axis=0), cell_w, axis=1)
    return _png(rgb)


def png_size(png: bytes) -> tuple[int, int]:
    """The (height, width) of a PNG image, read from its header.

    Raises:
        ValueError: ``png`` does not start with a PNG signature and header.
    """
    if png[:8] != _PNG_SIGNATURE or png[12:16] != b"IHDR":
        raise ValueError(f"`png` must be a PNG image, got bytes starting {png[:16]!r}")
    width, height = struct.unpack(">II", png[16:24])
    return height, width


def image_summary(
    tag: str,
    png: bytes,
    height: int | None = None,
    width: int | None = None,
    description: str = "",
) -> Summary:
    """An image summary of an encoded PNG, shown by TensorBoard's images dashboard.

    Args:
        tag: The image tag, for example `HEATMAP_TAG`.
        png: The encoded image (see `heatmap_png`).
        height: Image height in pixels; default: read from the PNG header.
        width: Image width in pixels; default: read from the PNG header.
        description: Markdown shown with the image (what the rows and colours mean).
    """
    if height is None or width is None:
        height, width = png_size(png)
    image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=png)
    metadata = summary_pb2.SummaryMetadata(summary_description=description)
    return Summary(value=[Summary.Value(tag=tag, image=image, metadata=metadata)])


def _cell(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|")


def _row(finding: Finding) -> str:
    steps = str(finding.step)
    if finding.end_step is not None and finding.end_step != finding.step:
        steps += f"–{finding.end_step}"
    location = ", ".join(f"`{_cell(name)}`" for name in finding.location)
    remedies = ", ".join(f"`{name}`" for name in finding.remedies)
    cells = (steps, finding.severity.name.lower(), finding.kind, _cell(finding.message))
    return "| " + " | ".join((*cells, location, remedies)) + " |"


def findings_text(findings: Sequence[Finding], tag: str = FINDINGS_TAG) -> Summary:
    """The findings as a markdown table for TensorBoard's text dashboard, in the given order.

    Columns: steps (``start–end``), severity, kind, message, location, remedies. With no
    findings the text says so.

    Args:
        findings: The findings to list.
        tag: The text tag.
    """
    if findings:
        lines = [
            "| steps | severity | kind | message | location | remedies |",
            "|---|---|---|---|---|---|",
            *(_row(finding) for finding in findings),
        ]
        markdown = "\n".join(lines)
    else:
        markdown = "No findings."
    tensor = tensor_pb2.TensorProto(
        dtype="DT_STRING",
        string_val=[markdown.encode("utf-8")],
        tensor_shape=tensor_shape_pb2.TensorShapeProto(),
    )
    metadata = text_metadata.create_summary_metadata(display_name="findings", description="")
    return Summary(value=[Summary.Value(tag=tag, tensor=tensor, metadata=metadata)])


HEATMAP_DESCRIPTION = (
    "log10 gradient norm per depth group (rows, input side at the top) over the steps (columns; "
    "the live monitor's image covers its most recent 500 steps; where steps outnumber the "
    "columns, neighbours share one showing their maximum); red: NaN, white: Inf, a zero norm: "
    "the bottom colour"
)


def heatmap_summary(matrix: np.ndarray) -> Summary:
    """The per-layer gradient-norm heatmap of ``matrix`` (groups x steps) as `HEATMAP_TAG`."""
    return image_summary(HEATMAP_TAG, heatmap_png(matrix), description=HEATMAP_DESCRIPTION)
