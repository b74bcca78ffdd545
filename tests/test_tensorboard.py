"""TensorBoard output: written to a real event file, read back by TensorBoard itself."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar.metadata import CONFIG_SUMMARY_TAG

from stabilizer.core.records import Finding, Severity
from stabilizer.outputs.tensorboard import (
    FINDINGS_STEP,
    FINDINGS_TAG,
    HEATMAP_TAG,
    LOG10_CHART,
    STEPS_CHART,
    EventWriter,
    SummaryWriter,
    custom_scalars_layout,
    depth_order,
    findings_text,
    heatmap_png,
    image_summary,
    png_size,
    scalar_summary,
)

GROUPS = ["block_00", "block_01", "block_02", "block_03"]
LAYER_TAGS = [f"stability/grad_norm/{group}" for group in GROUPS]
STEPS = range(0, 50, 5)
VIRIDIS_LOW, VIRIDIS_HIGH = (68, 1, 84), (253, 231, 37)
RED, WHITE = (228, 26, 28), (255, 255, 255)


def _values(step: int) -> dict[str, float]:
    """Per-layer norms decaying towards the input side, values float32 cannot hold exactly."""
    layers = {f"grad_norm/{g}": 0.1 ** (4 - i) * (1 + step / 7) for i, g in enumerate(GROUPS)}
    return {
        **layers,
        "grad_norm": sum(v * v for v in layers.values()) ** 0.5,
        "loss": 3 / (1 + step),
    }


def _findings() -> list[Finding]:
    return [
        Finding(
            "loss_spike",
            10,
            20,
            Severity.WARNING,
            "loss rose 3.0x | *back* in 10 steps",
            location=("block_03",),
            remedies=("clip_gradients", "rollback"),
        ),
        Finding("nonfinite_grad", 30, None, Severity.ERROR, "NaN gradient", location=("blocks.2",)),
    ]


def _decode_png(png: bytes) -> np.ndarray:
    """RGB pixels of our PNG (8-bit RGB, filter 0), checking signature, chunk CRCs and sizes."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    chunks: dict[bytes, bytes] = {}
    pos = 8
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos : pos + 4])
        kind, data = png[pos + 4 : pos + 8], png[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", png[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + data), kind
        chunks[kind] = chunks.get(kind, b"") + data
        pos += 12 + length
    assert list(chunks) == [b"IHDR", b"IDAT", b"IEND"]
    width, height, depth, colour, *_ = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, colour) == (8, 2)
    raw = zlib.decompress(chunks[b"IDAT"])
    assert len(raw) == height * (1 + width * 3)
    rows = np.frombuffer(raw, np.uint8).reshape(height, 1 + width * 3)
    assert not rows[:, 0].any()  # filter type 0 on every scanline
    return rows[:, 1:].reshape(height, width, 3)


def _torch_writer(logdir: Path) -> Any:
    from torch.utils.tensorboard import SummaryWriter as TorchWriter

    writer: Any = TorchWriter(str(logdir))
    return writer._get_file_writer()


def _write_run(writer: SummaryWriter, heatmap: bytes) -> None:
    writer.add_summary(custom_scalars_layout(), 0)
    for step in STEPS:
        writer.add_summary(scalar_summary(_values(step)), step)
    writer.add_summary(
        image_summary(HEATMAP_TAG, heatmap, description="rows: input side first"), 45
    )
    # As the live monitor writes it: the whole table again whenever it changes, at one step.
    writer.add_summary(findings_text(_findings()[:1], as_of=20), FINDINGS_STEP)
    writer.add_summary(findings_text(_findings(), as_of=45), FINDINGS_STEP)


def _tb_writer(logdir: Path) -> EventWriter:
    return EventWriter(str(logdir))


