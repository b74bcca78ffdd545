"""Real text with no download: a byte-level corpus from the standard library's own sources.

Every machine with Python has ~30 MB of English-commented Python code in its standard library.
We read it in a deterministic order, split it into train and validation by file, and cache the
bytes as flat ``uint8`` files that are memory-mapped on later runs. ``--data PATH`` swaps in the
user's own text file (split 90/10 by position). Tokens are bytes, so the vocabulary is 256 and
decoding is ``bytes(tokens).decode("utf-8", errors="replace")``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
import torch.utils.data

from .scenarios import FILLS

__all__ = [
    "VOCAB_SIZE",
    "Corpus",
    "CorpusError",
    "RandomWindows",
    "default_cache_dir",
    "load_corpus",
    "stdlib_sources",
]

log = logging.getLogger(__name__)

VOCAB_SIZE = 256  # byte-level tokens
_VAL_EVERY = 10  # every 10th stdlib file goes to validation
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_MIN_BYTES = 1024  # below this a "corpus" cannot fill even a few training windows


class CorpusError(ValueError):
    """The text source cannot be turned into a corpus (missing, unreadable, empty, too small)."""


@dataclass(frozen=True)
class Corpus:
    """Train and validation token streams (memory-mapped ``uint8``) and where they came from."""

    train: npt.NDArray[np.uint8]
    val: npt.NDArray[np.uint8]
    source: str

    def decode(self, tokens: Iterable[int]) -> str:
        """Turn byte tokens back into text (invalid UTF-8 shows as U+FFFD)."""
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def default_cache_dir() -> Path:
    """``$STABILIZER_CACHE``, else ``$XDG_CACHE_HOME/stabilizer``, else ``~/.cache/stabilizer``."""
    if env := os.environ.get("STABILIZER_CACHE"):
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "stabilizer"


def stdlib_sources(root: Path | None = None) -> list[Path]:
    """All ``.py`` files of the standard library, sorted by relative path (no site-packages)."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(base).as_posix())


