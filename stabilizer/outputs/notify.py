"""`Notifier`: tell someone about a finding: run a command, POST to a webhook, in the background.

    from stabilizer.outputs.notify import Notifier

    notifier = Notifier(webhook="https://hooks.slack.com/services/...", level="error")
    notifier.notify(findings)  # returns at once; a thread sends
    notifier.close()  # waits a little for what is queued

Both `stabilizer watch` and the live callback (``StabilityMonitor(notify=...)``) use it.

- **Webhook**: a POST of JSON whose ``text`` field is the finding's line, which Slack,
  Mattermost and Discord-compatible (``.../slack``) incoming webhooks show as is; the finding
  itself rides along under ``stabilizer``. ``<``, ``>`` and ``&`` are escaped, so a log cannot
  slip a ``<!channel>`` into the message. The URL is a secret: messages show only its host.
- **Command**: run by the shell, the finding as JSON on its standard input and in the
  environment as ``STABILIZER_KIND``, ``STABILIZER_SEVERITY``, ``STABILIZER_STEP`` and
  ``STABILIZER_MESSAGE`` (never on its command line: logs are untrusted input).

Never in the way: `Notifier.notify` only puts the message on a bounded queue (when it is full,
messages are dropped and counted); one thread sends, each attempt with a timeout, a few retries
with backoff. A dead endpoint costs one warning (logged), never an exception.

Once per episode: an episode (`stabilizer.core.episode`, the console's and the reports' rule,
in one log and segment) is sent when its first finding at or above ``level`` comes; later
findings of it (a NaN that persists) are not sent, except, with ``close=True``, the one that
closes it (INFO: the run recovered).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

from stabilizer.core.episode import Episodes
from stabilizer.core.records import Finding, Severity

__all__ = ["ENV_WEBHOOK", "MAX_EPISODES", "Notifier", "as_notifier", "redact"]

logger = logging.getLogger(__name__)

ENV_WEBHOOK = "STABILIZER_WEBHOOK"
"""The environment variable a webhook URL may come from (so it is not on a command line)."""

MAX_EPISODES = 10_000
"""Episodes remembered as sent; the oldest are forgotten past this many."""

_MAX_TEXT = 1500  # characters of a message's text


def redact(url: str) -> str:
    """``https://hooks.slack.com/…``: a webhook URL as messages may show it (its path is the
    secret)."""
    parts = urlsplit(url)
    host = parts.hostname or "?"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}/…"


class Notifier:
    """Sends findings to a webhook and/or a command (see the module docstring).

    Args:
        webhook: An http(s) URL to POST each message to.
        command: A shell command to run for each message.
        level: Send episodes whose finding is at least this severe.
        close: Also send the finding that closes a sent episode (the run recovered).
        timeout: Seconds one attempt may take.
        retries: Attempts after the first one fails.
        backoff: Seconds before the first retry; doubled before each further one.
        queue_size: Messages waiting at most; more are dropped (and counted).
        source: Who speaks, at the start of the text (``"stabilizer"``).

    Raises:
        ValueError: No webhook and no command, a webhook that is no http(s) URL, an unknown
            ``level``, or a number out of range.
    """

    def __init__(
        self,
        *,
        webhook: str | None = None,
        command: str | None = None,
        level: Severity | str = Severity.ERROR,
        close: bool = False,
        timeout: float = 5.0,
        retries: int = 2,
        backoff: float = 0.5,
        queue_size: int = 100,
        source: str = "stabilizer",
    ) -> None:
        if not webhook and not command:
            raise ValueError("a Notifier needs a `webhook` or a `command`, got neither")
        if webhook and urlsplit(webhook).scheme not in ("http", "https"):
            raise ValueError(f"`webhook` must be an http or https URL, got {redact(webhook)!r}")
        _check("timeout", timeout > 0, "> 0", timeout)
        _check("backoff", backoff >= 0, ">= 0", backoff)
        _check("retries", retries >= 0, ">= 0", retries)
        _check("queue_size", queue_size >= 1, ">= 1", queue_size)
        self.webhook, self.command = webhook or None, command or None
        self.level = level if isinstance(level, Severity) else Severity.parse(level)
        self.close_episodes, self.timeout, self.retries = close, timeout, retries
        self.backoff, self.source = backoff, source
        self.sent = self.dropped = self.failed = 0
        self.queue_size = queue_size
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(queue_size)
        self._streams: dict[tuple[str, int], Episodes] = {}  # the episodes of each log segment
        self._episodes: OrderedDict[tuple[str, int, int], bool] = OrderedDict()  # sent → closed
        self._thread: threading.Thread | None = None
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """Settings and counters (a strategy that spawns processes pickles its callbacks)."""
        state = self.__dict__.copy()
        for name in ("_queue", "_thread", "_lock"):
            del state[name]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._queue, self._thread, self._lock = queue.Queue(self.queue_size), None, threading.Lock()

    def __repr__(self) -> str:
        hook = redact(self.webhook) if self.webhook else None
        return f"Notifier(webhook={hook!r}, command={self.command!r}, level={self.level.name})"

    def notify(self, findings: Iterable[Finding], *, where: str = "", segment: int = 1) -> int:
        """Queue the findings that are due (see `due`); returns how many were queued, at once.

        Args:
            findings: Findings as they are found.
            where: The log (or run) they were found in, for the text and the episode.
            segment: The segment of the log.
        """
        queued = 0
        for finding in findings:
            kind = self.due(finding, where, segment)
            if kind:
                queued += self._put(_message(finding, kind, where, segment, self.source))
        return queued

    def due(self, finding: Finding, where: str = "", segment: int = 1) -> str:
        """``"open"``, ``"close"`` or ``""`` (not to send): the once-per-episode rule."""
        episode = self._streams.setdefault((where, segment), Episodes()).add(finding)
        key = (where, segment, episode.index)
        closed = self._episodes.get(key)
        if closed is None:
            if finding.severity < self.level:
                return ""
            self._episodes[key] = False
            if len(self._episodes) > MAX_EPISODES:
                self._episodes.popitem(last=False)
            return "open"
        if closed or not self.close_episodes or finding.severity != Severity.INFO:
            return ""
        self._episodes[key] = True
        return "close"

    def close(self, timeout: float | None = None) -> None:
        """Send what is queued, waiting up to ``timeout`` seconds (default: one attempt's)."""
        thread = self._thread
        if thread is None:
            return
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        thread.join(self.timeout if timeout is None else timeout)
        self._thread = None
        if thread.is_alive():  # (a daemon thread: it does not hold the process up)
            self._warn("late", "gave up waiting for the messages still queued or being sent")
        if self.dropped:
            self._warn("dropped", f"{self.dropped} message(s) dropped: the queue was full")

    def _put(self, message: dict[str, Any]) -> int:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._send_all, daemon=True, name="notify")
                self._thread.start()
        try:
            self._queue.put_nowait(message)
        except queue.Full:
            self.dropped += 1
            return 0
        return 1

    def _send_all(self) -> None:
        while (message := self._queue.get()) is not None:
            for target in ("webhook", "command"):
                if getattr(self, target) and self._attempts(target, message):
                    self.sent += 1

    def _attempts(self, target: str, message: dict[str, Any]) -> bool:
        """Send ``message`` to ``target``, retrying with backoff; False when every try failed."""
        wait, why = self.backoff, ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(wait)
                wait *= 2
            why, again = self._post(message) if target == "webhook" else self._run(message)
            if not why:
                return True
            if not again:
                break
        self.failed += 1
        name = redact(self.webhook or "") if target == "webhook" else f"command {self.command!r}"
        self._warn(target, f"{name} failed ({why}); later failures are not reported")
        return False

    def _post(self, message: dict[str, Any]) -> tuple[str, bool]:
        """Why the POST failed (``""``: it did not) and whether to try again."""
        data = json.dumps(message["payload"], allow_nan=False).encode()
        request = urllib.request.Request(
            self.webhook or "", data, {"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                response.read(1 << 16)
        except urllib.error.HTTPError as exc:
            return f"HTTP {exc.code}", exc.code >= 500 or exc.code == 429
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            return " ".join(str(reason).split())[:200], True
        return "", False

    def _run(self, message: dict[str, Any]) -> tuple[str, bool]:
        """Why the command failed (``""``: it did not) and whether to try again."""
        finding = message["payload"]["stabilizer"]["finding"]
        env = {
            **os.environ,
            "STABILIZER_KIND": str(finding["kind"]),
            "STABILIZER_SEVERITY": str(finding["severity"]),
            "STABILIZER_STEP": str(finding["step"]),
            "STABILIZER_MESSAGE": str(finding["message"]),
        }
        stdin = json.dumps(message["payload"]["stabilizer"], allow_nan=False)
        try:
            done = subprocess.run(  # the user's own command; the finding only
                self.command or "",  # reaches it through stdin and the environment
                shell=True,
                input=stdin.encode(),
                env=env,
                timeout=self.timeout,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return f"timed out after {self.timeout:g} s", True
        except OSError as exc:
            return str(exc.strerror or exc), False
        return ("", False) if done.returncode == 0 else (f"exit status {done.returncode}", True)

    def _warn(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("notify: %s", message)


def _check(name: str, ok: bool, rule: str, value: float) -> None:
    if not ok:
        raise ValueError(f"`{name}` must be {rule}, got {value}")


def _message(finding: Finding, kind: str, where: str, segment: int, source: str) -> dict[str, Any]:
    """The payload of one message: ``text`` for chat hooks, the finding for programs."""
    head = f"{source}: {where}: " if where else f"{source}: "
    if kind == "close":
        head += "closed: "
    text = _escape(head + str(finding).replace(" -> try: ", " → try: "))[:_MAX_TEXT]
    details = {
        "event": kind,
        "where": where,
        "segment": segment,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "finding": finding.to_dict(),
    }
    return {"payload": {"text": text, "stabilizer": details}}


def _escape(text: str) -> str:
    """Text a chat shows as it is: Slack's and Mattermost's control characters escaped."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def as_notifier(notify: Notifier | str | None) -> Notifier | None:
    """A `Notifier` from what a user passes: one already made, a webhook URL, or None.

    Raises:
        TypeError: ``notify`` is something else.
        ValueError: The string is no http(s) URL.
    """
    if notify is None or isinstance(notify, Notifier):
        return notify
    if isinstance(notify, str):
        return Notifier(webhook=notify)
    what = type(notify).__name__
    raise TypeError(f"`notify` must be a Notifier, a webhook URL or None, got {what}")
