"""Log readers: the replay feed. Any supported log in, `StepRecord`s out, for the same `Engine`.

    from stabilizer.replay.readers import Restart, read_log

    stream = read_log("runs/gpt/version_3")
    for item in stream:
        if isinstance(item, Restart):  # the run restarted here: a new segment
            print(f"restart at step {item.step}: {item.why}")
        else:
            print(item.step, item.values)
    print(stream.format, stream.notes)

`read_log` takes a file, a ``.gz`` file (recognised by its magic bytes), ``-`` for stdin, or a
run directory, in which it looks (up to four levels down) for ``stability.jsonl``, then TensorBoard
event files (all files of the newest run directory, merged by step), then ``metrics.csv``, then
``trainer_state.json``. The format is detected from the first lines (`detect_format`) unless
given; a text log that no dedicated reader recognises is read as ``generic``. Records stream:
memory stays bounded whatever the size of the log.

`read_log` returns a `LogStream`: iterate it for its items, `StepRecord`s and `Restart`s (and,
first in the monitor's ``stability.jsonl``, its `RunHeader`: the run's precision, devices,
policy, ...); it
also tells the format it read, the bytes read so far, the monitor's own findings
(``stability.jsonl``) and the notes.

What the user should know comes back as `Note`s (in ``notes``, and logged at INFO): format quirks
(Megatron losses are interval averages; the HF Trainer hides NaN losses), skipped and truncated
input. Damage part-way through is read up to the damage. A log that cannot
be read at all raises `LogReadError` (a `ValueError`) with a one-line message; for a log in which
no step is found, `unreadable_message` builds it (what was looked for, the first line that looked
like a record, ``--format``).

Registered formats (`READERS`), one reader module each:

- ``generic`` (`UniversalReader`, ``universal.py``): any console log of steps and metrics, read
  the way a person reads it (nanoGPT, modded-nanogpt, llm.c, litgpt, Keras, tqdm bars, OpenNMT,
  mmengine, Detectron2, ESPnet, ...), with one alias table (``aliases.py``); the fallback.
- Formats whose meaning differs from their text, or that are no text: ``jsonl`` (the monitor's
  own), ``lightning_csv``, ``csv`` (any CSV of a step or epoch column and losses),
  ``tensorboard``, ``megatron`` (interval averages, skipped
  iterations), ``deepspeed`` (overflow lines), ``fairseq`` (``clip`` percent, ``loss_scale``),
  ``hf_trainer`` (hidden NaN losses), ``hf_trainer_state``.

The old names ``nanogpt`` and ``modded_nanogpt`` (`FORMAT_ALIASES`) read as ``generic``.

Conventions shared by every reader:

- Records come in log order with the steps as logged. A restart (the step goes back, or a resume
  banner) starts a new *segment*: a `Restart` item comes just before the segment's first record.
  Steps are not renumbered, so the engine sees the replayed steps again, as the run did.
- Duplicate steps: where a format writes one step in several rows or events (Lightning CSV rows,
  TensorBoard events, ``log_history`` entries) those next to each other merge into one record,
  the later value winning per key; console lines each stay a record of their own (an eval line
  at the step of a train line adds ``val_loss``, never a second ``loss``).
- Names map to signal keys through shared aliases (`_keys` for structured formats, `aliases` for
  console logs); other numeric names pass through unchanged (detectors ignore them).
- Lines are read with bounded memory; one over `MAX_LINE` characters is skipped with a note.
- Notes are bounded too: `MAX_NOTES` of a kind, then one note that counts the rest.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path

from ._document import document_kind
from ._lines import MAX_LINE, text_lines
from ._rundir import find_runs
from ._source import REPLAY_SUFFIX, Source, find_logs, is_binary, open_source
from ._stream import LogStream
from .base import (
    MAX_NOTES,
    NOTE_KINDS,
    BaseReader,
    Item,
    LogReadError,
    Note,
    Reader,
    Restart,
    add_note,
)
from .csv_table import CsvTableReader
from .deepspeed import DeepSpeedReader
from .fairseq import FairseqReader
from .hf_trainer import HfTrainerReader
from .hf_trainer_state import HfTrainerStateReader
from .jsonl import JsonlReader
from .lightning_csv import LightningCsvReader
from .megatron import MegatronReader
from .tensorboard import TensorBoardReader
from .universal import UniversalReader, unreadable_message

__all__ = [
    "FORMAT_ALIASES",
    "MAX_LINE",
    "MAX_NOTES",
    "NOTE_KINDS",
    "READERS",
    "REPLAY_SUFFIX",
    "BaseReader",
    "CsvTableReader",
    "DeepSpeedReader",
    "FairseqReader",
    "HfTrainerReader",
    "HfTrainerStateReader",
    "Item",
    "JsonlReader",
    "LightningCsvReader",
    "LogReadError",
    "LogStream",
    "MegatronReader",
    "Note",
    "Reader",
    "Restart",
    "TensorBoardReader",
    "UniversalReader",
    "detect_format",
    "document_kind",
    "find_runs",
    "read_log",
    "unreadable_message",
]

READERS: dict[str, type[BaseReader]] = {
    cls.format: cls
    for cls in (
        JsonlReader,
        LightningCsvReader,
        CsvTableReader,
        TensorBoardReader,
        MegatronReader,
        DeepSpeedReader,
        HfTrainerReader,
        HfTrainerStateReader,
        FairseqReader,
        UniversalReader,
    )
}
"""Every reader class by format name; on equal confidence, detection prefers the earlier."""

FORMAT_ALIASES = {"nanogpt": "generic", "modded_nanogpt": "generic"}
"""Format names that are read by another reader now: the console logs of nanoGPT and
modded-nanogpt, once read by readers of their own, are read right by the generic one."""

SNIFF_LINES = 50  # meaningful lines detection looks at first
SNIFF_WIDTH = 2000  # characters of each line it looks at
_THRESHOLD = 0.1  # below this confidence a format is not detected


def detect_format(source: str | Path | Iterable[str]) -> str:
    """The format of a log file or run directory (``str`` or `Path`), or of a log's first lines.

    A text log that no dedicated reader recognises is ``generic``, read by `UniversalReader`.

    Raises:
        LogReadError: The path cannot be read, or holds binary data that is no event file.
    """
    if isinstance(source, (str, Path)):
        if Path(source).is_dir():
            return find_logs(Path(source), "auto", [])[0]
        opened = open_source(source)
        try:
            return _detect(opened)
        finally:
            _close([opened])
    lines = [line[:SNIFF_WIDTH] for line in source]
    return _by_lines(lines[:SNIFF_LINES], lines)


def _detect(source: Source) -> str:
    if TensorBoardReader.sniff_bytes(source.head, source.name) > 0.5:
        return TensorBoardReader.format
    if is_binary(source.head):
        raise LogReadError(f"{source.name}: binary data, neither a text log nor an event file")
    lines = text_lines(io.BytesIO(source.head), [])
    meaningful = [line[:SNIFF_WIDTH] for line in lines if _meaningful(line)]
    return _by_lines(meaningful[:SNIFF_LINES], meaningful)


def _by_lines(head: list[str], more: list[str]) -> str:
    """The format that fits the first lines best, else the first 64 KiB; else ``generic``,
    which reads any console log (one it cannot read fails with `unreadable_message`)."""
    for lines in (head, more):
        scores = [(cls.sniff(lines), -rank, fmt) for rank, (fmt, cls) in enumerate(READERS.items())]
        best, _, fmt = max(scores)
        if best >= _THRESHOLD:
            return fmt
    return UniversalReader.format


def _meaningful(line: str) -> bool:
    """Not empty, not a progress-bar redraw."""
    text = line.strip()
    return bool(text) and not ("%|" in text and ("it/s]" in text or "s/it]" in text))


def read_log(
    path: str | Path, format: str = "auto", *, notes: list[Note] | None = None
) -> LogStream:
    """The items of a log, streamed (see the module docstring), as a `LogStream`.

    Opening and detection happen at once (errors raise here); reading happens as the items are
    consumed, and the files are closed when the stream is exhausted, closed or discarded. The
    stream tells the format read (``.format``), the bytes read so far (``.bytes_read`` of
    ``.total_bytes``), the monitor's findings in a ``stability.jsonl`` (``.findings``) and the
    notes (``.notes``).

    Args:
        path: A log file, a ``.gz`` file, ``-`` for stdin, or a run directory.
        format: A name of `READERS`, or ``"auto"`` to detect it.
        notes: A list that collects the `Note`s of the reading (quirks, damage).

    Raises:
        LogReadError: The path is missing or unreadable, empty, binary garbage, of an unknown
            format, or a directory with nothing readable.
    """
    format = FORMAT_ALIASES.get(format, format)
    if format != "auto" and format not in READERS:
        raise LogReadError(f"`format` must be auto or one of {', '.join(READERS)}, got {format!r}")
    notes = [] if notes is None else notes
    files: list[str | Path] = [path]
    if str(path) != "-" and Path(path).is_dir():
        format, found = find_logs(Path(path), format, notes)
        files = list(found)
    sources = _open_all(files, notes)
    try:
        if format == "auto":
            format = _detect(sources[0])
        elif format != TensorBoardReader.format and is_binary(sources[0].head):
            raise LogReadError(f"{sources[0].name}: binary data, not a {format} log")
    except LogReadError:
        _close(sources)
        raise
    return LogStream(path, format, sources, READERS[format], notes)


def _open_all(files: list[str | Path], notes: list[Note]) -> list[Source]:
    """Open every file; of several (event files of a run), empty ones are skipped."""
    sources: list[Source] = []
    try:
        for file in files:
            if len(files) > 1 and Path(file).stat().st_size == 0:
                add_note(notes, Note("source", f"{file}: empty event file skipped"))
                continue
            sources.append(open_source(file, notes))
    except LogReadError:
        _close(sources)
        raise
    except OSError as exc:
        _close(sources)
        raise LogReadError(f"{exc.filename}: cannot read ({exc.strerror})") from None
    if not sources:
        raise LogReadError(f"{files[0]}: empty file")
    return sources


def _close(sources: list[Source]) -> None:
    for source in sources:
        source.close()