def load_corpus(data: str | Path | None = None, cache_dir: str | Path | None = None) -> Corpus:
    """Build (first time) or memory-map (later) the corpus.

    Args:
        data: A UTF-8 (or any byte) text file to train on; ``None`` for the stdlib corpus.
        cache_dir: Where the cached token files live; see :func:`default_cache_dir`.

    Raises:
        CorpusError: The file is missing, unreadable, a directory, empty, too small or binary.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if data is None:
        files = stdlib_sources()
        if not files:
            where = sysconfig.get_paths()["stdlib"]
            raise CorpusError(f"no .py files found in the standard library at {where}")
        key = _key(f"{p}:{p.stat().st_size}" for p in files)
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        source = f"python{version} stdlib ({len(files)} files)"
        return _cached(cache, f"stdlib-{key}", source, lambda: _split_files(files))
    path = _check_file(Path(data))
    st = path.stat()
    key = _key([f"{path}:{st.st_size}:{st.st_mtime_ns}"])
    return _cached(cache, f"file-{key}", str(path), lambda: _split_bytes(path.read_bytes()))


def _check_file(path: Path) -> Path:
    if not path.exists():
        raise CorpusError(f"data file not found: {path}")
    if path.is_dir():
        raise CorpusError(f"data path is a directory, expected a text file: {path}")
    try:
        with path.open("rb") as f:
            head = f.read(_MIN_BYTES)
    except OSError as e:
        raise CorpusError(f"cannot read data file {path}: {e.strerror or e}") from None
    if not head:
        raise CorpusError(f"data file is empty: {path}")
    if len(head) < _MIN_BYTES:
        raise CorpusError(
            f"data file is too small ({len(head)} bytes, need >= {_MIN_BYTES}): {path}"
        )
    if _binary(head):  # (a model trained on it would sample raw bytes to the terminal)
        raise CorpusError(f"data file is binary, expected a text file: {path}")
    return path.resolve()


def _binary(head: bytes) -> bool:
    """Whether the first bytes of a file are no text: a NUL byte, or more than a tenth of them
    control characters (any other byte counts as text: UTF-8, Latin-1, ...)."""
    controls = sum(1 for byte in head if byte < 32 and byte not in b"\t\n\r\x0b\x0c\x1b")
    return b"\x00" in head or controls > len(head) // 10


def _key(parts: Iterable[str]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode("utf-8", errors="surrogateescape") + b"\0")
    return h.hexdigest()[:16]


def _split_files(files: Sequence[Path]) -> tuple[bytes, bytes]:
    train, val = bytearray(), bytearray()
    for i, p in enumerate(files):
        try:
            text = p.read_bytes()
        except OSError as e:  # a stray unreadable file must not stop the demo
            log.warning("skipping unreadable stdlib file %s: %s", p, e)
            continue
        (val if i % _VAL_EVERY == _VAL_EVERY - 1 else train).extend(text)
    return bytes(train), bytes(val)


def _split_bytes(raw: bytes) -> tuple[bytes, bytes]:
    cut = int(len(raw) * (1 - 1 / _VAL_EVERY))
    return raw[:cut], raw[cut:]


def _cached(
    cache: Path, stem: str, source: str, build: Callable[[], tuple[bytes, bytes]]
) -> Corpus:
    paths = {split: cache / f"{stem}.{split}.u8" for split in ("train", "val")}
    if not all(p.is_file() for p in paths.values()):
        parts = dict(zip(("train", "val"), build(), strict=True))
        cache.mkdir(parents=True, exist_ok=True)
        for split, p in paths.items():
            _write_atomic(p, parts[split])
        log.info("cached corpus %s under %s", source, cache)
    train, val = (np.memmap(paths[s], dtype=np.uint8, mode="r") for s in ("train", "val"))
    return Corpus(train=train, val=val, source=source)


def _write_atomic(path: Path, payload: bytes) -> None:
    # Write beside the target and rename, so a crash never leaves a half-written cache file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class RandomWindows(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Item ``i`` is the whole batch for step ``i``: ``(x, y)``, each ``(batch_size, block_size)``.

    Windows start at positions drawn from a generator seeded by ``(seed, i)``, so batch ``i`` is the
    same on every run, every worker and after a resume, and skipping batches is exact. Batches whose
    index falls in ``corrupt`` are replaced by uniform random bytes (``fill="random"``: the "bad
    data" of the spike scenario) or by NUL bytes (``fill="zeros"``: a zero-filled shard, as a
    preallocated token file that was never written or a truncated download leaves). Use with
    ``DataLoader(dataset, batch_size=None)``.

    Args:
        tokens: The token stream (e.g. ``Corpus.train``).
        block_size: Tokens per window (the model's context length).
        batch_size: Windows per batch.
        num_batches: Length of the dataset.
        seed: Base seed.
        corrupt: Batch indices to replace by bad data.
        fill: What replaces them: ``"random"`` (uniform random bytes) or ``"zeros"``.
    """

    def __init__(
        self,
        tokens: npt.NDArray[np.uint8],
        block_size: int,
        batch_size: int,
        num_batches: int,
        seed: int = 0,
        corrupt: Container[int] | None = None,
        fill: str = "random",
    ) -> None:
        if fill not in FILLS:
            raise ValueError(f"`fill` must be one of {', '.join(FILLS)}, got {fill!r}")
        if block_size < 1 or batch_size < 1 or num_batches < 1:
            raise ValueError(
                "`block_size`, `batch_size` and `num_batches` must be >= 1, got "
                f"{block_size}, {batch_size}, {num_batches}"
            )
        if len(tokens) < block_size + 1:
            raise CorpusError(
                f"split has {len(tokens)} tokens, too few for one window of block_size+1="
                f"{block_size + 1}; use a larger text file or a smaller block size"
            )
        self.tokens, self.block_size, self.batch_size = tokens, block_size, batch_size
        self.num_batches, self.seed = num_batches, seed
        self.corrupt: Container[int] = corrupt if corrupt is not None else range(0)
        self.fill = fill

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng((self.seed, i))
        shape = (self.batch_size, self.block_size + 1)
        if i in self.corrupt and self.fill == "zeros":
            chunk = np.zeros(shape, dtype=np.int64)
        elif i in self.corrupt:
            chunk = rng.integers(0, VOCAB_SIZE, shape)
        else:
            starts = rng.integers(0, len(self.tokens) - self.block_size, self.batch_size)
            chunk = np.stack([self.tokens[s : s + self.block_size + 1] for s in starts])
        t = torch.from_numpy(chunk.astype(np.int64))
        return t[:, :-1], t[:, 1:]  # inputs, next-byte targets
