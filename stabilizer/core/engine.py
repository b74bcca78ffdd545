"""The engine: one stream of `StepRecord`s through every detector, `Finding`s out.

The same engine runs live (fed by the Lightning callback) and in replay (fed by a log reader), so a
run and its log get the same findings. It never raises on data: a detector that raises is logged
once and disabled, and a detector whose signals are absent is skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from stabilizer.core.detectors.base import check_at_least

from .detectors import Detector, default_detectors
from .kinds import REMEDY_APPLIED
from .records import Finding, StepRecord
from .run import RunHeader

__all__ = ["Engine", "is_restart"]

logger = logging.getLogger(__name__)

_STATE_VERSION = 1
_NOTHING: list[Finding] = []  # what a quiet record's `update` returns; compared, never handed out


def _has_signals(requires: Sequence[str], values: Collection[str], grouped: list[str]) -> bool:
    """Whether ``values`` holds one of the keys (or, for names ending in ``/``, prefixes).

    ``grouped`` holds the keys of ``values`` with a ``/`` in them: only those can start with a
    prefix, and most logs have none, so the prefix test scans those alone.
    """
    for key in requires:
        if key in values:
            return True
        if grouped and key.endswith("/") and any(name.startswith(key) for name in grouped):
            return True
    return False


def is_restart(finding: Finding) -> bool:
    """Whether `finding` says that training restarted from an earlier snapshot: a
    ``remedy_applied`` with ``restored_step`` (``auto``'s rollback, its swap to pre-LN from its
    oldest snapshot). What came after the snapshot is gone: the live monitor and a replay of
    its log both call `Engine.restart` after it."""
    return finding.kind == REMEDY_APPLIED and "restored_step" in finding.evidence


def _order(finding: Finding) -> tuple[Any, ...]:
    return (finding.step, -finding.severity, finding.kind, finding.location, finding.message)


class Engine:
    """Feeds step records to detectors and collects their findings.

    A detector gets records from the first that holds one of its `requires` keys on (it treats
    records without them as no-ops). A detector whose signals have not appeared after
    `signal_grace` records is logged once at DEBUG; it keeps waiting, so sparse signals (activation
    statistics sampled every 500 steps) still reach it when they come. A detector that says it is
    ``done`` (nothing left to judge in this stream: `Diverged` past the stream's first records,
    `OverflowRisk` in a run that does not compute in fp16) gets no more records until it says
    otherwise (a checkpoint loaded, a new run header); its `finish` is still called.

    Args:
        detectors: The detectors to run, with unique names; None runs `default_detectors()`.
        signal_grace: Records after which a detector that has seen none of its signals is logged.

    Raises:
        ValueError: Two detectors share a name, or ``signal_grace`` < 1.
    """

    def __init__(
        self, detectors: Sequence[Detector] | None = None, *, signal_grace: int = 100
    ) -> None:
        self.detectors: list[Detector] = list(
            default_detectors() if detectors is None else detectors
        )
        names = [detector.name for detector in self.detectors]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"`detectors` must have unique names, got {', '.join(twice)} twice")
        check_at_least("signal_grace", signal_grace, 1)
        self.signal_grace = signal_grace
        self._records = 0  # records observed
        self._seen: set[str] = set()  # detectors whose signals have appeared
        self._noted: set[str] = set()  # detectors logged as lacking their signals
        self._disabled: set[str] = set()  # detectors that raised
        self._findings: list[Finding] = []
        self._running: list[Detector] = []  # enabled, signals seen, not done: fed every record
        self._waiting: list[Detector] = []  # enabled, signals not seen yet
        self._closing: list[Detector] = []  # of the running, those that may say they are done
        self._keys: set[str] = set()  # value keys the waiting detectors were checked against
        self._sort_out()

    @property
    def findings(self) -> list[Finding]:
        """Every finding so far, in emission order (each `observe` batch sorted)."""
        return list(self._findings)

    @property
    def disabled(self) -> frozenset[str]:
        """Names of the detectors disabled because they raised."""
        return frozenset(self._disabled)

    def observe(self, record: StepRecord) -> list[Finding]:
        """Feed one step; return its new findings, sorted by step, severity (worst first), kind."""
        self._records += 1
        # A key checked once cannot wake a waiting detector later: check new keys, and once more
        # at `signal_grace` to note the idle ones (most logs never log some signals).
        if self._waiting and (
            not self._keys.issuperset(record.values) or self._records == self.signal_grace
        ):
            self._keys.update(record.values)
            self._wake(record.values)
        found: list[Finding] = []
        for detector in self._running:
            try:
                result = detector.update(record)
            except Exception:
                self._disable(detector, "raised", exc_info=True)
                continue
            if result != _NOTHING:  # (not `[]`: no new list a detector a record)
                found += self._checked(detector, result)
        if self._closing:
            self._retire()
        return self._emit(found) if found else found

    def _retire(self) -> None:
        """Stop feeding the detectors that have just said they are done (a loop, not `any`: it
        runs after every record while one of them may still say so)."""
        for detector in self._closing:
            if detector.done:  # type: ignore[attr-defined]
                self._sort_out()
                return

    def _wake(self, values: Mapping[str, float]) -> None:
        """Start the waiting detectors whose signals ``values`` holds; note long-idle ones."""
        grouped = [key for key in values if "/" in key]  # only these can start with a prefix
        woken = False
        for detector in self._waiting:
            if _has_signals(detector.requires, values, grouped):
                self._seen.add(detector.name)
                woken = True
            elif detector.name not in self._noted:
                self._note_missing(detector)
        if woken:
            self._sort_out()

    def finish(self) -> list[Finding]:
        """End of stream: let every detector close its open episodes; return their findings."""
        found: list[Finding] = []
        for detector in self._enabled():
            found += self._run(detector, detector.finish)
        return self._emit(found)

    def restart(self) -> None:
        """Training restarted from earlier weights (``auto``'s restart as pre-LN): every detector
        with a ``restart()`` method starts its baseline over, so that the loss of the earlier
        weights is not measured against the level of the weights left behind."""
        for detector in self._enabled():
            method = getattr(detector, "restart", None)
            if callable(method):
                self._call(detector, method)
        self._sort_out()

    def set_run(self, run: RunHeader) -> None:
        """What the run is (its header: precision, hardware, ...): every detector with a
        ``set_run(run)`` method learns it (`OverflowRisk` judges the fp16 range only in a run that
        computes in fp16). Live, the monitor calls it at fit start; a replay, at the header its log
        opens with."""
        for detector in self._enabled():
            method = getattr(detector, "set_run", None)
            if callable(method):
                self._call(detector, method, run)
        self._sort_out()  # (the run may leave a detector nothing to judge, or give it back)

    def replay(self, records: Iterable[StepRecord]) -> list[Finding]:
        """Observe every record, then `finish`; return all findings of the stream."""
        found: list[Finding] = []
        for record in records:
            found += self.observe(record)
        return found + self.finish()

    def state_dict(self) -> dict[str, Any]:
        """Engine counters, findings and each enabled detector's state, as JSON-able data."""
        detectors = {}
        for detector in self._enabled():
            state = self._call(detector, detector.state_dict)
            if detector.name not in self._disabled:
                detectors[detector.name] = state
        return {
            "version": _STATE_VERSION,
            "records": self._records,
            "seen": sorted(self._seen),
            "noted": sorted(self._noted),
            "disabled": sorted(self._disabled),
            "detectors": detectors,
            "findings": [finding.to_dict() for finding in self._findings],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` saved; detectors absent from it start fresh.

        Raises:
            ValueError: ``state`` comes from an unknown version of the engine.
        """
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"`state` version must be {_STATE_VERSION}, got {state.get('version')!r}"
            )
        self._records = int(state["records"])
        self._seen, self._noted = set(state["seen"]), set(state["noted"])
        self._disabled = set(state["disabled"])
        self._keys = set()
        self._findings = [Finding.from_dict(data) for data in state["findings"]]
        saved = state["detectors"]
        for detector in self._enabled():
            if detector.name in saved:
                self._call(detector, detector.load_state_dict, saved[detector.name])
        self._sort_out()  # (a detector done in the checkpoint is done again)
        unknown = sorted(set(saved) - {detector.name for detector in self.detectors})
        if unknown:
            logger.info("ignoring saved state of detectors not configured: %s", ", ".join(unknown))

    def _enabled(self) -> list[Detector]:
        return [d for d in self.detectors if d.name not in self._disabled]

    def _sort_out(self) -> None:
        """Split the enabled detectors, in their order, into running and waiting (after every
        change of `_seen`, `_disabled` or a detector's ``done``), so that `observe` asks nothing
        of the others. A waiting detector that is done still wakes (its signals are noted)."""
        enabled = self._enabled()
        self._running = [
            d for d in enabled if d.name in self._seen and not getattr(d, "done", False)
        ]
        self._waiting = [d for d in enabled if d.name not in self._seen]
        self._closing = [d for d in self._running if hasattr(d, "done")]

    def _note_missing(self, detector: Detector) -> None:
        if self._records >= self.signal_grace:
            self._noted.add(detector.name)
            # DEBUG: a detector whose signal a run never has (fp16_overflow in an fp32 run) is
            # the normal case, not news; on the console it read like an error.
            logger.debug(
                "detector %r idle: none of its signals (%s) in the first %d records",
                detector.name,
                ", ".join(detector.requires),
                self._records,
            )

    def _call(self, detector: Detector, method: Callable[..., Any], *args: Any) -> Any:
        """Call a detector method; if it raises, log once and disable the detector (None)."""
        try:
            return method(*args)
        except Exception:
            self._disable(detector, "raised", exc_info=True)
            return None

    def _run(self, detector: Detector, method: Callable[..., Any], *args: Any) -> list[Finding]:
        """`_call` for `update`/`finish`, which must return a list of `Finding`."""
        result = self._call(detector, method, *args)
        if detector.name in self._disabled:
            return []
        return self._checked(detector, result)

    def _checked(self, detector: Detector, result: Any) -> list[Finding]:
        """``result`` when it is a list of `Finding`; else the detector is disabled and []."""
        if not isinstance(result, list) or not all(isinstance(f, Finding) for f in result):
            self._disable(detector, f"returned {type(result).__name__}, not a list of Finding")
            return []
        return result

    def _disable(self, detector: Detector, why: str, exc_info: bool = False) -> None:
        self._disabled.add(detector.name)
        self._sort_out()
        logger.warning(
            "detector %r %s; it is disabled for the rest of the run",
            detector.name,
            why,
            exc_info=exc_info,
        )

    def _emit(self, found: list[Finding]) -> list[Finding]:
        found.sort(key=_order)
        self._findings += found
        return found
