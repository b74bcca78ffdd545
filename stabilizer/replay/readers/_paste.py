"""A pasted log read as the log it holds: fences, quotes, line numbers, a logger's prefix.

Logs reach `diagnose` as people paste them: in a markdown fence (```` ``` ````, ```` ```text ````,
the closing one sometimes lost), quoted with ``> `` (a reply on GitHub), numbered (``cat -n``, an
editor's gutter), indented as a markdown code block, each line behind a ``logging`` prefix
(``2024-05-01 12:00:00,123 - INFO - ``), the ``$ python train.py`` line that started it on top.
None of that is what the trainer printed, and the readers' rules that look at the start of a line
(a table's header, a count first on the line, a CSV header) would misread it. `Paste.of` learns
the wrapper from the first lines, one *layer* at a time, each a shape that (nearly) every line
has; `Paste.pattern` is one regex that takes the layers off every line (where a line has them)
and empties fence and prompt lines (`_unwrap` streams the text through it). Lines are never
dropped or joined, so line numbers stay those of the file.

A layer is only what a person sees as a wrapper: ``>`` (on 90% of the lines), a number that
counts the lines (90%: the line's own number, or behind a tab or a bar), one tab or four blanks
(every line), and a logger's prefix: a time or a level first, then fields a logger writes (a
level, a ``file.py:42``, a dotted logger name), each behind a separator, the same fields on 90%
of the lines. Words of the message (``step 5``) are never a field.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

__all__ = ["Paste"]

_SHARE = 0.9  # of the lines that must have a layer
_LINES = 200  # non-blank lines a layer is learnt from
_FIELDS = 6  # fields of a logger's prefix, at most

# A fence's info string names a language (```python, ``` text, ```{.log}): one word at most, so a
# record glued to the fence (```{'loss': 1.07, ...}, ```iter 1: loss 2.3) is no fence line.
_FENCE = r" {0,3}(?:`{3,}|~{3,})[ \t]*[\w+#.-]*[ \t]*(?:\{[^}'\"\r\n]*\})?[ \t]*"
_PROMPT = r"(?:\([\w.-]+\) ?)?(?:[\w.-]+@[\w.-]+(?::\S*)?[$#]|\$) \S[^\r\n]*"
_BLANK = re.compile(rf"(?:{_FENCE}|{_PROMPT})$")
"""A fence, or a shell prompt and its command: no line of the log."""

_QUOTE = r" {0,3}> ?"
_INDENTS = ("\t", "    ")  # a markdown code block's indent
_NUMBERED = re.compile(r"( *)(\d+)(\t| ?[|│] ?|: ?)")
_NUMBER_SEPS = {"\t": r"\t", "|": r" ?[|│] ?", "│": r" ?[|│] ?", ":": r": ?"}

_TIME = r"\d{1,2}:\d\d:\d\d(?:[.,]\d{1,9})?"
_DATE = r"(?:\d{4}[-/.]\d\d?[-/.]\d\d?|\d\d?[-/.]\d\d?(?:[-/.]\d{2,4})?|[A-Z][a-z]{2} {1,2}\d\d?)"
_STAMP = rf"(?:{_DATE}(?:[ T_]|, ?))?{_TIME}(?:Z|[+-]\d\d:?\d\d)?(?: [AP]M)?"
_LEVEL = r"(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL|NOTICE|TRACE|SUCCESS)"
_FIELD_PATTERNS = {  # the fields of a logger's prefix; tried in this order
    "stamp": (
        rf"[IWEF]\d{{4}} +{_TIME} +\d+ +[\w./<>-]+:\d+\]"  # absl / glog
        rf"|\[[^\]\r\n]{{0,40}}?{_TIME}[^\]\r\n]{{0,60}}\]|\({_STAMP}\)|{_STAMP}"
    ),
    "level": rf"\[ *{_LEVEL} *\]|<{_LEVEL}>|{_LEVEL}(?![\w.])",
    "where": r"\[?(?:[\w.<>-]+\.py:\d+|[\w.<>-]+:[\w<>.-]+:\d+)(?::[\w<>]+)?\]?",
    "name": r"__main__|root|[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+",
}
_FIELD = {kind: re.compile(pattern) for kind, pattern in _FIELD_PATTERNS.items()}
_SEP = re.compile(r" *(?:(-)(?= |$)|(\|)|(:)) *| +|(?<=\])(?=\[)")  # (or none: "][")
_SEP_PATTERNS = {
    "-": r" *-(?: +|(?=[\r\n]|\Z))",
    "|": r" *\| *",
    ":": r" *: *",
    " ": r" +",
    "": "",
}
_ONCE = ("stamp", "level")  # a second time or level starts the next layer (a logger's inside)


@dataclass(frozen=True)
class Paste:
    """The wrapper of a pasted log.

    Args:
        layers: ``(what, pattern)`` of each layer, outermost first; ``what`` is ``quote``,
            ``numbers``, ``indent`` or ``prefix`` (a logger's).
        blank: Whether fence and prompt lines are emptied.
    """

    layers: tuple[tuple[str, str], ...] = ()
    blank: bool = False

    @classmethod
    def of(cls, lines: Sequence[str]) -> Paste | None:
        """The wrapper of a log whose first lines are ``lines``, or None when it has none."""
        numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
        blank = any(_BLANK.match(line) for _, line in numbered)
        todo = [(n, line) for n, line in numbered if not _BLANK.match(line)][:_LINES]
        layers: list[tuple[str, str]] = []
        while todo and len(layers) < 8:
            layer = _layer(todo)
            if layer is None:
                break
            layers.append(layer)
            strip = re.compile(layer[1])
            peeled = [(n, _peel(strip, line)) for n, line in todo]
            blank = blank or any(_BLANK.match(line) for _, line in peeled)  # "> ```"
            todo = [(n, line) for n, line in peeled if line.strip() and not _BLANK.match(line)]
        return cls(tuple(layers), blank) if layers or blank else None

    def markup(self) -> Paste | None:
        """This wrapper without its loggers' prefixes (None if nothing is left)."""
        layers = tuple(layer for layer in self.layers if layer[0] != "prefix")
        return replace(self, layers=layers) if layers or self.blank else None

    @property
    def what(self) -> str:
        """What the wrapper is, in words (for a note)."""
        names = {"quote": "'> ' quotes", "numbers": "line numbers", "indent": "an indent"}
        parts = [names.get(what, "a logger's prefix") for what, _ in self.layers]
        if self.blank:
            parts.append("fences or a prompt line")
        return ", ".join(dict.fromkeys(parts))

    def pattern(self) -> re.Pattern[str]:
        """One regex that matches the wrapper at the start of each line of a text (the layers in
        order, each where the line has it; a fence or prompt line whole): `str.sub` it away."""
        parts = "".join(f"(?:{pattern})?" for _, pattern in self.layers)
        tail = f"(?:{_FENCE}|{_PROMPT})(?=[\\r\\n]|\\Z)" if self.blank else ""
        return re.compile(rf"(?:(?<=[\r\n])|\A){parts}{f'(?:{tail})?' if tail else ''}")


def _peel(strip: re.Pattern[str], line: str) -> str:
    found = strip.match(line)
    return line if found is None else line[found.end() :]


def _layer(lines: list[tuple[int, str]]) -> tuple[str, str] | None:
    """The outermost layer that the lines share, or None."""
    need = _SHARE * len(lines)
    if sum(1 for _, line in lines if re.match(_QUOTE, line)) >= need:
        return "quote", _QUOTE
    numbers = _numbers(lines)
    if numbers is not None:
        return "numbers", numbers
    for indent in _INDENTS:
        if all(line.startswith(indent) for _, line in lines):
            return "indent", re.escape(indent)
    prefix = _prefix([line for _, line in lines])
    return None if prefix is None else ("prefix", prefix)


def _numbers(lines: list[tuple[int, str]]) -> str | None:
    """The pattern of line numbers before (90% of) the lines, or None: numbers that count the
    lines, each its line's own number, or counting from elsewhere behind a tab with the number
    right-aligned (``cat -n``) or behind a bar (an editor's gutter). A count first on the line
    with a colon (``12: loss 2.3``), from elsewhere, is a step, not a line number."""
    shapes: Counter[tuple[int, str, bool]] = Counter()
    for n, line in lines:
        found = _NUMBERED.match(line)
        if found is not None:
            pad, number, sep = found.groups()
            sep = sep.strip(" ") or sep
            shapes[int(number) - n, sep, bool(pad)] += 1
    if not shapes:
        return None
    (offset, sep, pad), count = shapes.most_common(1)[0]
    if count < _SHARE * len(lines):
        return None
    if offset != 0 and not (sep in "|│" or (sep == "\t" and pad)):
        return None
    return r" *\d+" + _NUMBER_SEPS[sep]


def _options(line: str, at: int) -> list[tuple[str, str, int]]:
    """The field a logger's prefix may have at ``at`` in ``line``: ``(kind, separator, end)``
    for each way to read the separator after it (``[INFO] | x`` is ``|``, or a blank before a
    table's ``| x |``)."""
    kind, field = next(
        ((kind, match) for kind, rx in _FIELD.items() if (match := rx.match(line, at))),
        ("", None),
    )
    sep = None if field is None else _SEP.match(line, field.end())
    if field is None or sep is None:
        return []
    options = [(kind, next((g for g in sep.groups() if g), sep[0][:1]), sep.end())]
    if options[0][1] != " " and line.startswith(" ", field.end()):
        options.append((kind, " ", len(line) - len(line[field.end() :].lstrip(" "))))
    return options


def _prefix(lines: list[str]) -> str | None:
    """The pattern of the logger's prefix that (90% of) the lines start with, or None: a time or
    a level first, then the fields they all have, each kind of the first two once; of two ways
    to read a separator, the one more lines share."""
    at = dict.fromkeys(range(len(lines)), 0)  # where each line that has the prefix so far is
    shape = list[tuple[str, str]]()
    for _ in range(_FIELDS):
        options = {i: _options(lines[i], start) for i, start in at.items()}
        counts = Counter(option[:2] for found in options.values() for option in found)
        for key in [key for key in counts if key[0] == "where"]:
            if _varies(key, options, at, lines):
                del counts[key]  # a step's "s:7435", not a source line
        if not counts:
            break
        key = max(counts, key=lambda key: (counts[key], key[1] != " "))
        if counts[key] < _SHARE * len(lines) or (key[0] in _ONCE and key[0] in dict(shape)):
            break
        if not shape and key[0] not in _ONCE:
            return None
        shape.append(key)
        at = {i: end for i, found in options.items() for *option, end in found if (*option,) == key}
    if not shape:
        return None
    return "".join(f"(?:{_FIELD_PATTERNS[kind]}){_SEP_PATTERNS[sep]}" for kind, sep in shape)


def _varies(
    key: tuple[str, str],
    options: dict[int, list[tuple[str, str, int]]],
    at: dict[int, int],
    lines: list[str],
) -> bool:
    """Whether a field read as a source place (``name:function:42``) differs on most lines: a
    logger's place repeats (a loop logs from a few lines of code), a step counts up
    (``INFO:root:s:7435 loss...`` is basicConfig's prefix, then the log's own ``s:7435``)."""
    places = [
        found[0]
        for i, read in options.items()
        if any((*option,) == key for *option, _ in read)
        and (found := _FIELD["where"].match(lines[i], at[i])) is not None
    ]
    return len(places) >= 4 and len(set(places)) > len(places) // 2
