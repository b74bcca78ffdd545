"""What the monitor says on the console (rank 0): a start line, the findings, one end line.

    stabilizer: on, policy protect; 14 depth groups: embed, block_00…block_11, head; log: ...
    stabilizer: step 62 error nonfinite_loss: loss is nan at step 62; step skipped, weights intact
    stabilizer: nonfinite_loss at 5 more steps (70…102), each skipped; weights intact
    stabilizer: done at step 300: 7 findings (2 error, 5 warning); 9 steps skipped ...

Lines go through the ``stabilizer`` logger, each finding at its severity; as Lightning does for
its own logger, INFO is made visible (`show_info`). A finding prints what was seen and the
remedies that fit the run; repeats of a kind at a severity are folded into one line (after
`FOLD_STEPS` steps or at the end) that names the largest of them, except critical findings,
what the monitor did (`Kind.action`) and set-up advice (each its own line, counted apart on
the end line). A later finding of an episode (`stabilizer.core.episode`) prints as its update
(with the severity it escalated to, if it did), and the end line counts the episode once, at
its worst severity. After the step's stop line (`STOP_LINE`) the end line is the only line
left to print. More: docs/findings.md.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from torch import nn

from stabilizer.core.episode import Episodes, continues
from stabilizer.core.groups import depth_group
from stabilizer.core.kinds import REMEDY_APPLIED, Kind, kind_of
from stabilizer.core.records import Finding, Severity, StepRecord
from stabilizer.core.run import Cost, RunEnd
from stabilizer.core.signals import NONFINITE_UPDATE, NONFINITE_WEIGHTS, OTHER, SKIPPED, block_index
from stabilizer.outputs.wording import counted

from .cost import budget_verdict
from .fold import Fold

__all__ = ["FOLD_STEPS", "STOP_LINE", "Console", "compact_groups", "show_info"]

log = logging.getLogger("stabilizer")

FOLD_STEPS = 50
"""Repeats of a finding are summed up in one line at most this many steps after the first."""

STOP_LINE = "stabilizer: stopping at step "
"""How the line that stops the run begins (`stabilizer.step.monitor.RunMonitor` prints it, and
`RunEnd.stopped` carries its reason to the end): after it, only the end line prints."""


def show_info() -> None:
    """Make the ``stabilizer`` logger's INFO lines visible, as Lightning does for its own."""
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    if not logging.getLogger().hasHandlers() and not log.handlers:
        log.addHandler(logging.StreamHandler())
        log.propagate = False


def compact_groups(groups: Sequence[str]) -> str:
    """``"embed, block_00…block_11, head"``: runs of consecutive blocks shortened."""
    parts: list[str] = []
    run: list[str] = []  # consecutive blocks not written yet
    last = -2
    for group in [*groups, ""]:
        index = block_index(group)
        if index is not None and run and index == last + 1:
            run.append(group)
        else:
            if run:
                parts.append(run[0] if len(run) == 1 else f"{run[0]}…{run[-1]}")
            run = [group] if index is not None else []
            if index is None and group:
                parts.append(group)
        last = index if index is not None else -2
    return ", ".join(parts)


