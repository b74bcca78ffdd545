"""Runs of different depths in one logdir share the per-layer charts; no chart is left empty.

Two real Trainer runs (4 and 12 blocks) write their TensorBoard files through the monitor; a real
``tensorboard`` server reads the logdir, and its HTTP API must show every layer of both runs in
"gradient norm per layer" and in its log10 chart (the log10 of the very values logged), and no
chart for a signal neither run logs.
"""

from __future__ import annotations

import io
import math
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import PIL.Image
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from test_tensorboard import _get_json, _wait_for_tags, served
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from stabilizer.callbacks import StabilityMonitor
from stabilizer.core.records import StepRecord
from stabilizer.outputs import heatmap
from stabilizer.outputs.heatmap import draw_heatmap
from stabilizer.outputs.tensorboard import HEATMAP_TAG, LOG10_CHART
from stabilizer.replay.readers import read_log

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 16


class Stack(pl.LightningModule):
    """A user's small LM with ``depth`` residual blocks."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(depth))
        self.head = nn.Linear(8, VOCAB)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        (ids,) = batch
        x = self.emb(ids[:, :-1])
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        logits = self.head(x)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class StackWithPooler(Stack):
    """A `Stack` with a module its loss never uses (a BERT pooler under an MLM loss)."""

    def __init__(self, depth: int) -> None:
        super().__init__(depth)
        self.pooler = nn.Linear(8, 8)


def _run(logdir: Path, depth: int, model: type[Stack] = Stack) -> None:
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        logger=TensorBoardLogger(str(logdir), name=f"depth{depth}", version=0),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[StabilityMonitor(jsonl=False, preflight=False)],
    )
    data = TensorDataset(torch.randint(0, VOCAB, (12, 6)))
    trainer.fit(model(depth), DataLoader(data, batch_size=4))


def _groups(depth: int) -> list[str]:
    return ["embed", *(f"block_{i:02d}" for i in range(depth)), "head"]


@pytest.mark.slow
def test_runs_of_4_and_12_layers_share_the_per_layer_chart(tmp_path: Path) -> None:
    for depth in (4, 12):
        _run(tmp_path, depth)
    runs = {4: "depth4/version_0", 12: "depth12/version_0"}
    with served(tmp_path) as (opener, base, proc):
        tags = _wait_for_tags(opener, base, proc, runs=list(runs.values()))
        layout = _get_json(opener, base + "/data/plugin/custom_scalars/layout")
        (category,) = layout["category"]
        charts = {chart["title"]: chart for chart in category["chart"]}
        # fp32 runs without update ratios: no chart that would stay empty
        assert "loss scale" not in charts and "update ratio per layer" not in charts
        assert list(charts)[:2] == [LOG10_CHART, "gradient norm per layer"]  # log10 first
        for depth, run in runs.items():
            raw = _matched(opener, base, run, charts["gradient norm per layer"])
            expected = sorted(f"stability/grad_norm/{g}" for g in _groups(depth))
            assert sorted(raw) == expected  # every layer of each run
            assert set(expected) <= set(tags[run])
            log10 = _matched(opener, base, run, charts[LOG10_CHART])
            assert sorted(log10) == [t.replace("norm/", "norm_log10/") for t in expected]
            for tag, events in raw.items():
                logged = log10[tag.replace("norm/", "norm_log10/")]
                assert [e[1] for e in logged] == [e[1] for e in events]  # (wall time, step, value)
                want = [math.log10(e[2]) for e in events]
                assert [e[2] for e in logged] == pytest.approx(want, rel=1e-6, abs=1e-6)


def _matched(opener: Any, base: str, run: str, chart: dict[str, Any]) -> dict[str, Any]:
    """Tag -> [wall time, step, value] events of the chart's one regex, as the chart reads them."""
    (regex,) = chart["multiline"]["tag"]
    query = urllib.parse.urlencode({"run": run, "tag": regex})
    matched = _get_json(opener, f"{base}/data/plugin/custom_scalars/scalars?{query}")
    assert matched["regex_valid"]
    events: dict[str, Any] = matched["tag_to_events"]
    return events


def test_the_log10_norms_are_no_signal_of_a_replay(tmp_path: Path) -> None:
    # A view for TensorBoard's charts, not a measurement: `diagnose` of the run reads it not.
    _run(tmp_path, depth=4)
    items = read_log(tmp_path / "depth4" / "version_0", "tensorboard")
    keys = {key for item in items if isinstance(item, StepRecord) for key in item.values}
    assert {f"grad_norm/{g}" for g in _groups(4)} <= keys
    assert not [key for key in keys if "log10" in key]


