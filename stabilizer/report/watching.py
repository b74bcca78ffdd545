"""`WatchSession`: what ``stabilizer watch`` does between its options and its lines.

It runs a `Watch`, turns each finding into one line as it is found (the wall time, then the
finding, advised as every output advises it (`stabilizer.report.advising.advise_now`):
``12:03:04 step 41 error nonfinite_loss: loss is nan ...``), hands it to the `Notifier`, and
stops the watch at the first finding at or above ``exit_on``. An episode's updates are findings
too: a NaN that persists escalates its episode from error to critical (a line, a stop at
``--exit-on critical``, a message at ``--notify-on critical``), and the run's recovery closes it
(a line, a message with ``--notify-close``). Findings in what a file held before the watch began
are in the summary but are printed and sent only with ``from_start``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from stabilizer.core.records import Severity
from stabilizer.outputs.notify import ENV_WEBHOOK, Notifier
from stabilizer.replay.diagnose import Diagnosis, Failure, exit_code
from stabilizer.replay.watch import Alert, Watch

from .advising import advise_now
from .text import render_overall, render_text

__all__ = ["WATCH_HELP", "WatchSession"]

WATCH_HELP = {
    "from_start": "Also print and send the findings of what the logs hold already (by default "
    "read silently, as the detectors' baseline).",
    "fail_on": "At the end, exit 1 when a finding is at least this severe.  [default: warning]",
    "notify_on": "Send an episode (--exec, --webhook) once, when a finding of it is at least this "
    "severe (an update too: a NaN that persists becomes critical).  [default: error]",
    "exit_on": "Stop and exit 1 at the first finding at least this severe, an episode's update "
    "included (a wrapper script or a scheduler can then stop the job).",
    "exec": "Run this shell command for each finding sent: the finding as JSON on its standard "
    "input; STABILIZER_KIND, STABILIZER_SEVERITY, STABILIZER_STEP and STABILIZER_MESSAGE in "
    "its environment.",
    "webhook": "POST each finding sent as JSON with a text field (Slack, Mattermost, Discord's "
    f"/slack hooks) to this URL [env: {ENV_WEBHOOK}]; never printed in full.",
    "notify_close": "Also send the finding that closes a sent episode (the run recovered).",
}
"""The help of the ``watch`` options that need more than a line."""


class WatchSession:
    """One ``stabilizer watch`` (see the module docstring).

    Args:
        paths: The inputs, as given.
        say: Prints one line of output (a finding).
        tell: Prints one line about an input (it appeared, rotated, ...).
        format: A reader name, or ``"auto"``.
        from_start: Print and send the findings of what the files already held too.
        exit_on: Stop at the first finding at least this severe (None: never).
        notifier: Where findings are sent, if anywhere.
    """

    def __init__(
        self,
        paths: Sequence[str],
        say: Callable[[str], None],
        tell: Callable[[str], None],
        *,
        format: str = "auto",
        from_start: bool = False,
        exit_on: Severity | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        self.paths, self.say, self.from_start = list(paths), say, from_start
        self.exit_on, self.notifier = exit_on, notifier
        self.fail_on = Severity.WARNING
        self.stopped_on: Alert | None = None
        self.watch = Watch(self.paths, self._found, format=format, tell=tell)

    @classmethod
    def of_options(
        cls,
        paths: Sequence[str],
        format: str,
        options: Mapping[str, Any],
        say: Callable[[str], None],
        tell: Callable[[str], None],
    ) -> WatchSession:
        """The session of the command line's options (``exit_on``, ``fail_on``, ``command``,
        ``webhook``, ``notify_on``, ``notify_close``, ``from_start``); lines about the inputs
        go to ``tell`` as ``stabilizer watch: ...``.

        Raises:
            ValueError: The webhook is no http(s) URL.
        """
        notifier = None
        if options.get("webhook") or options.get("command"):
            notifier = Notifier(
                webhook=options.get("webhook"),
                command=options.get("command"),
                level=options.get("notify_on") or "error",
                close=bool(options.get("notify_close")),
            )
        exit_on = options.get("exit_on")
        session = cls(
            paths,
            say,
            lambda line: tell(f"stabilizer watch: {line}"),
            format=format,
            from_start=bool(options.get("from_start")),
            exit_on=None if exit_on is None else Severity.parse(exit_on),
            notifier=notifier,
        )
        session.fail_on = Severity.parse(options.get("fail_on") or "warning")
        return session

    def run(self) -> list[Diagnosis | Failure]:
        """Watch until every input ended, Ctrl-C, or a finding at ``exit_on``; send what is
        queued (a few seconds at most)."""
        try:
            return self.watch.run()
        finally:
            if self.notifier is not None:
                self.notifier.close()

    def exit_status(self, outcomes: Sequence[Diagnosis | Failure]) -> int:
        """1 after a stop at ``exit_on``; else the status `diagnose` gives (the worst)."""
        if self.stopped_on is not None:
            return 1
        return max((exit_code(outcome, self.fail_on) for outcome in outcomes), default=0)

    def summary(self, outcomes: Sequence[Diagnosis | Failure]) -> list[tuple[bool, str]]:
        """The lines at the end, each with whether it goes to standard error: the report of
        each log, as `diagnose` prints it, and what stopped the watch."""
        lines: list[tuple[bool, str]] = []
        if self.stopped_on is not None:
            stop = f"stabilizer watch: stopped at {self.line(self.stopped_on)} (--exit-on)"
            lines.append((True, stop))
        for index, outcome in enumerate(outcomes, 1):
            if isinstance(outcome, Failure):
                lines.append((True, f"stabilizer watch: error: {outcome.message}"))
            else:
                text = render_text(outcome, self.fail_on)
                lines.append((False, ("\n" if index > 1 else "") + text))
        if len(outcomes) > 1:
            lines.append((False, "\n" + render_overall(list(outcomes), self.fail_on)))
        return lines

    def line(self, alert: Alert) -> str:
        """One finding as printed: the wall time, the log (of several), the finding."""
        where = f"{alert.path}: " if len(self.paths) > 1 else ""
        clock = time.strftime("%H:%M:%S", time.localtime(alert.wall))
        return f"{clock} {where}{alert.finding}"

    def _found(self, alert: Alert) -> None:
        """Print, send, stop: for a new episode and for every update of one, so that an episode
        that escalates to ``exit_on`` or the notifier's level stops or is sent then."""
        if not (alert.live or self.from_start):
            return
        if alert.diagnosis is not None:
            finding = advise_now(alert.diagnosis, alert.segment, alert.finding)
            alert = replace(alert, finding=finding)
        self.say(self.line(alert))
        if self.notifier is not None:
            self.notifier.notify([alert.finding], where=alert.path, segment=alert.segment)
        exit_on = self.exit_on
        if exit_on is not None and self.stopped_on is None and alert.finding.severity >= exit_on:
            self.stopped_on = alert
            self.watch.stop()
