"""The byte-level corpus: real stdlib text, deterministic, cached, with clear errors."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from stabilizer.demo.data import CorpusError, RandomWindows, load_corpus, stdlib_sources


def test_stdlib_sources_are_sorted_and_skip_site_packages() -> None:
    files = stdlib_sources()
    assert len(files) > 500
    assert files == sorted(files, key=lambda p: p.as_posix())
    assert not any("site-packages" in p.parts for p in files)
    assert all(p.suffix == ".py" for p in files)


def test_stdlib_corpus_is_deterministic_and_cached(tmp_path: Path) -> None:
    a = load_corpus(cache_dir=tmp_path / "a")
    b = load_corpus(cache_dir=tmp_path / "b")  # built again from scratch
    assert len(a.train) > 10_000_000 and len(a.val) > 1_000_000
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    cached = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert len(cached) == 2 and all(n.endswith(".u8") for n in cached)
    again = load_corpus(cache_dir=tmp_path / "a")  # memory-mapped from the cache
    assert isinstance(again.train, np.memmap) and np.array_equal(again.train, a.train)
    assert "def " in a.decode(a.train[:100_000].tolist())


def test_user_text_file(tmp_path: Path) -> None:
    text = ("The quick brown fox jumps over the lazy dog. " * 200).encode()
    path = tmp_path / "fox.txt"
    path.write_bytes(text)
    corpus = load_corpus(path, cache_dir=tmp_path / "cache")
    assert bytes(corpus.train) + bytes(corpus.val) == text
    assert len(corpus.val) == len(text) - int(len(text) * 0.9)
    assert corpus.source == str(path.resolve())


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda d: d / "missing.txt", "data file not found: .*missing.txt"),
        (lambda d: d, "data path is a directory, expected a text file"),
        (lambda d: _write(d / "empty.txt", b""), "data file is empty: .*empty.txt"),
        (
            lambda d: _write(d / "tiny.txt", b"abc"),
            r"data file is too small \(3 bytes, need >= 1024\)",
        ),
    ],
    ids=["missing", "directory", "empty", "too-small"],
)
def test_bad_data_paths_get_one_clear_error(tmp_path: Path, make, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(CorpusError, match=match):
        load_corpus(make(tmp_path), cache_dir=tmp_path / "cache")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "secret.txt", b"x" * 2000)
    path.chmod(0)
    with pytest.raises(CorpusError, match="cannot read data file"):
        load_corpus(path, cache_dir=tmp_path / "cache")


def _write(path: Path, payload: bytes) -> Path:
    path.write_bytes(payload)
    return path


def test_random_windows_are_deterministic_shifted_and_corruptible() -> None:
    tokens = np.arange(10_000, dtype=np.int64).astype(np.uint8)
    ds = RandomWindows(
        tokens, block_size=16, batch_size=4, num_batches=10, seed=3, corrupt=range(5, 6)
    )
    x, y = ds[2]
    assert x.shape == y.shape == (4, 16)
    assert (x[:, 1:] == y[:, :-1]).all()  # targets are the inputs shifted by one byte
    assert all((ds[2][0] == x).all() for _ in range(2))
    assert not (RandomWindows(tokens, 16, 4, 10, seed=4)[2][0] == x).all()
    cx, _ = ds[5]  # a corrupted batch: not consecutive bytes of the stream
    assert ((cx[:, 1:] - cx[:, :-1]) % 256 != 1).any()
    assert len(ds) == 10


def test_random_windows_too_short_split() -> None:
    with pytest.raises(CorpusError, match="split has 10 tokens, too few for one window"):
        RandomWindows(np.zeros(10, dtype=np.uint8), block_size=16, batch_size=1, num_batches=1)


def test_zero_filled_batches_replace_only_the_corrupted_ones() -> None:
    tokens = np.arange(10_000, dtype=np.int64).astype(np.uint8)
    plain = RandomWindows(tokens, 16, 4, 10, seed=3)
    zeros = RandomWindows(tokens, 16, 4, 10, seed=3, corrupt=range(5, 7), fill="zeros")
    for i in (5, 6):  # a zero-filled shard: NUL bytes in, NUL bytes to predict
        x, y = zeros[i]
        assert x.shape == y.shape == (4, 16) and not x.any() and not y.any()
    for i in (0, 4, 7, 9):
        assert all((a == b).all() for a, b in zip(zeros[i], plain[i], strict=True))


def test_unknown_fill_is_refused() -> None:
    with pytest.raises(ValueError, match="`fill` must be one of random, zeros, got 'ones'"):
        RandomWindows(np.zeros(100, dtype=np.uint8), 16, 1, 1, corrupt=range(1), fill="ones")