@pytest.mark.parametrize("make_writer", [_tb_writer, _torch_writer], ids=["tensorboard", "torch"])
def test_event_file_round_trip(tmp_path: Path, make_writer: Callable[[Path], Any]) -> None:
    matrix = np.array([[_values(s)[f"grad_norm/{g}"] for s in STEPS] for g in GROUPS])
    heatmap = heatmap_png(matrix)
    writer = make_writer(tmp_path)
    _write_run(writer, heatmap)
    writer.close()

    guidance = {"scalars": 0, "images": 0, "tensors": 0}
    acc = EventAccumulator(str(tmp_path), size_guidance=guidance).Reload()
    expected_tags = {*LAYER_TAGS, "stability/grad_norm", "stability/loss"}
    assert set(acc.Tags()["scalars"]) == expected_tags
    for tag in expected_tags:
        events = acc.Scalars(tag)
        assert [e.step for e in events] == list(STEPS)
        want = [float(np.float32(_values(s)[tag.removeprefix("stability/")])) for s in STEPS]
        assert [e.value for e in events] == want, tag

    (image,) = acc.Images(HEATMAP_TAG)
    assert (image.height, image.width) == png_size(heatmap) == (4 * 12, len(STEPS) * 32)
    assert image.encoded_image_string == heatmap
    assert _decode_png(image.encoded_image_string).shape == (image.height, image.width, 3)

    # The Python loader keeps every version of the table; the newest comes last.
    first, text = acc.Tensors(FINDINGS_TAG)
    assert first.step == text.step == FINDINGS_STEP
    markdown = text.tensor_proto.string_val[0].decode()
    assert markdown.startswith("**2 episodes as of step 45**: 1 error, 1 warning (")
    assert markdown.splitlines()[2:] == [  # one line each, the message's stars no emphasis
        "- **steps 10–20 warning loss_spike** [`block_03`]: loss rose 3.0x | \\*back\\* in 10 "
        "steps → try: `clip_gradients`, `rollback`",
        "- **step 30 error nonfinite_grad** [`blocks.2`]: NaN gradient",
    ]

    (config,) = acc.Tensors(CONFIG_SUMMARY_TAG)
    assert config.step == 0
    layout = layout_pb2.Layout.FromString(config.tensor_proto.string_val[0])
    assert [c.title for c in layout.category] == ["stability"]
    (per_layer,) = [c for c in layout.category[0].chart if c.title == "gradient norm per layer"]
    (regex,) = per_layer.multiline.tag
    # TensorBoard selects a chart's tags with re.match, as here.
    assert [t for t in sorted(acc.Tags()["scalars"]) if re.match(regex, t)] == LAYER_TAGS


@pytest.mark.parametrize(
    ("groups", "tag", "matches"),
    [
        (None, "stability/grad_norm/block_00", True),
        (None, "stability/grad_norm/embed", True),
        (None, "stability/grad_norm/block_117", True),
        (None, "stability/grad_norm", False),
        (None, "stability/grad_norm_heatmap", False),
        (None, "stability/update_ratio/block_00", False),
        (None, "stability/grad_norm/block_00/extra", False),
        (["embed", "block_00"], "stability/grad_norm/block_00", True),
        (["embed", "block_00"], "stability/grad_norm/block_11", True),  # any depth
        (["embed", "dec"], "stability/grad_norm/dec", True),  # a grouping= name
        (["embed", "block_00"], "stability/grad_norm/dec", False),
    ],
    ids=[
        "block",
        "embed",
        "3-digit",
        "total",
        "heatmap",
        "update",
        "deeper",
        "listed",
        "any-depth",
        "custom",
        "other-custom",
    ],
)
def test_per_layer_regex(groups: list[str] | None, tag: str, matches: bool) -> None:
    value = custom_scalars_layout(groups).value[0]
    layout = layout_pb2.Layout.FromString(value.tensor.string_val[0])
    charts = {chart.title: list(chart.multiline.tag) for chart in layout.category[0].chart}
    (regex,) = charts["gradient norm per layer"]
    assert bool(re.match(regex, tag)) is matches
    (log10,) = charts[LOG10_CHART]  # the same layers, their log10
    assert bool(re.match(log10, tag.replace("/grad_norm/", "/grad_norm_log10/"))) is matches
    assert not re.match(log10, tag)
    assert value.tag == CONFIG_SUMMARY_TAG
    assert value.metadata.plugin_data.plugin_name == "custom_scalars"
    assert set(charts) == {
        LOG10_CHART,
        "gradient norm per layer",
        "gradient norm (total) and clip threshold",
        "loss",
        "loss scale",
        STEPS_CHART,
        "update ratio per layer",
        "activation max |x|",
    }
    assert re.match(charts["activation max |x|"][0], "stability/act_absmax/blocks.3.mlp")


