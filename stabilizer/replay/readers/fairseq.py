"""`FairseqReader`: fairseq's ``train_inner`` progress lines and its fp16 scaler messages.

Lines read (``--log-format simple`` and ``json``, with or without the hydra-era prefix)::

    2024-01-01 12:00:00 | INFO | train_inner | epoch 001:    100 / 1000 loss=9.123, nll_loss=9.0,
        ppl=512, wps=..., num_updates=100, lr=0.0005, gnorm=1.234, clip=0, loss_scale=128, ...
    2024-01-01 12:00:00 | INFO | train_inner | {"epoch": 1, "loss": "9.123", "num_updates": "100"}
    2024-01-01 12:00:00 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 8.5 | ...
    2024-01-01 12:00:00 | INFO | fairseq.trainer | NOTE: gradient overflow detected, ignoring
        gradient, setting loss scale to: 32.0
    FloatingPointError: Minimum loss scale reached (0.0001). Your loss is probably exploding. ...

The step is ``num_updates``. The loss is in base 2 (bits; fairseq's convention), noted and kept.
Fields are interval averages (``--log-interval``, default 100 updates). ``gnorm`` is the grad norm;
``clip``, the percentage of clipped updates in the interval, becomes ``clipped`` in 0..1.
An overflow skips an update without counting it: a record at the next update with ``skipped`` 1
and ``loss_scale`` the scale in force, twice the one announced (fairseq halves its scale). The
minimum-scale error is a skipped step at that scale, with a note: the run stopped there.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from typing import IO, ClassVar

from stabilizer.core.records import StepRecord
from stabilizer.core.signals import CLIPPED, GRAD_NORM, LOSS, LOSS_SCALE, LR, SKIPPED

from ._fields import Floats, Rows, Scan, column, line_pattern, stretches
from ._lines import labels, pick, resume_banner
from .base import BaseReader, record

__all__ = ["FairseqReader"]

_NUMBER = r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))"
_INNER = re.compile(r"\|\s*(?:train_inner\s*\|\s*|epoch \d+:\s*\d+\s*/\s*\d+\s)")
_VALID = re.compile(r"\|\s*valid\s*\|")
_FIELDS = labels(
    {
        " loss=": LOSS,
        " nll_loss=": "nll_loss",
        " num_updates=": "num_updates",
        " lr=": LR,
        " gnorm=": GRAD_NORM,
        " clip=": CLIPPED,
        " loss_scale=": LOSS_SCALE,
    }
)
_VALID_PAIR = re.compile(r"\|\s*(\w+) ([^|\s]+)")
_OVERFLOW = re.compile(r"overflow detected.{0,80}?loss scale to:? ?" + _NUMBER)
_MINIMUM = re.compile(r"Minimum loss scale reached \(" + _NUMBER)
_STRONG = re.compile(r"\|\s*train_inner\s*\||\|\s*epoch \d+:\s*\d+\s*/\s*\d+\s+loss=")
_WEAK = re.compile(r"fairseq|\| INFO \| (?:train|valid) \|")
_JSON = {label.strip(" ="): key for label, key, _ in _FIELDS}
# The usual train_inner line, matched from its start: no "|" before "| INFO | train_inner |"
# (where `_INNER` matches first), then the fields. With no "=" inside a value (checked by
# counting them: sre scans ``[^,]`` far faster than ``[^,=]``), each label's first occurrence is
# its field, and each value is the text up to the next comma: what `pick` finds.
_USUAL = re.compile(
    r"[^|=]*\| INFO \| train_inner \| epoch [^=]* loss=([^,]*), nll_loss=([^,]*), ppl=[^,]*, "
    r"wps=[^,]*, ups=[^,]*, wpb=[^,]*, bsz=[^,]*, num_updates=([^,]*), lr=([^,]*), "
    r"gnorm=([^,]*), clip=([^,]*), loss_scale=([^,]*)"
)
_USUAL_EQUALS = 12
Parsed = tuple[int | None, dict[str, float]]  # (num_updates or None, values)
# `_USUAL` for `Scan`: a whole plain line as bytes (tab and printable ASCII, "\r" before its end),
# with the "=" count checked by the classes: no "=" but the labels' up to the loss scale's value,
# which runs to a comma or the line's end (as `[^,]*` takes it).
_PLAIN_NOT = {  # plain bytes but these, as a class
    b"|=": rb"[\t -<>-{}~]",
    b"=": rb"[\t -<>-~]",
    b",=": rb"[\t -+\--<>-~]",
}
_V = _PLAIN_NOT[b",="] + b"*"  # a value
_USUAL_BYTES = line_pattern(
    _PLAIN_NOT[b"|="]
    + rb"*\| INFO \| train_inner \| epoch "
    + _PLAIN_NOT[b"="]
    + b"*"
    rb" loss=(V), nll_loss=(V), ppl=V, wps=V, ups=V, wpb=V, bsz=V, num_updates=(V), lr=(V), "
    rb"gnorm=(V), clip=(V), loss_scale=(V)(?:,[\t -~]*)?\r?\n".replace(b"V", _V)
)


class FairseqReader(BaseReader):
    """Reads fairseq training logs (see the module docstring)."""

    format: ClassVar[str] = "fairseq"

    @classmethod
    def sniff(cls, head: list[str]) -> float:
        if any(_STRONG.search(line) for line in head):
            return 0.95
        return 0.6 if any(_WEAK.search(line) for line in head) else 0.0

    def _records(self, stream: IO[bytes]) -> Iterator[StepRecord]:
        last, banner, noted, lineno = -1, "", False, 0
        floats = Floats().__getitem__
        for item in Scan(stream, self.notes, _USUAL_BYTES):
            batch = _batch(item.rows, floats) if isinstance(item, Rows) else None
            if batch is not None:  # (what the loop below would give, stretches at once)
                state = yield from self._batch(*batch, (last, banner, noted, lineno))
                last, banner, noted, lineno = state
                continue
            for line, (step, values) in _read(item):
                lineno += 1
                if step is None:
                    if values:  # an overflow: the update that was tried is the next one
                        yield self._overflow(max(last, 0) + 1, values, lineno)
                    elif last >= 0 and not banner:
                        banner = resume_banner(line)
                    continue
                if step < last or banner:
                    self.segment(step, last, banner, lineno)
                    banner = ""
                if not noted and LOSS in values:
                    noted = self._note_bits(lineno)
                last = step
                yield record(step, values)

    def _batch(
        self, steps: list[int], values: list[dict[str, float]], state: tuple[int, str, bool, int]
    ) -> Generator[StepRecord, None, tuple[int, str, bool, int]]:
        """`_records` of a run's steps and values (`_batch`): records one by one while there is
        something to note (a restart, the bits: each note just before its record, as the report
        expects), then the rest of a stretch at once. Returns the state."""
        last, banner, noted, lineno = state
        for start, end in stretches(steps):
            at = start
            while at < end and (steps[at] < last or banner or not noted):
                step, lineno = steps[at], lineno + 1
                if step < last or banner:
                    self.segment(step, last, banner, lineno)
                    banner = ""
                if not noted:  # (the usual line has a loss)
                    noted = self._note_bits(lineno)
                last = step
                yield record(step, values[at])
                at += 1
            if at < end:
                lineno, last = lineno + end - at, steps[end - 1]
                yield from list(map(record, steps[at:end], values[at:end]))
        return last, banner, noted, lineno

    def _note_bits(self, lineno: int) -> bool:
        self.note("format", "fairseq losses are in base 2 (bits), interval means", lineno)
        return True

    def _overflow(self, step: int, values: dict[str, float], lineno: int) -> StepRecord:
        if values.pop("minimum", 0.0):
            self.note("format", "fairseq stopped: minimum loss scale reached", lineno)
        return record(step, values)


def _read(item: list[str] | Rows) -> Iterable[tuple[str, Parsed]]:
    """Each line of a `Scan` item with what `_usual` or `_parsed` reads in it."""
    if isinstance(item, list):
        return [(line, _usual(line) or _parsed(line)) for line in item]
    out: list[tuple[str, Parsed]] = []
    for index, texts in enumerate(item.rows):  # plain usual lines, matched as bytes
        found = _usual_values(texts[:-1])
        if found is None or found[0] is None:  # a value is no number, or no record: as any line
            line = item.line(index)
            out.append((line, _usual(line) or _parsed(line)))
        else:
            out.append(("", found))
    return out


def _batch(
    rows: list[tuple[bytes, ...]], floats: Callable[[bytes], float]
) -> tuple[list[int], list[dict[str, float]]] | None:
    """The steps and values of usual lines' groups (``rows``), as `_usual_values` reads each,
    converted column by column: C loops, no call per line. None where a line must be read on its
    own (a value no number, no record). The clip and loss scale repeat (see `column`)."""
    loss, nll, count, lr, norm, clip, scale, _ = zip(*rows, strict=True)
    try:
        losses, nlls, counts, lrs, norms = (
            list(map(float, texts)) for texts in (loss, nll, count, lr, norm)
        )
        clips, scales = column(clip, floats), column(scale, floats)
    except ValueError:
        return None
    if not all(map(math.isfinite, counts)):
        return None
    values = [
        {LOSS: a, "nll_loss": b, LR: c, GRAD_NORM: d, CLIPPED: e / 100.0, LOSS_SCALE: f}
        for a, b, c, d, e, f in zip(losses, nlls, lrs, norms, clips, scales, strict=True)
    ]
    return list(map(int, counts)), values


def _usual(line: str) -> tuple[int | None, dict[str, float]] | None:
    """`_parsed` of the usual train_inner line, the fast way; None for any other line."""
    usual = _USUAL.match(line)
    if usual is None or line.count("=", 0, usual.end()) != _USUAL_EQUALS:
        return None
    return _usual_values(usual.groups())


def _usual_values(texts: Sequence[str | bytes]) -> tuple[int | None, dict[str, float]] | None:
    """`_usual` of the texts of the fields of the usual line; None if one is no number."""
    try:
        loss, nll, count, lr, norm, clip, scale = map(float, texts)
    except ValueError:  # some value is no number: the general way skips just that one
        return None
    values = {
        LOSS: loss,
        "nll_loss": nll,
        LR: lr,
        GRAD_NORM: norm,
        CLIPPED: clip / 100.0,
        LOSS_SCALE: scale,
    }
    return (int(count), values) if math.isfinite(count) else (None, {})


def _parsed(line: str) -> tuple[int | None, dict[str, float]]:
    """``(num_updates, signal values)`` of a train_inner or valid line; an overflow's fields."""
    found = _INNER.search(line)
    return _inner(line, found.end()) if found is not None else _other(line)