class Console:
    """The monitor's lines on the console; only rank 0 prints.

    Args:
        policy: The monitor's policy (``protect`` and ``auto`` skip non-finite steps).
        fold_steps: Print a line for folded repeats at most this many steps after the first.
    """

    name = "console"

    def __init__(self, policy: str, fold_steps: int = FOLD_STEPS) -> None:
        self.policy, self.fold_steps = policy, fold_steps
        self.enabled = False
        self.jsonl: Path | None = None
        self.counts: Counter[Severity] = Counter()
        # Steps whose update was skipped (guard or grad scaler), of the records it is given;
        # a run's own count (`RunEnd.skipped`) replaces it at the end.
        self.skipped = 0
        # It takes a quiet step (no findings) only while repeats are folded: the records'
        # steps say when their line is due (`stabilizer.step.live_outputs.Output`).
        self.quiet = False
        self.applied = 0  # remedies applied
        self.worst: Finding | None = None
        self._intact: bool | None = None  # the monitor's last check of the weights
        self._cost: Cost | None = None  # what the monitor cost, measured
        self._shown: set[tuple[str, Severity]] = set()
        self._folds: dict[tuple[str, Severity], Fold] = {}
        self._episodes = Episodes()
        self._groups: frozenset[str] = frozenset()  # every depth group of the run
        self.setup: Counter[Severity] = Counter()  # set-up advice, counted apart

    def start(
        self,
        module: nn.Module,
        groups: Sequence[str],
        grouping: Callable[[str], str] | None,
        jsonl: Path | None,
    ) -> None:
        """The start line (rank 0): policy, depth groups (and what fell into ``other``), the
        log file."""
        self.enabled = True
        show_info()
        self.jsonl, self._groups = jsonl, frozenset(groups)
        parts = [f"on, policy {self.policy}"]
        parts.append(f"{counted(len(groups), 'depth group')}: {compact_groups(groups)}")
        group_of = grouping or depth_group
        names = [n for n, p in module.named_parameters() if p.requires_grad]
        other = [n for n in names if group_of(n) == OTHER]
        if other:
            shown = ", ".join(other[:4]) + (f" and {len(other) - 4} more" if len(other) > 4 else "")
            parts.append(f"in {OTHER} (no depth; grouping= places them): {shown}")
        parts.append(f"log: {jsonl}" if jsonl is not None else "no JSONL log")
        log.info("stabilizer: %s", "; ".join(parts))

    def write(self, record: StepRecord | None, found: Sequence[Finding]) -> None:
        """Count the step; print each finding, or fold it into the line of its repeats."""
        if not self.enabled:
            return
        if record is not None:
            self.skipped += int(record.values.get(SKIPPED, 0.0) >= 0.5)
            self._flush(lambda fold: record.step - fold.first >= self.fold_steps)
        for finding in found:
            self._finding(finding, record)
        self.quiet = bool(self._folds)

    def close(self, end: RunEnd) -> None:
        """Print what is still folded, then the one end-of-run line (`summary`).

        `end.skipped` (steps whose update did not happen, as the monitor counted them: a step
        it could not measure has no record) replaces the records' count when given;
        `end.intact`, the monitor's last check of the weights, is the only ground for "weights
        checked finite" (None: not checked, policy ``observe``).
        """
        if not self.enabled:
            return
        if end.skipped is not None:
            self.skipped = end.skipped
        self._intact, self._cost = end.intact, end.cost
        if end.stopped:  # after the stop line, the end line only (it counts what is folded)
            self._folds.clear()
        self._flush(lambda fold: True)
        log.info("stabilizer: %s", self.summary(end.step))

    def summary(self, step: int) -> str:
        """``"done at step 300: 7 findings (2 error, 5 warning), worst: ...; 9 steps skipped"``."""
        total = sum(self.counts.values())
        if total:
            head = f"{counted(total, 'finding')} ({_tally(self.counts)})"
            if self.worst is not None and self.worst.severity >= Severity.WARNING:
                head += f", worst: {_span(self.worst)} {self.worst.kind}"
        else:
            head = "healthy, no findings"
        parts = [f"done at step {step}: {head}"]
        if self.setup:  # (advice on the set-up: no finding, as `diagnose` counts it)
            parts.append(
                f"{counted(sum(self.setup.values()), 'set-up note')} ({_tally(self.setup)})"
            )
        plural = "s" if self.skipped != 1 else ""
        parts.append(f"{self.skipped} step{plural} skipped{_claim(self._intact, self.skipped)}")
        if self.applied:
            parts.append(f"{self.applied} remed{'ies' if self.applied > 1 else 'y'} applied")
        if self._cost is not None:  # (the whole run's verdict: a warning said earlier is older)
            verdict = budget_verdict(self._cost)
            parts.append(f"{self._cost.describe()}{', ' + verdict if verdict else ''}")
        if self.jsonl is not None:
            parts.append(f"details: stabilizer diagnose {self.jsonl}")
        return "; ".join(parts)

    def line(self, finding: Finding, record: StepRecord | None = None) -> str:
        """One finding as printed: span, severity, kind, where, what, what became of the step,
        and its remedies (advised already: `stabilizer.core.advice`)."""
        kind = kind_of(finding.kind)
        where = self._where(finding)
        text = f"{_span(finding)} {finding.severity.name.lower()} {finding.kind}{where}: "
        text += finding.observation
        if _of_the_step(kind) and record is not None:
            text += "; " + _fate(record, self.policy)
        if finding.remedies and not kind.action:
            text += f" -> try: {', '.join(finding.remedies)}"
        return text

    def update_line(self, finding: Finding, escalated: bool = False) -> str:
        """An episode's update as printed: span, the severity it escalated to (if it did),
        kind, where, what it is now."""
        head = _span(finding) + (f" {finding.severity.name.lower()}" if escalated else "")
        return f"{head} {finding.kind}{self._where(finding)}, update: {finding.observation}"

    def _where(self, finding: Finding) -> str:
        """``" [embed, block_00…block_11]"``; nothing where a finding names every depth group
        (a NaN loss makes every gradient NaN: the list says nothing)."""
        location = finding.location
        if not location or (len(self._groups) > 1 and self._groups == set(location)):
            return ""
        return f" [{compact_groups(location)}]"

    def _updates(self, finding: Finding, record: StepRecord | None) -> bool:
        """Whether ``finding`` updates an episode printed before (then counted, and printed as
        its update); else it opens one. The updates the engine makes when the run ends (no
        record) print only when they escalate: "persists until the end of the log" after a
        stop line is what the end line says better."""
        episode = self._episodes.add(finding)
        self._track_worst(episode.finding)
        if not episode.updates or episode.was is None:
            return False
        now = episode.finding.severity
        if now > episode.was:  # the episode counts at the worst severity it reached
            self.counts[episode.was] -= 1
            self.counts[now] += 1
        if record is not None or now > episode.was:
            line = self.update_line(finding, escalated=now > episode.was)
            log.log(int(finding.severity), "stabilizer: %s", line)
        return True

    def _track_worst(self, now: Finding) -> None:
        """The worst episode, as it stands now (its latest span: 16-149, not 16-40)."""
        worst = self.worst
        if worst is None or now.severity > worst.severity or continues(now, worst):
            self.worst = now

    def _finding(self, finding: Finding, record: StepRecord | None) -> None:
        kind = kind_of(finding.kind)
        if kind.advises_setup(finding.severity):  # advice on the set-up: no episode, own line
            self.setup[finding.severity] += 1
            log.log(int(finding.severity), "stabilizer: %s", self.line(finding, record))
            return
        if self._updates(finding, record):
            return
        self.counts[finding.severity] += 1
        self.applied += finding.kind == REMEDY_APPLIED
        key = (finding.kind, finding.severity)
        folds = not kind.action and finding.severity < Severity.CRITICAL
        if not folds or key not in self._shown:
            self._shown.add(key)
            log.log(int(finding.severity), "stabilizer: %s", self.line(finding, record))
            return
        fold = self._folds.get(key)
        if fold is None:
            fold = self._folds[key] = Fold(finding.step, finding.step, 0)
        fold.add(finding)
        fold.skipped = fold.skipped and _skipped(record) and _checked_finite(record)

    def _flush(self, due: Callable[[Fold], bool]) -> None:
        for (kind, severity), fold in list(self._folds.items()):
            if not due(fold):
                continue
            del self._folds[(kind, severity)]
            text = fold.text(kind_of(kind).count_noun)
            if _of_the_step(kind_of(kind)) and fold.skipped and self.policy != "observe":
                text += ", each skipped; weights intact"
            log.log(int(severity), "stabilizer: %s", text)


