"""The metrics of a console line: ``name: x``, ``name=x``, ``'name': x``, ``name x``, ``name is x``.

`values_of` finds every name beside a number and maps it to a signal key (`key_of`, through the
one alias table `aliases.ALIASES`); other names pass through as printed (two words as
``word_name``). `total` gives a record without a loss the sum of its ``loss_*`` parts, or the log
of its perplexity. The rules, with the real logs behind them, are in docs/readers.md.
"""

from __future__ import annotations

import math
import re
from collections.abc import Container
from functools import lru_cache
from typing import TypeGuard

from stabilizer.core.signals import LOSS, LR

from .._shapes import NUM
from ..aliases import ALIASES, HELD_OUT, PPL, SIGNALS, VAL_LOSS
from .steps import STEP_NAMES

SUMMARY_LOSS = "summary/loss"
"""The loss of a run's summary (its mean over the run): shown, never judged as a step's."""
_SUMMARY = "train_runtime"  # the HF Trainer's end-of-training dict (hf_trainer.py skips it too)

__all__ = [
    "COUNT_THEN_LOSS",
    "EVALUATING",
    "SUMMARY_LOSS",
    "Span",
    "held_out",
    "key_of",
    "known",
    "named_after",
    "spans_of",
    "total",
    "values_of",
]

_PAIR = re.compile(  # a name starts where a word does (the lookbehind after its first letter
    # lets the regex scan for letters fast), after CJK text too ("整体测试集上的Loss: 262.6") and
    # after a rule of dashes ("-----loss-----:"); possessive: giving characters back finds nothing
    r"([A-Za-z_](?<![A-Za-z0-9_./][A-Za-z_])(?<![^-]-[A-Za-z_])[\w./-]*+(?: [A-Za-z]++)?)"
    r"['\"\]]?(\s*[:=\uff1a]\s*\[?|\s+is\s+|\s+\[?\s*)"  # one word or two; "loss: [2.3]"
    # and Paddle's arrays of per-device losses, "loss [   nan 9.21 ...]": the first device's
    r"(?:tensor\(|\*\*|(?<=[:=] )(['\"])|(?<=[:=])(['\"]))?"  # "tensor(2.3, ...)"; "'loss': 'nan'"
    r"(" + NUM + r")(?(3)['\"]|(?(4)['\"]|(?=[\s,;|)\]}*]|[:.](?:\s|$)|$)))"  # (a dict of strings,
)  # quoted both sides); "nanms", "12:30", "1/2", "6%", "0'" are no values; "**LOSS : nan**" and
# "loss: **1.97**" (markdown bold, in a pasted log) hold one
COUNT_THEN_LOSS = re.compile(  # Tacotron 2 and its forks: "Train loss {iteration} {loss:.6f}"
    r"(?<![\w.])loss (\d+):? +([-+]?\d*\.\d+(?:e[-+]?\d+)?|nan|[-+]?inf)(?![\w.])"
)
"""An integer right after ``loss`` and a number with decimals (or NaN) after it, in a lower-cased
line: the integer is the iteration, the number the loss (NVIDIA's Tacotron 2, WaveGlow,
Mellotron, Flowtron and their forks print ``Train loss 130950 nan Grad Norm nan 2.11s/it`` and
``Validation loss 6312:  0.149928``)."""
_AFTER = re.compile(  # a field of a list, its value before its name: "11.8750 loss, 1e-12 LR"
    r"(?:^|[,;|])\s*(" + NUM + r")\s+([A-Za-z_][\w/]*+(?: [A-Za-z]++)?)\s*(?=[,;|]|$)"
)
_JUNK_NAN = re.compile(r"([A-Za-z_][\w./-]*)\s*[:=]\s*([nN]a[nN][A-Za-z]+)")  # "nanxxx"
_PREFIXES = ("train/", "train_", "train-", "training/")  # MXNet's and Sockeye's "Train-perplexity"
_FILLER = frozenset(("the", "info", "debug", "warning", "error", "current"))  # no qualifiers
_HELD_OUT = HELD_OUT  # a CamelCase loss of these is no training loss
_TRAINING = frozenset(("train", "training"))
EVALUATING = re.compile(  # a word that says a line reports an evaluation, not a training step
    r"(?<![a-z0-9/._-])(?:val|valid|validation|validating|eval|evaluation|evaluating|evaluate"
    r"|test|testing)(?![a-z0-9_/-]|\.\w)|测试|验证|评估"  # "Val. Epoch: 262" (not "test.py")
)
"""A word before a line's first ``loss`` that says the line reports an evaluation (searched in
the lower-cased line up to it): its values are `held_out`; its counts number the evaluation's
batches, not training steps."""  # "loss/train" (a tag: the metric, then its split)


