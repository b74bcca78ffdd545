"""The one check at the end of every report: no two of its sentences about the same steps
disagree, and its advice fits the run's precision.

`check` reads a rendered report (text or markdown) against its diagnosis and returns each
disagreement left, one line each: that a finding refuted by the log (`consistency.refuted`) is
still said to have recovered; advice that does not fit the precision of the run it is for
(``switch to bf16`` to a run in bf16 or with no fp16 scaler, fp32 islands to an fp32 run); a
verdict that points below at notes printed above it. The renderers log what it finds (a report
that contradicts itself is a bug, never kept quiet), and the tests run it over every report the
scenarios, the fixtures and the real logs make.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

from stabilizer.core.advice import RunFacts
from stabilizer.core.remedies import TABLE
from stabilizer.replay.diagnose import Diagnosis

from .consistency import refuted
from .incidents import incidents, run_facts

__all__ = ["check", "log_disagreements"]

logger = logging.getLogger(__name__)

_BF16 = [(row.text, row.text_bf16) for row in TABLE if row.text_bf16]  # (usual, in bf16)
_HEAD = re.compile(r"^(?:#### )?#(\d+)(?:  | · )", re.M)  # an incident's first line (text, md)


def check(diagnosis: Diagnosis, text: str) -> list[str]:
    """The disagreements left in ``text``, a rendered report (text or markdown) of
    ``diagnosis``; ``[]`` when it agrees with itself."""
    found: list[str] = []
    blocks = _blocks(text)
    for incident in incidents(diagnosis):
        block, name = blocks.get(incident.number, ""), f"#{incident.number}"
        since = refuted(incident.findings, diagnosis.segments[incident.segment - 1])
        if since is not None and ("the run recovered" in block or "recovered: " in block):
            found.append(f"{name} says the run recovered; the loss is non-finite from step "
                         f"{since} to the end")  # fmt: skip
        found += _precision(name, block, incident.facts)
    lower = text.lower()
    verdict = lower[lower.rfind("verdict:") :]
    facts = {run_facts(diagnosis, segment.index) for segment in diagnosis.segments}
    if len(facts) == 1:  # (one run, or runs alike: the verdict's advice is for it)
        found += _precision("the verdict", verdict, facts.pop())
    if " below (" in verdict and -1 < lower.find("set-up") < lower.rfind("verdict:"):
        found.append("the verdict points below at the set-up notes printed above it")
    return found


def log_disagreements(name: str, found: Sequence[str]) -> None:
    """Log each disagreement `check` found in the report of ``name`` (a bug, said once)."""
    for line in found:
        logger.warning("the report of %s disagrees with itself: %s", name, line)


def _precision(where: str, text: str, facts: RunFacts) -> list[str]:
    """Advice in ``text`` that does not fit a run of ``facts``."""
    found = []
    bf16 = facts.precision.startswith("bf16") or facts.not_fp16
    for usual, in_bf16 in _BF16:
        if bf16 and usual in text and usual != in_bf16:
            found.append(f"{where} advises {usual!r} to a run that is not fp16")
    if facts.low_precision is False and "(fp32 islands)" in text:
        found.append(f"{where} advises fp32 islands to an fp32 run")
    return found


def _blocks(text: str) -> dict[int, str]:
    """Each incident's lines in a text or markdown report, by its number."""
    heads = [(int(m.group(1)), m.start()) for m in _HEAD.finditer(text)]
    blocks = {}
    for i, (number, start) in enumerate(heads):
        end = heads[i + 1][1] if i + 1 < len(heads) else _after_timeline(text, start)
        blocks[number] = text[start:end]
    return blocks


def _after_timeline(text: str, start: int) -> int:
    """Where the timeline that ``start`` is in ends: the set-up notes, or the verdict."""
    ends = [text.find(mark, start) for mark in ("\nset-up:", "\n### Set-up", "\nverdict:")]
    ends += [text.find("\n**Verdict:**", start)]
    return min((end for end in ends if end >= 0), default=len(text))