def _tally(counts: Counter[Severity]) -> str:
    """``"2 error, 5 warning"``: the counts per severity, worst first."""
    return ", ".join(f"{counts[s]} {s.name.lower()}" for s in reversed(Severity) if counts[s])


def _of_the_step(kind: Kind) -> bool:
    """A NaN/Inf a detector saw in the step's own values (then the line says what became of the
    step's update); not the root cause, which explains one."""
    return kind.nan and kind.detector is not None


def _span(finding: Finding) -> str:
    if finding.end_step is None or finding.end_step == finding.step:
        return f"step {finding.step}"
    return f"steps {finding.step}-{finding.end_step}"


def _skipped(record: StepRecord | None) -> bool:
    return record is not None and record.values.get(SKIPPED, 0.0) >= 0.5


def _checked_finite(record: StepRecord | None) -> bool:
    """The monitor checked the weights before this step, and they were finite."""
    return record is not None and record.values.get(NONFINITE_WEIGHTS, 1.0) == 0.0


def _claim(intact: bool | None, skipped: int) -> str:
    """What the end line may say of the weights: only what the last check found."""
    if intact is False:
        return "; the weights are NOT intact (non-finite values found: see the critical finding)"
    if intact and skipped:
        return ", weights checked finite at the end"
    return ""


def _fate(record: StepRecord, policy: str) -> str:
    """What became of a non-finite step's update, and what the monitor checked of the weights."""
    if not _checked_finite(record) and NONFINITE_WEIGHTS in record.values:
        return "the weights were already non-finite: NOT intact"
    intact = ", weights intact" if _checked_finite(record) else ""
    if record.values.get(NONFINITE_UPDATE, 0.0) >= 0.5:
        return f"the step's update was undone{intact}"
    if _skipped(record):
        return f"step skipped{intact}"
    return f"the update was applied (policy {policy})"
