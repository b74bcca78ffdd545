"""Tables in console logs, written out as ``name=value`` lines for the universal reader.

- ``| name | value |`` blocks between rulers (OpenAI's logger: baselines, improved and guided
  diffusion), one record each: `numbered_blocks` joins a block into one line.
- A header of names (a counter first, a loss among them: YOLO, fastai), or the names above a
  ruler of dashes (spaCy): `table_of` reads the columns, `row_of` writes each row below out.
- Pretty-printed JSON objects of scalar members, ``{`` and ``}`` on lines of their own and a
  member a line (an excerpt of a ``trainer_state.json``'s ``log_history`` pasted without the
  file around it, ``"step": 1440`` after the loss): `objects` joins each into one line.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from itertools import islice

from .._lines import IDLE
from .._shapes import NUM
from .steps import STEP_NAMES

__all__ = ["numbered_blocks", "objects", "row_of", "table_of"]

_CELL = re.compile(r"[^\s|]+")  # a table's cell: what blanks and bars separate
_NAME = re.compile(r"[A-Za-z_][\w()/.-]*")  # a column's name
_COUNT_CELL = re.compile(r"\d+(?:/\d+)?")  # the first column of a row: "22/55", "3"
_NUMBER = re.compile(NUM)
_RULER = re.compile(r" *-{2,}(?: +-{2,}){2,} *")  # "---  ------  ------------  ------"
_DASHES = re.compile(r"-+")
_RULED_NAMES = {"e": "epoch", "#": "step"}  # spaCy's columns: the epoch, the step
_YOLO_PARTS = {"box": "box_loss", "obj": "obj_loss", "cls": "cls_loss", "total": "loss"}

_MEMBER = re.compile(r'\s*"[^"\n]{1,100}"\s*:\s*[^{}\[\]\n]{0,100}?,?\s*')  # "loss": 11.3599,
_MEMBERS = 64  # members of one object at most: a longer block is no record (a config dump)
_KV_ROW = re.compile(r"\|\s*([A-Za-z_][\w./-]*)\s*\|\s*(" + NUM + r")\s*\|\s*")


def objects(lines: Iterable[str]) -> Iterator[str]:
    """``lines``, each pretty-printed JSON object of scalar members joined into one line in place
    of its ``{`` line, its other lines ``""`` (every line keeps its number); a block that holds
    anything else (a nested object, a list, a line of text) passes through as it was."""
    block: list[str] = []
    for line in lines:
        if block:
            end = line is not IDLE and line.strip() in ("}", "},")
            if end:
                yield "{" + " ".join(member.strip() for member in block[1:]).rstrip(",") + "}"
                yield from [""] * len(block)  # (its members and its "}")
                block = []
                continue
            if line is not IDLE and len(block) <= _MEMBERS and _MEMBER.fullmatch(line):
                block.append(line)
                continue
            yield from block
            block = []
        if line[-1:] == "{" and line is not IDLE and line.strip() == "{":  # (one char, most lines)
            block = [line]
            continue
        yield line
    yield from block


def numbered_blocks(lines: Iterable[str]) -> Iterator[tuple[int, str]]:
    """``lines`` with their 1-based numbers (`IDLE` with the number of the line before it), each
    block of ``| name | value |`` rows joined into one line of ``name=value`` pairs (a counter
    first, written ``step: 153000``: as an integer) in place of its first row; its other rows
    become ``""``."""
    block: list[str] = []
    count = rows = 0
    for line in lines:
        if line.startswith("|") and (row := _KV_ROW.fullmatch(line)) is not None:
            rows += 1
            name, value = row[1], row[2]
            if name.lower() not in STEP_NAMES:
                block.append(f"{name}={value}")
            elif (step := _integer(value)) is not None:
                block.insert(0, f"{name}: {step}")
            continue
        if rows:
            yield count + 1, ", ".join(block)
            yield from ((count + k, "") for k in range(2, rows + 1))
            count, block, rows = count + rows, [], 0
        if line is not IDLE:
            count += 1
        yield count, line
    if rows:
        yield count + 1, ", ".join(block)


def _integer(text: str) -> int | None:
    """A counter's value as an integer (``1.53e+05`` is 153000), or None (``nan``)."""
    value = float(text.replace(",", ""))
    return int(value) if value == value and abs(value) < 2**62 else None


def _header(line: str, low: str) -> tuple[str, ...] | None:
    """The columns of a table's header, or None: names only, a counter first, a loss among them
    (YOLO's ``Epoch  GPU_mem  box_loss  cls_loss  dfl_loss  Instances  Size``, fastai's ``epoch
    train_loss valid_loss accuracy time``). YOLOv3/v5/v7 before v6 name their losses ``box obj
    cls`` (and their sum ``total``): read as ``box_loss``, ``obj_loss``, ``cls_loss``, the loss."""
    cells = _CELL.findall(line)
    if len(cells) < 3 or cells[0].lower() not in STEP_NAMES:
        return None
    if not all(_NAME.fullmatch(cell) for cell in cells):
        return None
    if "loss" in low:
        return tuple(cells)
    names = [cell.lower() for cell in cells]
    if "box" not in names or "obj" not in names:
        return None
    return tuple(_YOLO_PARTS.get(name, cell) for name, cell in zip(names, cells, strict=True))


def table_of(line: str, low: str, above: str) -> tuple[str, ...] | None:
    """The columns of the table a line that is no record begins (`_header`, or `_ruled` under
    the line ``above`` it), or None."""
    if "loss" in low or " obj " in low:
        return _header(line, low)
    if "---" in line and "loss" in above.lower():
        return _ruled(above, line)
    return None


def _ruled(header: str, ruler: str) -> tuple[str, ...] | None:
    """The columns of a header that a ruler of dashes underlines, or None: each column's name is
    the header's text above one run of dashes, lower-cased, blanks as ``_`` (spaCy's ``E  #
    LOSS TOK2VEC  LOSS NER  ENTS_F`` over ``---  ------  ------------  --------  ------``: the
    epoch, the step (``#``), the losses ``loss_tok2vec`` and ``loss_ner``, ...). Like a table
    `_header`: a counter first, a loss among them."""
    if _RULER.fullmatch(ruler) is None:
        return None
    runs = [run.span() for run in _DASHES.finditer(ruler)]
    names = [header[start:end].strip().lower().replace(" ", "_") for start, end in runs]
    names = [_RULED_NAMES.get(name, name) for name in names]
    if len(names) < 3 or names[0] not in STEP_NAMES or not all(names):
        return None
    if not any("loss" in name for name in names):
        return None
    return tuple(names)


def row_of(line: str, columns: tuple[str, ...]) -> str | None:
    """A row of the table of ``columns`` written out as ``name=value`` (None if the line is no
    row: fewer cells, or no count first): ``22/55  9.02G  0.1157 ... 640: 100%|...| 954/954 [``
    is ``step: 22/55, box_loss=0.1157, ..., Size=640 100%|...| 954/954 [``: a table that counts
    epochs is numbered in epochs, not by the bar within each. Cells that are no number
    (``9.02G``, ``00:12``) are left out; what follows the last column stays as printed."""
    cells = list(islice(_CELL.finditer(line), len(columns)))
    if len(cells) < len(columns) or not _COUNT_CELL.fullmatch(cells[0][0]):
        return None
    first = columns[0] if "step" in columns else "step"  # (spaCy: E, then #, the step)
    parts = [f"{first}: {cells[0][0]}"]  # the first counter is the step, epoch or not
    for name, cell in zip(columns[1:], cells[1:], strict=True):
        text = cell[0].rstrip(":")
        if _NUMBER.fullmatch(text):
            parts.append(f"{name}={text}")
    return ", ".join(parts) + line[cells[-1].end() :]
