"""The shapes in which people paste a log: each a function of the log's text.

What issue #32 found logs wrapped in when they reach a GitHub issue, a chat or a forum: a
markdown fence (bare or ```` ```text ````, or only the opening one), a ``> `` quote, a
``logging`` prefix on every line (the formats real loggers print), line numbers (``cat -n``, an
editor's gutter, ``grep -n``), CRLF line ends, the ``$ command`` that started the run on top, a
tab-indented block. `diagnose` must give the same findings for each as for the plain log.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["SHAPES", "shaped"]


def _stamp(i: int) -> str:
    return f"2024-05-01 12:{i // 60 % 60:02d}:{i % 60:02d},{i * 37 % 1000:03d}"


def _each(make: Callable[[int, str], str]) -> Callable[[list[str]], list[str]]:
    return lambda lines: [make(i, line) for i, line in enumerate(lines, 1)]


SHAPES: dict[str, Callable[[list[str]], list[str]]] = {
    "fenced": lambda lines: ["```", *lines, "```"],
    "fenced_text": lambda lines: ["```text", *lines, "```"],
    "opening_fence_only": lambda lines: ["```", *lines],
    "quoted": _each(lambda i, line: f"> {line}" if line else ">"),
    # logging.basicConfig(format="%(asctime)s - %(levelname)s - %(message)s")
    "logging_prefix": _each(lambda i, line: f"{_stamp(i)} - INFO - {line}"),
    # the logging cookbook's "%(asctime)s - %(name)s - %(levelname)s - %(message)s"
    "logging_name_prefix": _each(lambda i, line: f"{_stamp(i)} - __main__ - INFO - {line}"),
    # Hugging Face example scripts: "%(asctime)s - %(levelname)s - %(name)s - %(message)s"
    "hf_prefix": _each(lambda i, line: f"05/01/2024 12:00:{i % 60:02d} - INFO - __main__ - {line}"),
    # loguru's default format
    "loguru_prefix": _each(
        lambda i, line: (
            f"2024-05-01 12:00:{i % 60:02d}.{i % 1000:03d} | INFO     | __main__:train:42 - {line}"
        )
    ),
    "bracket_prefix": _each(lambda i, line: f"[{_stamp(i)}] [INFO] {line}"),
    "basic_config_prefix": _each(lambda i, line: f"INFO:root:{line}"),  # basicConfig's default
    "cat_n": _each(lambda i, line: f"{i:>6}\t{line}"),
    "gutter": _each(lambda i, line: f"{i:>4} | {line}"),
    "grep_n": _each(lambda i, line: f"{i}:{line}"),
    "crlf": lambda lines: lines,  # (joined with \r\n below)
    "command": lambda lines: [
        "$ torchrun --nproc_per_node=8 train.py --lr=6e-4 --max_iters=5000 --batch_size 32",
        *lines,
    ],
    "tab_indented": _each(lambda i, line: f"\t{line}" if line else ""),
}
"""Each shape, as a function of the log's lines."""


def shaped(text: str, shape: str) -> str:
    """``text`` pasted in ``shape`` (a name of `SHAPES`)."""
    lines = SHAPES[shape](text.splitlines())
    return ("\r\n" if shape == "crlf" else "\n").join(lines) + "\n"
