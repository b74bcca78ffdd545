"""TensorBoard output: scalars, a custom-scalars layout, a grad-norm heatmap and the findings.

Every function returns a `Summary` proto built with TensorBoard's own compiled protos, so this
module needs neither torch nor Lightning (nor PIL: the heatmap is encoded as PNG with zlib).
Hand a summary to any `SummaryWriter`, the small protocol that both torch's
``SummaryWriter._get_file_writer()`` and `EventWriter` (`stabilizer.outputs.event_file`) satisfy:

    writer.add_summary(custom_scalars_layout(), 0)  # once per run
    writer.add_summary(scalar_summary({**values, **log10_norms(values)}), record.step)
    writer.add_summary(findings_text(table.rows, as_of=step), FINDINGS_STEP)  # when it changes

Tags are the signal keys under ``stability/``; the layout puts the per-layer gradient norms
(``stability/grad_norm/<group>``) on one multi-line chart, which TensorBoard's plain scalars view
cannot do, and their log10 (``stability/grad_norm_log10/<group>``) on another, where a starved
band of layers stands apart on TensorBoard's default linear axis. The findings table is one text
entry, rewritten as episodes open, grow and end (`stabilizer.outputs.findings_table`)."""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Protocol

import numpy as np
from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import metadata as custom_scalar_metadata

from stabilizer.core.signals import (
    ACT_ABSMAX_PREFIX,
    CLIP_VAL,
    CLIPPED,
    EMBED,
    GRAD_NORM,
    GRAD_NORM_LOG10_PREFIX,
    GRAD_NORM_PREFIX,
    HEAD,
    LOSS,
    LOSS_SCALE,
    SKIPPED,
    SO_FAR_PREFIX,
    TB_PREFIX,
    UPDATE_RATIO_PREFIX,
    block_index,
)

from .event_file import EventWriter
from .findings_table import FINDINGS_STEP, FINDINGS_TAG, FindingsTable, findings_text, table_rows
from .heatmap_png import heatmap_png, png_size

__all__ = [
    "FINDINGS_STEP",
    "FINDINGS_TAG",
    "HEATMAP_DESCRIPTION",
    "HEATMAP_TAG",
    "LOG10_CHART",
    "STEPS_CHART",
    "EventWriter",
    "FindingsTable",
    "StepCounts",
    "SummaryWriter",
    "custom_scalars_layout",
    "depth_order",
    "findings_text",
    "heatmap_png",
    "heatmap_summary",
    "image_summary",
    "log10_norms",
    "png_size",
    "scalar_summary",
    "table_rows",
]

HEATMAP_TAG = TB_PREFIX + "grad_norm_heatmap"  # image: log10 grad norm, layers x steps


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


def _decades(value: float) -> float:
    if value > 0.0:
        return math.log10(value)  # inf stays inf
    return -math.inf if value == 0.0 else math.nan  # (NaN, and a negative norm: a fault)


def log10_norms(values: Mapping[str, float]) -> dict[str, float]:
    """log10 of each per-layer gradient norm, ``grad_norm/<g>`` → ``grad_norm_log10/<g>``.

    On TensorBoard's linear axis a decade is one unit, so a band of layers a million times
    weaker than the rest sits 6 below them (the raw norms squash it onto the zero line). A
    zero norm is -inf; NaN stays NaN.

    Args:
        values: Plain floats keyed by signal keys (a `StepRecord`'s values); other keys ignored.
    """
    cut = len(GRAD_NORM_PREFIX)
    return {
        GRAD_NORM_LOG10_PREFIX + key[cut:]: _decades(value)
        for key, value in values.items()
        if key.startswith(GRAD_NORM_PREFIX)
    }


class StepCounts:
    """How many steps so far were skipped and clipped, for TensorBoard's chart of them: the
    0/1 signals themselves, mostly 0, lie flat on the zero line under TensorBoard's default
    "ignore outliers in chart scaling"; a count that steps up does not."""

    def __init__(self) -> None:
        self.counts: dict[str, float] = {}

    def add(self, values: Mapping[str, float]) -> dict[str, float]:
        """Count one record; the counts so far as views (``so_far/skipped``, ``so_far/clipped``),
        of the signals the run has logged."""
        for key in (SKIPPED, CLIPPED):
            if key in values:
                self.counts[key] = self.counts.get(key, 0.0) + (values[key] >= 0.5)
        return {SO_FAR_PREFIX + key: count for key, count in self.counts.items()}


def _tag(key: str) -> str:
    return re.escape(TB_PREFIX + key)


def _chart(title: str, *regexes: str) -> layout_pb2.Chart:
    # TensorBoard matches a tag regex with re.match: anchored at the start only, so end with $.
    return layout_pb2.Chart(title=title, multiline=layout_pb2.MultilineChartContent(tag=regexes))


LOG10_CHART = "gradient norm per layer, log10 (-3 is 1e-3)"
STEPS_CHART = "clipped and skipped steps, so far"

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

    - ``gradient norm per layer, log10``: every ``stability/grad_norm_log10/<group>`` (see
      `log10_norms`): the depth picture on the default linear axis;
    - ``gradient norm per layer``: every ``stability/grad_norm/<group>`` (not the total);
    - ``gradient norm (total) and clip threshold``: ``stability/grad_norm``, ``stability/clip_val``;
    - ``loss``; ``loss scale``; ``clipped and skipped steps, so far`` (`StepCounts`: the counts
      ``so_far/clipped``, ``so_far/skipped``);
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
        _chart(LOG10_CHART, _tag(GRAD_NORM_LOG10_PREFIX) + group + "$"),
        _chart("gradient norm per layer", _tag(GRAD_NORM_PREFIX) + group + "$"),
        _chart(
            "gradient norm (total) and clip threshold", _tag(GRAD_NORM) + "$", _tag(CLIP_VAL) + "$"
        ),
        _chart("loss", _tag(LOSS) + "$"),
        *([_chart("loss scale", _tag(LOSS_SCALE) + "$")] if has(LOSS_SCALE) else []),
        _chart(
            STEPS_CHART, _tag(SO_FAR_PREFIX + CLIPPED) + "$", _tag(SO_FAR_PREFIX + SKIPPED) + "$"
        ),
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


HEATMAP_DESCRIPTION = (
    "log10 gradient norm per depth group (rows, input side at the top) over the steps (columns; "
    "the live monitor's image covers its most recent 500 steps; where steps outnumber the "
    "columns, neighbours share one showing their maximum); red: NaN, white: Inf, a zero norm: "
    "the bottom colour"
)


def heatmap_summary(matrix: np.ndarray) -> Summary:
    """The per-layer gradient-norm heatmap of ``matrix`` (groups x steps) as `HEATMAP_TAG`."""
    return image_summary(HEATMAP_TAG, heatmap_png(matrix), description=HEATMAP_DESCRIPTION)
