"""`EventWriter`: one new TensorBoard event file, opened once, written without torch.

TensorBoard's own ``EventFileWriter`` reopens its file for every batch of events it appends
(hundreds of opens for one replayed log) from a background thread. This writer opens one file,
exclusively, and frames each event with TensorBoard's ``RecordWriter``.
"""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from types import TracebackType

from tensorboard.compat.proto import event_pb2
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.record_writer import RecordWriter

__all__ = ["EventWriter", "tensorboard_command"]

_FILES = itertools.count()  # tells apart the event files one process opens within a second
_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)


class EventWriter:
    """A ``SummaryWriter`` (``add_summary``) into a new event file of ``logdir``.

    The file is created exclusively: never an existing file, never through a symbolic link.
    Use it as a context manager, or call `close` to flush the file.

    Args:
        logdir: The run directory; created when missing.
        suffix: Appended to the file name ``events.out.tfevents.<time>.<host>.<pid>.<n>``.

    Raises:
        OSError: The directory or the file cannot be created.
    """

    def __init__(self, logdir: str, suffix: str = "") -> None:
        os.makedirs(logdir, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}"
        self.path = os.path.join(logdir, f"{name}.{os.getpid()}.{next(_FILES)}{suffix}")
        file = os.fdopen(os.open(self.path, _FLAGS | getattr(os, "O_BINARY", 0), 0o666), "wb")
        self._writer = RecordWriter(file)
        self._write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def _write(self, event: event_pb2.Event) -> None:
        self._writer.write(event.SerializeToString())

    def add_summary(self, summary: Summary, global_step: int | None = None) -> None:
        """Write ``summary`` as an event at ``global_step`` (0 when None), stamped now.

        Raises:
            ValueError: ``global_step`` is outside TensorBoard's int64 range.
        """
        self._write(event_pb2.Event(wall_time=time.time(), step=global_step or 0, summary=summary))

    def flush(self) -> None:
        """Write the pending events to disk."""
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (again: nothing)."""
        if not self._writer.closed:
            self._writer.close()

    def __enter__(self) -> EventWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def tensorboard_command(log_dir: Path) -> str:
    """``tensorboard --logdir runs`` as this environment runs it: the venv's program by its
    path when the venv is not on PATH (`make demo` does not activate it)."""
    here = Path(sys.executable).parent / "tensorboard"
    program = "tensorboard"
    if here.exists() and shutil.which("tensorboard") != str(here):
        program = os.path.relpath(here) if here.is_relative_to(Path.cwd()) else str(here)
    return f"{program} --logdir {log_dir}"