@lru_cache(maxsize=4096)
def key_of(printed: str) -> str | None:
    """The key of the value printed after a name of one word or two (``lm loss``).

    Returns an alias's signal key, None for a counter (`STEP_NAMES`), else the name as printed
    (two words joined by ``_``).
    """
    before, _, name = printed.rstrip("-").rpartition(" ")  # "loss------" (a rule after it)
    low = name.lower()
    if low == "is" and before:  # "reg_loss is 0.08": the name is the word before "is"
        return key_of(before)
    if low in STEP_NAMES:
        return None
    if before and before.lower() not in _FILLER and not before.endswith("."):
        return ALIASES.get(f"{before.lower()} {low}", f"{before}_{name}")
    if low in ALIASES:
        return ALIASES[low]
    base = _unprefixed(low.removesuffix("_step"))
    if name.endswith("Loss") and len(name) > 4 and name[-5].isalnum():  # CrossEntropyLoss, CTCLoss
        path, _, word = base[:-4].rpartition("/")
        return VAL_LOSS if (path or word).startswith(_HELD_OUT) else LOSS
    if base not in ALIASES and "/" in base:
        return _on_path(base) or name
    return ALIASES.get(base, name)


def _unprefixed(name: str) -> str:
    """A name without its training prefix (``train/``, ``train_``, ``training/``), if any."""
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def _on_path(base: str) -> str | None:
    """The key of a name with a path: the alias after it (``optim/total_grad_norm``, a held-out
    loss after ``val/``), or before the split it names (``Loss/train``, ``loss/valid``)."""
    path, _, last = base.rpartition("/")
    key = ALIASES.get(last)
    if key is not None:
        return VAL_LOSS if key == LOSS and path.startswith(_HELD_OUT) else key
    key = ALIASES.get(path)
    if key is not None and (last in _TRAINING or last.startswith(_HELD_OUT)):
        return VAL_LOSS if key == LOSS and last not in _TRAINING else key
    return None


def values_of(line: str) -> dict[str, float]:
    """The metrics of a line by key; of two names for one key the first wins (``Loss: 0.31,
    ..., LM Loss: 1.08`` in StyleTTS2 is its loss, then a part of it)."""
    values: dict[str, float] = {}
    for name, sep, _, _, text in _PAIR.findall(line):
        key = key_of(name)
        if _takes(key, sep, values):
            values[key] = float(text.replace(",", "") if "," in text else text)
    if "nan" in line or "NaN" in line:
        for name, _ in _JUNK_NAN.findall(line):  # "loss: nanxxx": a NaN, if a signal's
            key = key_of(name)
            if key in SIGNALS and key not in values:
                values[key] = math.nan
    if _total_is_loss(values, line):
        values[LOSS] = values["total"]  # "[Losses: x 0.1, ..., cls 0.3, total 0.9]"
    loss = LOSS if LOSS in values else VAL_LOSS if VAL_LOSS in values else None
    if loss and values[loss].is_integer() and (before := COUNT_THEN_LOSS.search(line.lower())):
        values[loss] = float(before[2])  # "Train loss 130950 nan": the iteration, then the loss
    return values


def _takes(key: str | None, sep: str, values: Container[str]) -> TypeGuard[str]:
    """Whether a name's value is the line's value of ``key``: the first of that key; a signal
    after any separator, another name after ``=``, ``: `` or a blank (not ``(trainer:581)``)."""
    return (
        key is not None
        and key not in values
        and (key in SIGNALS or "=" in sep or sep[-1] in " \t\uff1a[")
    )


def _total_is_loss(values: Container[str], line: str) -> bool:
    """Whether a line listing ``Losses:`` has its ``total`` as its loss."""
    return "total" in values and LOSS not in values and "losses" in line.lower()


Span = tuple[int, int]


