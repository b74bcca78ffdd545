"""Whether a text is a document rather than a training log: markdown or source code.

A README or a script given to ``diagnose`` may quote log lines (a README's examples, a test's
strings), but what a person sees is a document: headings and links, or imports and definitions
at the start of lines, with a log line here and there. A pasted log is told apart by its training
records, not by its wrapper: its fences, quotes and prompt lines are taken off before reading
(`readers._paste`), and a log pasted with a heading or two around it is still mostly records.
`document_kind` looks at the first lines of a text log.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from stabilizer.core.records import StepRecord

from .readers.universal import UniversalReader

__all__ = ["STRUCTURED", "document_kind", "not_a_log"]

_HEADING = re.compile(r"#{1,6} \S")  # a markdown heading (with a link or a table: markdown)
_RULE = re.compile(r"\|(?: *:?-{3,}:? *\|)+ *$")  # a markdown table's "|---|---|" below its head
_SOURCE = re.compile(r"(?:import [\w.]+|from [\w.]+ import |def \w+\(|class \w+[(:]|async def )")
_RECORDS = 0.25  # of the non-blank lines: a text this full of training records is a log

STRUCTURED = frozenset(("jsonl", "tensorboard", "lightning_csv", "csv", "hf_trainer_state"))
"""Formats that are no console text: never taken for a document."""


def document_kind(lines: Sequence[str]) -> str | None:
    """``"a markdown document"`` or ``"Python source code"`` when the lines are one, else None:
    two headings and a link or a table's ``|---|`` rule for markdown; two lines that import, or
    that start a definition, at the start of a line, for source code (a log prints neither: its
    configuration dumps have comments, not imports); unless a quarter of the non-blank lines or
    more are training records (what the universal reader reads as one)."""
    headings = source = 0
    linked = False
    for line in lines:
        if _HEADING.match(line):
            headings += 1
        elif _SOURCE.match(line):
            source += 1
        linked = linked or "](" in line or bool(_RULE.match(line))
    if headings >= 2 and linked:
        kind = "a markdown document"
    elif source >= 2:
        kind = "Python source code"
    else:
        return None
    records = sum(isinstance(item, StepRecord) for item in UniversalReader().read_lines(lines))
    return None if records >= _RECORDS * sum(1 for line in lines if line.strip()) else kind


def not_a_log(path: str, kind: str) -> str:
    """The one line that refuses a document (``kind``, from `document_kind`) given as a log."""
    name = "standard input" if path == "-" else path
    return f"{name}: no training records: this is {kind}, not a training log"
