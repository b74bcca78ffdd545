"""The findings as one TensorBoard text entry: one line per episode, updated in place.

A detector reports an episode again as it grows or ends (an fp16 overflow cascade as an error,
then as over; a depth imbalance at its patience, then at the end of the run), and the monitor
reports several findings at one step (a NaN loss, its root cause and the overflow cascade at
step 60). TensorBoard's default loader (the Rust data server) keeps one text per tag and step,
and a text at a step drops the texts of that tag at later steps. So the table is written whole,
always at `FINDINGS_STEP`: the newest table replaces the last one, and the Text tab shows one
entry that lists every episode once. TensorBoard's Python loader (``--load_fast false``) keeps
every version instead, the newest last.

`FindingsTable` keeps one row per episode, by the one rule of `stabilizer.core.episode` (the
console's, the reports'): a later version of an episode (the cascade is over, the NaN persists)
updates its row. A finding taken before is no news.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.plugins.text import metadata as text_metadata

from stabilizer.core.episode import Episodes
from stabilizer.core.kinds import kind_of
from stabilizer.core.records import Finding, Severity
from stabilizer.core.signals import TB_PREFIX

__all__ = [
    "FINDINGS_STEP",
    "FINDINGS_TAG",
    "FindingsTable",
    "findings_text",
    "is_setup",
    "table_rows",
]

FINDINGS_TAG = TB_PREFIX + "findings"  # text: the findings table
FINDINGS_STEP = 0  # every version of the table: the newest replaces the others
_PLACES = 3  # locations named in a row (a band of nine blocks: the first, the last, a count)


class FindingsTable:
    """The episodes of a run so far, a row each (see the module docstring)."""

    def __init__(self) -> None:
        self._episodes = Episodes()
        self._seen: set[Finding] = set()  # every finding taken: the same news again is none

    def add(self, batch: Sequence[Finding]) -> bool:
        """Take one batch of findings (reported together); whether any row changed."""
        news = [finding for finding in dict.fromkeys(batch) if finding not in self._seen]
        if not news:
            return False
        before = self._episodes.findings()
        for finding in news:
            self._seen.add(finding)
            self._episodes.add(finding)
        return self._episodes.findings() != before

    @property
    def rows(self) -> list[Finding]:
        """One finding per episode: by first step, severity (worst first), then as they came."""
        return sorted(self._episodes.findings(), key=lambda f: (f.step, -f.severity))


def table_rows(findings: Iterable[Finding]) -> list[Finding]:
    """The rows of a finished run's findings, as `FindingsTable` has them."""
    table = FindingsTable()
    table.add(list(findings))
    return table.rows


def _text(text: str) -> str:
    """Plain text in markdown: no emphasis, code or link from a message's own characters."""
    return re.sub(r"([\\`*_\[\]])", r"\\\1", text)


def _code(name: str) -> str:
    return "`" + name.replace("`", "'") + "`"


def _places(location: Sequence[str]) -> str:
    """Up to `_PLACES` names; a longer list as its first and last, with the count between."""
    names = [_code(name) for name in location]
    if len(names) > _PLACES:
        names = [names[0], f"… {len(names) - 2} more …", names[-1]]
    return ", ".join(names)


def _item(finding: Finding) -> str:
    """One list item, worded as the console's line: ``**steps 60–63 error kind** [where]: ...``."""
    steps = f"step {finding.step}"
    if finding.end_step is not None and finding.end_step != finding.step:
        steps = f"steps {finding.step}–{finding.end_step}"
    head = f"- **{steps} {finding.severity.name.lower()} {finding.kind}**"  # (snake_case: no em)
    where = f" [{_places(finding.location)}]" if finding.location else ""
    fix = f" → try: {', '.join(map(_code, finding.remedies))}" if finding.remedies else ""
    return f"{head}{where}: {_text(finding.message)}{fix}"


def _heading(rows: Sequence[Finding], as_of: int | None) -> str:
    counts = [
        f"{sum(f.severity == s for f in rows)} {s.name.lower()}"
        for s in sorted(Severity, reverse=True)
        if any(f.severity == s for f in rows)
    ]
    plural = "episode" if len(rows) == 1 else "episodes"
    when = f" as of step {as_of}" if as_of is not None else ""
    if not rows:
        return f"**No episodes{when}**"
    return (
        f"**{len(rows)} {plural}{when}**: {', '.join(counts)} (one line per episode: its worst "
        "severity, its latest message)"
    )


def is_setup(finding: Finding) -> bool:
    """Whether ``finding`` is advice on the set-up (the preflight's ``config_risk``), not an
    episode of the training (as the reports of ``diagnose`` tell them apart)."""
    return kind_of(finding.kind).advises_setup(finding.severity)


def _markdown(findings: Sequence[Finding], as_of: int | None) -> str:
    """The episodes under their heading, then the set-up notes apart (no episode: advice on the
    configuration the run began with)."""
    rows = [finding for finding in findings if not is_setup(finding)]
    setup = [finding for finding in findings if is_setup(finding)]
    lines = [_heading(rows, as_of), "", *(_item(finding) for finding in rows)]
    if setup:
        plural = "s" if len(setup) > 1 else ""
        lines += ["", f"**{len(setup)} set-up note{plural}** (the checks at the first batch)", ""]
        lines += [_item(finding) for finding in setup]
    return "\n".join(lines).rstrip()


def findings_text(
    findings: Sequence[Finding], as_of: int | None = None, tag: str = FINDINGS_TAG
) -> Summary:
    """The findings as markdown for TensorBoard's text dashboard, one list item each, in order.

    A heading counts the episodes by severity (the set-up notes follow apart, uncounted); each
    item reads as the console's line for the finding: steps (``start–end``), severity and kind
    in bold, location, message, remedies. A list, not a table: TensorBoard breaks table cells
    anywhere, so a six-column table wraps "severity" into "severit / y". With no findings the
    text says so. Write it at `FINDINGS_STEP`.

    Args:
        findings: The rows, one per episode (`FindingsTable.rows`).
        as_of: The last step the table covers, named in the heading; None: not named.
        tag: The text tag.
    """
    if findings:
        markdown = _markdown(findings, as_of)
    else:
        markdown = "No findings." if as_of is None else f"No findings as of step {as_of}."
    tensor = tensor_pb2.TensorProto(
        dtype="DT_STRING",
        string_val=[markdown.encode("utf-8")],
        tensor_shape=tensor_shape_pb2.TensorShapeProto(),
    )
    metadata = text_metadata.create_summary_metadata(display_name="findings", description="")
    return Summary(value=[Summary.Value(tag=tag, tensor=tensor, metadata=metadata)])