def spans_of(line: str) -> tuple[dict[str, Span], list[Span]]:
    """Where `values_of` reads each value of a line (the span of its number, by key, in the
    order `values_of` gives them) and the span of every name the pairs' regex found (a name may
    hold digits: ``top1``, ``layer.0``); without the NaNs of a ``nanxxx``, which `values_of`
    also reads where the line holds ``nan``. For `templates`, which learns a line's template
    from them."""
    spans: dict[str, Span] = {}
    names: list[Span] = []
    for found in _PAIR.finditer(line):
        names.append(found.span(1))
        key = key_of(found[1])
        if _takes(key, found[2], spans):
            spans[key] = found.span(5)
    if _total_is_loss(spans, line):
        spans[LOSS] = spans["total"]
    return spans, names


def named_after(line: str) -> dict[str, float]:
    """The metrics of a list of fields that each print a value before its name (tinygrad's
    ``   3 7.34 s run, 11.8750 loss, 0.000000000002 LR, 1454.57 GB used``): what `values_of`
    reads for ``loss: 11.875``; for a line in which it read nothing."""
    values: dict[str, float] = {}
    for text, name in _AFTER.findall(line):
        key = key_of(name)
        if key is not None and key not in values:
            values[key] = float(text.replace(",", "") if "," in text else text)
    return values


def _held_out(key: str) -> bool:
    """Whether a loss part is a held-out set's (fairseq's ``valid_nll_loss``, YOLO's
    ``val/box_loss``): no part of the training loss."""
    return key.lower().replace("/", "_").split("_", 1)[0] in _HELD_OUT


def _part(key: str) -> bool:
    """Whether a key is a part of the training loss (``loss_cls``, ``box_loss``; behind a
    training prefix too: ALBEF's and BLIP's ``train_loss_itm``; in any case: an AutoML
    controller's ``Minibatch Loss= 1.0120``)."""
    base = _unprefixed(key.lower())
    return (
        (base.startswith("loss_") or base.endswith("_loss"))
        and base not in SIGNALS
        and not _held_out(key)
    )


def known(values: dict[str, float]) -> set[str]:
    """The keys of ``values`` that make a line a record without a step: signals but the
    learning rate (alone it is a configuration: ``config: batch_size=32 lr=3e-4``), the parts of
    the training loss (``loss_cls``, ObjectGS's ``image_loss``)."""
    return {key for key in values if (key in SIGNALS and key != LR) or _part(key)}


def total(values: dict[str, float]) -> dict[str, float]:
    """A record's values, with the sum of its ``loss_*`` or ``*_loss`` parts as its loss if it
    has none: Detectron2 and mmdet add their parts so, YOLO its ``box_loss``, ``cls_loss``, ...;
    else the log of its perplexity (``PPL 8226.52``: the loss is ln 8226.52 = 9.01). The loss of
    a run's summary (the HF Trainer's last dict, with ``train_runtime``: its ``train_loss`` is the
    mean over the whole run, which sits above the last losses of any run that learned) is
    `SUMMARY_LOSS`, as its own readers skip that dict."""
    if _SUMMARY in values and LOSS in values:  # (the run's mean loss: shown, never judged)
        values[SUMMARY_LOSS] = values.pop(LOSS)
    if LOSS not in values and PPL in values:
        ppl = values[PPL]
        if ppl <= 0:
            return values  # (a perplexity of 0 or below is no exp of anything; NaN stays NaN)
        values[LOSS] = math.log(ppl)
    if LOSS not in values:
        parts = [v for key, v in values.items() if _part(key)]
        if parts:
            values[LOSS] = sum(parts)
    return values


def held_out(values: dict[str, float]) -> None:
    """The values of an evaluation's line (`EVALUATING`: ``| epoch 010 | valid on 'valid'
    subset 1000 / 1311 loss=1.60``, ``Test: [ 0/50] loss: 0.52``, ``整体测试集上的Loss: 262.6``)
    made held out, in place: its loss is `VAL_LOSS`, its perplexity ``val_ppl``, its parts
    ``val_<part>``: kept for the reports, never the training loss."""
    if LOSS in values:
        values.setdefault(VAL_LOSS, values.pop(LOSS))
    if PPL in values:
        values["val_ppl"] = values.pop(PPL)
    for key in [key for key in values if _part(key)]:  # "Classification loss: 0.277" too
        values[f"val_{key}"] = values.pop(key)
