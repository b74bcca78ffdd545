"""Line shapes the console readers recognise besides ``name: value`` pairs: fp16 overflow lines
and tables.

- **Overflows** of any trainer (``OVERFLOW!``, ``overflow detected, setting loss scale to``,
  ``Gradient overflow. Skipping step``, ``Attempted loss scale: X, reducing to Y``): a skipped
  step, with the scale in force after it and the rank that printed it, if named. The universal
  reader reads them, and so does the HF Trainer's, whose console DeepSpeed and apex print into.
- **Key-value tables** dumped once per record (OpenAI's logger: baselines, improved and guided
  diffusion): ``| name | value |`` rows between rulers of dashes, the step one of the rows,
  numbers like ``1.53e+05``. `joined_blocks` joins each block into one line of ``name=value``.
- **Tables**: a header of names (a counter first, a loss among them: YOLO, fastai), or the names
  above a ruler of dashes (spaCy), then rows of values under them, which the universal reader
  reads written out as ``name=value`` pairs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from itertools import islice

from stabilizer.core.signals import LOSS_SCALE, SKIPPED

__all__ = [
    "NUM",
    "Overflow",
    "joined_blocks",
    "overflow_in",
    "overflow_of",
    "printed_again",
    "row_of",
    "table_of",
]

NUM = (  # possessive: a number is taken whole or not at all ("308500ms" fails at once);
    # thousands separators ("41,943,040": groups of three after a first digit that is no 0)
    r"[-+]?+(?:[1-9]\d{0,2}+(?:,\d{3}+)++(?!\d)(?:\.\d++)?+|\d++\.?+\d*+(?:[eE][-+]?+\d++)?+"
    r"|\.\d++|[nN]a[nN]|[iI]nf(?:inity)?+)"
)
_OVERFLOW = re.compile(
    r"overflow(?:!| detected|\.\s+skipping)|grad(?:ient)? overflow|"
    r"(?:reducing dynamic|attempted) loss scale|found nan, decreased lg_loss_scale"
)
_LG = "lg_loss_scale"
_LG_SCALE = re.compile(r"lg_loss_scale to\s*(" + NUM + ")")  # guided diffusion: log2 of the scale
_NEW_SCALE = re.compile(
    r"(?:reducing (?:loss scale )?to|setting loss scale to:?|loss scale from \S+ to)\s*("
    + NUM
    + ")"
)
_ATTEMPTED = re.compile(r"attempted loss scale:?\s*(" + NUM + ")")
_RANK = re.compile(r"\brank\s*(\d+)")
_CELL = re.compile(r"[^\s|]+")  # a table's cell: what blanks and bars separate
_NAME = re.compile(r"[A-Za-z_][\w()/.-]*")  # a column's name
_COUNT_CELL = re.compile(r"\d+(?:/\d+)?")  # the first column of a row: "22/55", "3"
_NUMBER = re.compile(NUM)
_TABLE_FIRST = frozenset(("epoch", "step", "steps", "iter", "iteration", "batch"))
_RULER = re.compile(r" *-{2,}(?: +-{2,}){2,} *")  # "---  ------  ------------  ------"
_DASHES = re.compile(r"-+")
_RULED_NAMES = {"e": "epoch", "#": "step"}  # spaCy's columns: the epoch, the step
_YOLO_PARTS = {"box": "box_loss", "obj": "obj_loss", "cls": "cls_loss", "total": "loss"}


Overflow = tuple[dict[str, float], int | None]
"""An overflow line's record (a skipped step, the scale in force after it) and the rank it names."""


def printed_again(line: str, found: Overflow, last_line: str, last: Overflow) -> bool:
    """Whether an overflow line is the last one printed again (by another rank or logger): the
    scale it names, if any, is the last one's, and it is not the same rank reporting anew at
    another time (at the floor the scale stays 1, skip after skip)."""
    (values, rank), (last_values, last_rank) = found, last
    scale = values.get(LOSS_SCALE)
    same = scale is None or last_values.get(LOSS_SCALE, scale) == scale
    same = same and values.get(_LG) == last_values.get(_LG)
    return same and not (rank is not None and rank == last_rank and line != last_line)


def overflow_of(line: str) -> Overflow | None:
    """The record of an fp16 overflow line (see the module docstring) and the rank it names, if
    any; None for any other line. For readers of formats that print the overflows of another
    library among their own lines."""
    low = line.lower()
    return overflow_in(low) if "overflow" in low or "loss scale" in low else None


def overflow_in(low: str) -> Overflow | None:
    """`overflow_of` a lower-cased line (that holds "overflow" or "loss scale")."""
    if _OVERFLOW.search(low) is None:
        return None
    rank = _RANK.search(low)
    return _overflow(low), rank and int(rank[1])


def _overflow(low: str) -> dict[str, float]:
    """The record of an overflow line: a skipped step, and the scale in force after it."""
    scale = _NEW_SCALE.search(low) or _ATTEMPTED.search(low)  # (hysteresis keeps the scale)
    if scale is not None:
        return {SKIPPED: 1.0, LOSS_SCALE: float(scale[1].replace(",", ""))}
    lg = _LG_SCALE.search(low)
    if lg is not None:  # "Found NaN, decreased lg_loss_scale to -16199.354": 2 to that power
        power = float(lg[1].replace(",", ""))  # (kept too: below 2^-1074 every scale is the same 0)
        return {SKIPPED: 1.0, LOSS_SCALE: 2.0 ** max(min(power, 1000.0), -1075.0), _LG: power}
    return {SKIPPED: 1.0}


_KV_ROW = re.compile(r"\|\s*([A-Za-z_][\w./-]*)\s*\|\s*(" + NUM + r")\s*\|\s*")
_KV_COUNTERS = frozenset(("step", "steps", "iter", "iteration", "epoch", "global_step"))


def joined_blocks(lines: Iterable[str]) -> Iterator[str]:
    """``lines``, with each block of ``| name | value |`` rows joined into one line of
    ``name=value`` pairs (a counter first, written ``step: 153000``: as an integer), in place of
    its first row; its other rows become ``""``, so line numbers stay."""
    block: list[str] = []
    rows = 0
    for line in lines:
        if line.startswith("|") and (row := _KV_ROW.fullmatch(line)) is not None:
            rows += 1
            name, value = row[1], row[2]
            if name.lower() not in _KV_COUNTERS:
                block.append(f"{name}={value}")
            elif (step := _integer(value)) is not None:
                block.insert(0, f"{name}: {step}")
            continue
        if rows:
            yield ", ".join(block)
            yield from [""] * (rows - 1)
            block, rows = [], 0
        yield line
    if rows:
        yield ", ".join(block)


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
    if len(cells) < 3 or cells[0].lower() not in _TABLE_FIRST:
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
    if len(names) < 3 or names[0] not in _TABLE_FIRST or not all(names):
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
