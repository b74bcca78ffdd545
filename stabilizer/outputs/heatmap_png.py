"""`heatmap_png`: a layers x steps matrix as a PNG image, with numpy and zlib alone.

The pixel image TensorBoard shows when matplotlib is missing (`stabilizer.outputs.heatmap` draws
the labelled one), and the image of `stabilizer.outputs.tensorboard.heatmap_summary`.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

__all__ = ["heatmap_png", "png_size"]

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