def test_heatmap_png_with_nan_inf_and_zero() -> None:
    matrix = np.array(
        [
            [1e-8, 1e-8, 0.0],  # input side: row 0, at the top
            [1e-4, np.nan, 1e-4],
            [1e-1, np.inf, 1e-1],
        ]
    )
    pixels = _decode_png(heatmap_png(matrix))
    assert pixels.shape == (3 * 12, 3 * 32, 3)  # short runs get 32 px columns, rows 12 px
    cell = pixels[6::12, 16::32]  # the centre pixel of every cell
    assert cell.shape == (3, 3, 3)
    assert tuple(cell[0, 0]) == VIRIDIS_LOW
    assert tuple(cell[0, 2]) == VIRIDIS_LOW  # a zero norm is the bottom of the scale, not a fault
    assert tuple(cell[2, 0]) == VIRIDIS_HIGH
    assert tuple(cell[1, 1]) == RED
    assert tuple(cell[2, 1]) == WHITE
    assert RED not in {tuple(p) for p in cell[[0, 2]][:, [0, 2]].reshape(-1, 3)}
    # Every pixel of a cell has the cell's colour.
    assert (pixels == np.repeat(np.repeat(cell, 12, axis=0), 32, axis=1)).all()


def test_heatmap_png_long_runs_are_capped_and_keep_nan() -> None:
    matrix = np.full((2, 10_000), 1e-3)
    matrix[1, 7_777] = np.nan
    pixels = _decode_png(heatmap_png(matrix, max_size=(1024, 600)))
    assert pixels.shape == (2 * 12, 1024, 3)
    assert (pixels[12:] == RED).all(axis=2).any()
    assert not (pixels[:12] == RED).all(axis=2).any()


def test_heatmap_png_fixed_scale() -> None:
    pixels = _decode_png(heatmap_png(np.array([[1e-9, 1.0]]), vmin=-8.0, vmax=-1.0, cell=(4, 1)))
    assert pixels.shape == (1, 2 * 32, 3)
    assert tuple(pixels[0, 0]) == VIRIDIS_LOW and tuple(pixels[0, -1]) == VIRIDIS_HIGH


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"matrix": np.zeros(3)}, r"`matrix` must be 2-D and non-empty, got shape \(3,\)"),
        ({"matrix": np.zeros((2, 0))}, r"`matrix` must be 2-D and non-empty, got shape \(2, 0\)"),
        ({"matrix": np.zeros((2, 2)), "cell": (0, 12)}, r"`cell` and `max_size` must be >= 1"),
    ],
    ids=["1-d", "empty", "cell"],
)
def test_heatmap_png_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        heatmap_png(**kwargs)


def test_png_size_rejects_other_bytes() -> None:
    with pytest.raises(ValueError, match="`png` must be a PNG image, got bytes starting b'GIF89a"):
        png_size(b"GIF89a...")


def test_depth_order() -> None:
    groups = ["head", "block_10", "other", "embed", "block_02", "zz", "block_100"]
    assert depth_order(groups) == [
        "embed",
        "block_02",
        "block_10",
        "block_100",
        "head",
        "other",
        "zz",
    ]


def test_findings_text_without_findings() -> None:
    value = findings_text([]).value[0]
    assert value.tag == FINDINGS_TAG
    assert value.metadata.plugin_data.plugin_name == "text"
    assert value.tensor.string_val == [b"No findings."]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _get_json(opener: urllib.request.OpenerDirector, url: str) -> Any:
    with opener.open(url, timeout=10) as response:
        return json.loads(response.read())


