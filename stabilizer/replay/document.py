"""Whether a text is a document rather than a training log: markdown or source code.

A README or a script given to ``diagnose`` may quote log lines (a README's examples, a test's
strings), but what a person sees is a document: fenced code blocks and headings, or imports and
definitions at the start of lines. Such a text holds no training records of its own, whatever
lines of it look like one. `document_kind` looks at the first lines of a text log.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["document_kind"]

_FENCE = re.compile(r" {0,3}(?:```|~~~)")  # a markdown code fence
_HEADING = re.compile(r"#{1,6} \S")  # a markdown heading (with a link or a table: markdown)
_RULE = re.compile(r"\|(?: *:?-{3,}:? *\|)+ *$")  # a markdown table's "|---|---|" below its head
_SOURCE = re.compile(r"(?:import [\w.]+|from [\w.]+ import |def \w+\(|class \w+[(:]|async def )")


def document_kind(lines: Iterable[str]) -> str | None:
    """``"a markdown document"`` or ``"Python source code"`` when the lines are one, else None:
    two code fences (or two headings and a link or a table's ``|---|`` rule) for markdown; two
    lines that import, or that start a definition, at the start of a line, for source code. A
    log prints neither (its configuration dumps have comments, not imports)."""
    fences = headings = source = 0
    linked = False
    for line in lines:
        if _FENCE.match(line):
            fences += 1
        elif _HEADING.match(line):
            headings += 1
        elif _SOURCE.match(line):
            source += 1
        linked = linked or "](" in line or bool(_RULE.match(line))
    if fences >= 2 or (headings >= 2 and linked):
        return "a markdown document"
    return "Python source code" if source >= 2 else None