def _inner(line: str, start: int) -> tuple[int | None, dict[str, float]]:
    """``(num_updates, signal values)`` of a train_inner line."""
    if line.startswith("{", start):
        return _json(line[start:])
    return _counted(pick(line, start - 1, _FIELDS, ","))


def _json(text: str) -> tuple[int | None, dict[str, float]]:
    """`_inner` of a ``--log-format json`` line."""
    try:
        data = json.loads(text)
        pairs = {_JSON[k]: float(v) for k, v in data.items() if k in _JSON}
    except (ValueError, TypeError, AttributeError):
        return None, {}
    return _counted(pairs)


def _counted(pairs: dict[str, float]) -> tuple[int | None, dict[str, float]]:
    """``(num_updates, the other values)`` of the picked fields, clip as a fraction."""
    updates = pairs.pop("num_updates", None)
    if updates is None or not math.isfinite(updates):
        return None, {}
    if CLIPPED in pairs:
        pairs[CLIPPED] /= 100.0  # a percentage of the interval's updates
    return int(updates), pairs


def _other(line: str) -> tuple[int | None, dict[str, float]]:
    """A valid line ``(num_updates, {"val_loss": ...})``, or an overflow ``(None, fields)``."""
    if "verflow" in line and (match := _OVERFLOW.search(line)):
        return None, {SKIPPED: 1.0, LOSS_SCALE: 2 * float(match.group(1))}
    if "Minimum loss scale" in line and (match := _MINIMUM.search(line)):
        return None, {SKIPPED: 1.0, LOSS_SCALE: float(match.group(1)), "minimum": 1.0}
    if not _VALID.search(line):
        return None, {}
    pairs = dict(_VALID_PAIR.findall(line))
    try:
        return int(pairs["num_updates"]), {"val_loss": float(pairs["loss"])}
    except (KeyError, ValueError):  # not both, or not numbers
        return None, {}
