"""Scalars out of serialized TensorBoard ``Event`` protos, fast.

Walking protobuf objects costs microseconds per value. So an event is parsed by protobuf once per
*layout*: its bytes after the step, with the 4-byte floats of its ``simple_value`` fields cut out
(the tags and lengths). When protobuf confirms that the cut found exactly its values, the layout
is remembered, and later events of that layout are cut with one regex split and one
``struct.unpack``. An event of one scalar (Lightning logs one per event) is faster still: the
bytes between its step and its float name the tag, a dictionary lookup. Everything else — TF2
tensor scalars, metadata, images — takes the protobuf path; non-scalar values are skipped.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable

from google.protobuf.message import DecodeError
from tensorboard.compat.proto import event_pb2

__all__ = ["HEAD", "EventDecoder", "Pairs"]

HEAD = re.compile(rb"\x09[\s\S]{8}(?:\x10([\x80-\xff]{0,9}[\x00-\x7f]))?(?=\x2a)")
"""wall_time (field 1, fixed64), the step (field 2, varint; absent when 0), then the summary."""
_FLOAT = re.compile(rb"\x15([\s\S]{4})(?=\x0a|\Z)")  # simple_value: field 2, fixed32
_TENSOR = {1: ("float_val", "<f"), 2: ("double_val", "<d"), 19: ("half_val", "<e")}
_CACHE = 4096  # layouts remembered (a log of ever new layouts must not grow memory)
Pairs = Iterable[tuple[str, float]]
Layout = tuple[tuple[str, ...], struct.Struct]


class EventDecoder:
    """Decodes the scalars of events; its caches are the state of the fast path."""

    def __init__(self) -> None:
        self.singles: dict[bytes, str] = {}  # bytes after the step, less the float → the tag
        self.steps: dict[bytes | None, int] = {None: 0}  # step varint → step
        self.damaged = 0  # events that did not parse
        self._layouts: dict[bytes, Layout | None] = {}  # summary less its floats → layout
        self._scalar_tags: set[str] = set()  # tensor tags of the scalars plugin

    def step(self, varint: bytes | None) -> int:
        """The step of a `HEAD` match's varint (remembered)."""
        value = 0
        for shift, byte in enumerate(varint or b""):
            value |= (byte & 0x7F) << (7 * shift)
        if len(self.steps) > 65536:
            self.steps.clear()
            self.steps[None] = 0
        self.steps[varint] = value - (1 << 64) if value >= 1 << 63 else value
        return self.steps[varint]

    def decode(self, data: bytes, match: re.Match[bytes] | None) -> tuple[int, Pairs] | None:
        """``(step, (tag, value) pairs)`` of an event with scalars, else None."""
        if match is not None:
            parts = _FLOAT.split(data[match.end() :])
            key = b"".join(parts[::2])
            layout = self._layouts[key] if key in self._layouts else self._learn(data, parts, match)
            if layout is not None and len(parts) == 2 * len(layout[0]) + 1:
                tags, floats = layout
                values = floats.unpack(b"".join(parts[1::2]))
                return self.step(match.group(1)), zip(tags, values, strict=True)
        event = self._parse(data)
        if event is None or not event.HasField("summary"):
            return None
        scalars = self._scalars(event)  # text and images carry none: they open no step
        return (event.step, scalars) if scalars else None

    def _learn(self, data: bytes, parts: list[bytes], match: re.Match[bytes]) -> Layout | None:
        """The layout of an event of plain simple_values (fast path from now on), else None."""
        event, layout, count = self._parse(data), None, len(parts) // 2
        values = [] if event is None else list(event.summary.value)
        plain = all(v.WhichOneof("value") == "simple_value" for v in values)
        if plain and count == len(values) > 0 and not any(v.HasField("metadata") for v in values):
            floats = struct.Struct(f"<{count}f")
            logged = floats.unpack(floats.pack(*(v.simple_value for v in values)))
            if _same(floats.unpack(b"".join(parts[1::2])), logged):
                layout = (tuple(v.tag for v in values), floats)
                if count == 1 and len(self.singles) < _CACHE:
                    self.singles[data[match.end() : -4]] = values[0].tag
        if len(self._layouts) > _CACHE:
            self._layouts.clear()
        self._layouts[b"".join(parts[::2])] = layout
        return layout

    def _parse(self, data: bytes) -> event_pb2.Event | None:
        try:
            return event_pb2.Event.FromString(data)
        except DecodeError:
            self.damaged += 1
            return None

    def _scalars(self, event: event_pb2.Event) -> list[tuple[str, float]]:
        pairs = []
        for value in event.summary.value:
            kind = value.WhichOneof("value")
            if kind == "simple_value":
                pairs.append((value.tag, value.simple_value))
            elif kind == "tensor":
                # TF2 writers put the plugin name on a tag's first event only.
                if value.metadata.plugin_data.plugin_name == "scalars":
                    self._scalar_tags.add(value.tag)
                number = _tensor_scalar(value.tensor) if value.tag in self._scalar_tags else None
                if number is not None:
                    pairs.append((value.tag, number))
        return pairs


def _tensor_scalar(tensor: object) -> float | None:
    """The number in a one-element tensor proto of a float dtype, or None."""
    field, fmt = _TENSOR.get(getattr(tensor, "dtype", 0), ("", ""))
    if not field or any(d.size != 1 for d in tensor.tensor_shape.dim):  # type: ignore[attr-defined]
        return None
    content: bytes = tensor.tensor_content  # type: ignore[attr-defined]
    if content:
        enough = len(content) >= struct.calcsize(fmt)
        return float(struct.unpack_from(fmt, content)[0]) if enough else None
    numbers = getattr(tensor, field)
    if not numbers:
        return None
    if field == "half_val":  # float16 bits stored in an int32
        return float(struct.unpack("<e", struct.pack("<H", numbers[0] & 0xFFFF))[0])
    return float(numbers[0])


def _same(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """Equal, NaN equal to NaN."""
    return all(x == y or (x != x and y != y) for x, y in zip(a, b, strict=True))