def _heatmap_images(logdir: Path) -> list[Any]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"images": 0})
    acc.Reload()
    return list(acc.Images(HEATMAP_TAG))


def _height(rows: int) -> int:
    """The figure's pixel height for so many rows: 0.22 inch a row, never below the axis label."""
    return int(100 * max(heatmap._MIN_HEIGHT, 1.2 + 0.22 * rows))


def test_the_heatmap_image_has_layer_labels_a_step_axis_and_a_colour_bar(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    _run(tmp_path, depth=4)
    [image] = _heatmap_images(tmp_path / "depth4" / "version_0")
    picture = PIL.Image.open(io.BytesIO(image.encoded_image_string))
    assert picture.size == (900, _height(rows=6))  # the labelled figure
    figure = pytest.importorskip("matplotlib.figure")
    backend = pytest.importorskip("matplotlib.backends.backend_agg")
    fig = figure.Figure()
    backend.FigureCanvasAgg(fig)
    ax = fig.subplots()
    groups = [*_groups(4), "other"]
    draw_heatmap(fig, ax, [0, 1, 2], groups, np.ones((len(groups), 3)))
    assert [t.get_text() for t in ax.get_yticklabels()] == groups
    assert ax.get_xlabel() == "step" and len(fig.axes) == 2  # the colour bar's axis
    assert any(line.get_ydata()[0] == len(groups) - 1.5 for line in ax.get_lines())  # other


def test_a_module_the_loss_never_uses_is_no_row_and_no_scalar(tmp_path: Path) -> None:
    # No gradient at all is not a zero gradient: the pooler's group is left out of the records
    # (no scalar), and the heatmap has a row for each layer that had one.
    pytest.importorskip("matplotlib")
    _run(tmp_path, depth=8, model=StackWithPooler)  # tall enough that a row shows in the size
    [image] = _heatmap_images(tmp_path / "depth8" / "version_0")
    picture = PIL.Image.open(io.BytesIO(image.encoded_image_string))
    assert picture.size == (900, _height(rows=10)) != (900, _height(rows=11))  # embed, 8, head
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "depth8" / "version_0"))
    acc.Reload()
    norms = {t for t in acc.Tags()["scalars"] if t.startswith("stability/grad_norm/")}
    assert norms == {f"stability/grad_norm/{g}" for g in _groups(8)}


def test_the_heatmap_paints_zero_at_the_bottom_nan_red_and_inf_white() -> None:
    # A zero norm is the bottom of the scale, as in the pixel image, not the red of a NaN.
    figure = pytest.importorskip("matplotlib.figure")
    backend = pytest.importorskip("matplotlib.backends.backend_agg")
    fig = figure.Figure()
    backend.FigureCanvasAgg(fig)
    ax = fig.subplots()
    rows = np.array([[1e-12, 1e-8], [1e-3, np.nan], [1.0, np.inf], [0.0, 0.0]])
    draw_heatmap(fig, ax, [0, 1], ["embed", "block_00", "block_01", "head"], rows)
    [image] = ax.get_images()
    rgba = image.to_rgba(image.get_array())  # the colour of each cell
    bottom, top = image.cmap(0.0), image.cmap(1.0)
    assert tuple(rgba[0, 0]) == tuple(rgba[3, 0]) == tuple(rgba[3, 1]) == bottom
    assert tuple(rgba[2, 0]) == top
    assert tuple(rgba[1, 1]) == (1.0, 0.0, 0.0, 1.0)  # NaN: red
    assert tuple(rgba[2, 1]) == (1.0, 1.0, 1.0, 1.0)  # Inf: white


def test_without_matplotlib_the_heatmap_says_its_labels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(heatmap, "matplotlib_available", lambda: False)
    _run(tmp_path, depth=4)
    [image] = _heatmap_images(tmp_path / "depth4" / "version_0")
    picture = PIL.Image.open(io.BytesIO(image.encoded_image_string))
    assert picture.size[0] != 900  # not the matplotlib figure: the pixel image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "depth4" / "version_0"))
    acc.Reload()
    description = acc.summary_metadata[HEATMAP_TAG].summary_description
    assert description.startswith("rows top to bottom: embed, block_00, block_01, block_02")
    assert "steps 0–2 left to right" in description and "colour: log10 grad norm" in description
