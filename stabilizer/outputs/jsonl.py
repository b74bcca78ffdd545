"""``stability.jsonl``: the monitor's own log, one JSON object per line, append-only.

The first line is the run's facts, ``{"type": "run", ...}`` (`stabilizer.core.run.RunHeader`:
precision, devices, strategy, policy, depth groups, version; a resumed run appends it again); then
each step record is a line ``{"type": "step", ...}`` and each finding a line
``{"type": "finding", ...}`` (see :mod:`stabilizer.core.records`); the last line says how the
run ended and what the monitor cost, ``{"type": "end", ...}`` (`stabilizer.core.run.RunEnd`).
A finding that updates an episode (its kind, start step and location those of an earlier line:
the cascade is over, the NaN persists) is a line of its own: the file is append-only; readers
fold the updates into one episode (`stabilizer.core.episode`). Every line is flushed as it is
written, so a crash loses at most the step being written. A line a crash cut short is ended
when the file is opened again, so the resumed run's first line does not run on from it (the
reader skips the broken line, with a note, and reads the next).
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import IO

from stabilizer.core.records import Finding, StepRecord
from stabilizer.core.run import RunEnd, RunHeader

__all__ = ["JsonlWriter"]


class JsonlWriter:
    """Append records and findings to ``path`` (parent folders are created).

    Args:
        path: The file; appended to if it exists (a resumed run continues its log).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8")
        if not _ends_a_line(self.path):
            self._file.write("\n")  # a crash cut the last line short: keep ours apart from it
            self._file.flush()

    def write(self, item: StepRecord | Finding | RunHeader | RunEnd) -> None:
        """Write one line and flush it."""
        if self._file is None:
            raise ValueError(f"{self.path} is closed")
        self._file.write(item.to_json() + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _ends_a_line(path: Path) -> bool:
    """Whether ``path`` is empty or its last byte ends a line."""
    with path.open("rb") as file:
        if file.seek(0, 2) == 0:
            return True
        file.seek(-1, 2)
        return file.read(1) == b"\n"
