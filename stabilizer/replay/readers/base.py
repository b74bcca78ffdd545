"""The reader protocol, the items of a record stream, the notes readers leave, and the one error.

A reader turns one log format into a stream of items: a `StepRecord` per logged step, and a
`Restart` just before the first record of each new segment of a restarted run (the step went back,
or a resume banner such as ``Resuming from checkpoint`` came), as TensorBoard's own loader yields
a session start in its stream of events. Besides the items it leaves `Note`s: what the user should
know to read the findings right (Megatron losses are interval averages; the HF Trainer hides NaN
losses) and what could not be read (a truncated event file, an over-long line).
"""

from __future__ import annotations

import logging
import re
import zlib
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import IO, ClassVar, Protocol

from stabilizer.core.records import Finding, StepRecord
from stabilizer.core.run import RunHeader

__all__ = [
    "MAX_NOTES",
    "NOTE_KINDS",
    "BaseReader",
    "Item",
    "LogReadError",
    "Note",
    "Reader",
    "Restart",
    "add_note",
]

logger = logging.getLogger(__name__)

NOTE_KINDS = ("format", "skipped", "truncated", "hidden_nan", "source", "no_fp16_scaler")
"""`Note.kind` values: a quirk of the format, input skipped, input cut short, signs of hidden NaN
losses, which files were read, and a log that shows no fp16 loss scaler (bf16 or fp32: the
reports then advise no switch to bf16)."""


class LogReadError(ValueError):
    """A log cannot be read at all; the message is one line that names the path and the reason.

    Raised for a missing path, permission denied, an empty file, binary data that is not a log,
    an unknown format and a directory that holds nothing readable. Damage part-way through a log
    is not an error: what is readable is read, and a `Note` says where reading stopped.
    """


@dataclass(frozen=True)
class Note:
    """Something the user should know about a log, left by its reader.

    Args:
        kind: One of `NOTE_KINDS`.
        message: One line.
        line: The 1-based line number it refers to (text logs), when there is one.
        step: The step it refers to, when there is one.
    """

    kind: str
    message: str
    line: int | None = None
    step: int | None = None

    def __str__(self) -> str:
        return self.message if self.line is None else f"line {self.line}: {self.message}"


@dataclass(frozen=True)
class Restart:
    """A restart of the run, as an item of the record stream, just before its first record.

    The step went back (a run resumed from a checkpoint logs its steps again) or a resume banner
    (``Resuming from checkpoint ...``) came before the record; `diagnose` splits the run here and
    nowhere else. Steps are not renumbered: the records after it repeat the replayed steps.

    Args:
        step: The first step of the new segment.
        line: The 1-based log line that gave the restart away, when known.
        why: What gave it away, one line (``"step went back from 2070 to 2010"``).
    """

    step: int
    line: int | None
    why: str


Item = StepRecord | Restart | RunHeader | Finding
"""What a record stream holds: records, restarts, and where the log has them (the monitor's
``stability.jsonl``), the run's facts (a `RunHeader`, its first line) and the monitor's own
findings, each where the log holds it."""

MAX_NOTES = 20
"""Notes kept per kind in one list; later ones are counted in a single note."""


def add_note(notes: list[Note], note: Note) -> bool:
    """Append ``note`` unless `MAX_NOTES` of its kind are there; then count it in one more note.

    The count note (``"N more <kind> notes like the above"``) follows the kind's first
    `MAX_NOTES` and is replaced in place as the count grows: a log of a million over-long lines
    leaves 21 notes, not a million.

    Returns:
        Whether ``note`` itself was kept.
    """
    same = [i for i, kept in enumerate(notes) if kept.kind == note.kind]
    if len(same) < MAX_NOTES:
        notes.append(note)
        return True
    for at in reversed(same):  # the count note of the kind, if there is one yet
        counted = _COUNT.fullmatch(notes[at].message)
        if counted is not None:
            more = int(counted[1]) + 1
            notes[at] = Note(note.kind, f"{more} more {note.kind} notes like the above")
            return False
    notes.append(Note(note.kind, f"1 more {note.kind} note like the above"))
    return False


_COUNT = re.compile(r"(\d+) more \w+ notes? like the above")


class Reader(Protocol):
    """What every reader provides (see `BaseReader` for the shared implementation)."""

    format: ClassVar[str]  # the snake_case format name: registry key and CLI value
    notes: list[Note]

    @classmethod
    def sniff(cls, head: list[str]) -> float:
        """Confidence (0..1) that ``head``, the first decoded lines of a log, is this format."""
        ...

    def read(self, stream: IO[bytes]) -> Iterator[Item]:
        """The items of a binary stream, in log order, read with bounded memory."""
        ...


class BaseReader:
    """Notes and error handling shared by the readers; subclasses write `_items`.

    Args:
        notes: A list to append notes to (shared by several readers); a new list when None.
    """

    format: ClassVar[str] = ""
    prefixed: ClassVar[bool] = False
    """Whether it finds its lines anywhere in a line, behind whatever prefix a logger writes
    (a time, a level): then `read_log` leaves a logger's prefix on; for the others it takes
    one that every line has off (see `_paste`)."""

    binary: ClassVar[bool] = False
    """Whether it reads a binary format, told by its first bytes (`sniff_bytes`), not by lines."""

    def __init__(self, notes: list[Note] | None = None) -> None:
        self.notes: list[Note] = [] if notes is None else notes
        self.name = ""  # the file read, where `read_log` knows it (a download's tag is in it)

    @classmethod
    def sniff(cls, head: list[str]) -> float:
        """Confidence (0..1) that ``head`` is this format; 0 unless a subclass says otherwise."""
        return 0.0

    @classmethod
    def sniff_bytes(cls, head: bytes, name: str = "") -> float:
        """Confidence (0..1) that a file of a `binary` format starts with ``head`` (``name``:
        the file's name); 0 unless a subclass says otherwise."""
        return 0.0

    def read(
        self, stream: IO[bytes], *, close: Callable[[], None] | None = None
    ) -> Generator[Item, None, None]:
        """The items of ``stream``; I/O damage ends the stream with a note.

        Args:
            stream: A binary stream at the start of the log (left open).
            close: Called when the items end, are closed, or fail (`read_log` closes its files
                so, without a generator layer of its own around this one).

        Raises:
            LogReadError: The data broke the reader (a bug; reported, never a traceback).
        """
        try:
            yield from self._items(stream)
        except LogReadError:
            raise
        except (OSError, EOFError, zlib.error) as exc:
            self.note("truncated", f"stopped reading: {exc}")
        except Exception as exc:  # untrusted input must never escape as a traceback
            logger.debug("%s reader failed", self.format, exc_info=True)
            what = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line
            raise LogReadError(f"{self.format} reader failed: {what}") from exc
        finally:
            if close is not None:
                close()

    def _items(self, stream: IO[bytes]) -> Iterator[Item]:
        raise NotImplementedError

    def note(
        self, kind: str, message: str, line: int | None = None, step: int | None = None
    ) -> None:
        """Leave a note for the user (also logged at INFO); see `add_note` for the cap."""
        note = Note(kind, message, line, step)
        if add_note(self.notes, note):
            logger.info("%s: %s", self.format, note)