def _poll(
    opener: urllib.request.OpenerDirector,
    url: str,
    proc: Any,
    ready: Callable[[Any], bool],
    what: str,
) -> Any:
    """The JSON at ``url`` once ``ready`` holds for it; fails if the server exits, or hangs (a
    bound on a hang, not on speed: a loaded CPU can take a minute to start the server, and the
    default loader commits what it has read as it goes, so a run shows up before its end)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert proc.poll() is None, "tensorboard exited early"
        try:
            data = _get_json(opener, url)
            if ready(data):
                return data
        except (urllib.error.URLError, ConnectionError, ValueError):
            pass  # not up yet, or a run not loaded yet (400)
        time.sleep(0.5)
    raise AssertionError(f"tensorboard did not serve {what} within 600 s")


def _wait_for_tags(
    opener: urllib.request.OpenerDirector, base: str, proc: Any, runs: Sequence[str] = ("run",)
) -> Any:
    """Scalar tags once the server has loaded the runs."""
    url = base + "/data/plugin/scalars/tags"
    return _poll(opener, url, proc, lambda tags: all(tags.get(run) for run in runs), "the tags")


@contextlib.contextmanager
def served(
    logdir: Path, *flags: str
) -> Iterator[tuple[urllib.request.OpenerDirector, str, subprocess.Popen[bytes]]]:
    """A real ``tensorboard --logdir logdir`` as a user starts it (its default loader, the Rust
    data server where it is installed), on a free loopback port: (opener, base URL, process);
    ``flags`` are added (``"--load_fast", "false"``: the Python loader). Skips the test when no
    ``tensorboard`` executable sits beside this Python."""
    executable = Path(sys.executable).with_name("tensorboard")
    if not executable.exists():
        pytest.skip(f"no tensorboard executable beside {sys.executable}")
    port = _free_port()
    command = [str(executable), "--logdir", str(logdir), "--host", "127.0.0.1"]
    command += ["--port", str(port), *flags]
    with tempfile.TemporaryFile() as log:  # not in logdir: it may be a run other tests read
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        # Loopback only: bypass any proxy set in the environment.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            yield opener, f"http://127.0.0.1:{port}", proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _texts(opener: urllib.request.OpenerDirector, base: str, run: str) -> list[Any]:
    query = urllib.parse.urlencode({"run": run, "tag": FINDINGS_TAG})
    texts: list[Any] = _get_json(opener, f"{base}/data/plugin/text/text?{query}")
    return texts


@pytest.mark.slow
def test_real_tensorboard_server(tmp_path: Path) -> None:
    with EventWriter(str(tmp_path / "run")) as writer:
        _write_run(writer, heatmap_png(np.ones((4, len(STEPS)))))
    with served(tmp_path) as (opener, base, proc):
        tags = _wait_for_tags(opener, base, proc)
        query = urllib.parse.urlencode({"run": "run", "tag": FINDINGS_TAG})
        url = f"{base}/data/plugin/text/text?{query}"
        # The table is written last: once its newest version is served, the whole file is read.
        (text,) = _poll(opener, url, proc, lambda t: "as of step 45" in str(t), "the findings")
        assert text["step"] == FINDINGS_STEP
        assert "warning loss_spike</strong>" in text["text"]
        assert "error nonfinite_grad</strong>" in text["text"]
        tags = _get_json(opener, base + "/data/plugin/scalars/tags")
        assert set(LAYER_TAGS) | {"stability/grad_norm"} <= set(tags["run"])
        layout = _get_json(opener, base + "/data/plugin/custom_scalars/layout")
        (category,) = layout["category"]
        charts = {chart["title"]: chart for chart in category["chart"]}
        (regex,) = charts["gradient norm per layer"]["multiline"]["tag"]
        query = urllib.parse.urlencode({"run": "run", "tag": regex})
        matched = _get_json(opener, f"{base}/data/plugin/custom_scalars/scalars?{query}")
        assert matched["regex_valid"]
        assert sorted(matched["tag_to_events"]) == LAYER_TAGS
        assert len(matched["tag_to_events"]["stability/grad_norm/block_00"]) == len(STEPS)
        assert HEATMAP_TAG in _get_json(opener, base + "/data/plugin/images/tags")["run"]


@pytest.mark.parametrize("rows", [1, 2, 4, 30])
def test_the_heatmaps_axis_label_is_never_cut(rows: int) -> None:
    """#41: in a small stack the y axis label ("layer (input side at the top)") was taller
    than the figure, and cut at both ends."""
    pytest.importorskip("matplotlib")
    from stabilizer.outputs.heatmap import heatmap_figure

    groups = [f"block_{i:02d}" for i in range(rows)]
    fig = heatmap_figure(list(range(10)), groups, np.ones((rows, 10)))
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)  # (the constrained layout is done at drawing)
    label = fig.axes[0].yaxis.label.get_window_extent(renderer)
    box = fig.bbox
    assert box.y0 <= label.y0 and label.y1 <= box.y1 and box.x0 <= label.x0, (label, box)
