"""Output files of ``stabilizer diagnose`` that never clobber and never write through a link.

An output is checked before the diagnosis starts (`check_file`, `check_run_dir`), so a wrong
path costs nothing. It is then written whole or not at all (`write_file`): a new file is created
exclusively (``O_EXCL``: an existing file or a symbolic link at the path makes it fail); with
``force`` the bytes go to a temporary file beside the target, renamed over it, which replaces a
link itself and never its target.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

__all__ = ["OutputError", "check_file", "check_run_dir", "write_file"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # POSIX; Windows has no symbolic links to fear here


class OutputError(Exception):
    """An output cannot or may not be written; the message is one line naming the path."""


def check_file(path: Path, option: str, force: bool) -> None:
    """Whether ``path`` may be written as a new file (or replaced, with ``force``).

    Raises:
        OutputError: The folder is missing or read-only, ``path`` is a directory, or ``path``
            exists (a symbolic link counts) and ``force`` is off.
    """
    folder = path.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise OutputError(f"{folder}: the {option} folder does not exist or is not writable")
    if path.is_dir() and not path.is_symlink():
        raise OutputError(f"{path}: is a directory; {option} needs a file name")
    if os.path.lexists(path) and not force:
        what = "a symbolic link" if path.is_symlink() else "a file"
        raise OutputError(f"{path}: {what} is there already; pass --force to replace it")


def check_run_dir(directory: Path, option: str, force: bool) -> None:
    """Whether ``directory`` may receive a TensorBoard run: missing, empty, or ``force``.

    A symbolic link is refused even with ``force``: writing into it would write elsewhere.

    Raises:
        OutputError: ``directory`` is a link, a file, or (without ``force``) not empty.
    """
    if directory.is_symlink():
        raise OutputError(f"{directory}: is a symbolic link; give {option} a real directory")
    if not directory.exists():
        return
    if not directory.is_dir():
        raise OutputError(f"{directory}: is not a directory")
    try:
        empty = next(os.scandir(directory), None) is None
    except OSError as exc:
        raise OutputError(f"{directory}: cannot read ({exc.strerror or exc})") from None
    if not empty and not force:
        raise OutputError(f"{directory}: is not empty; pass --force to write into it")


def write_file(path: Path, data: bytes, force: bool) -> None:
    """Write ``data`` as a new file at ``path``, or with ``force`` replace what is there.

    Either way ``path`` holds all of ``data`` or is left as it was.

    Raises:
        OSError: ``path`` exists (without ``force``; `FileExistsError`) or cannot be written.
    """
    if force:
        fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    else:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | getattr(os, "O_BINARY", 0)
        fd, temporary = os.open(path, flags, 0o666), str(path)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        if force:
            os.chmod(temporary, 0o644)  # mkstemp makes it private; an image is for sharing
            os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
