"""`Options`: what the monitor reports, and where, whatever its policy — checked when given.

Every front end (``StabilityMonitor``, ``Stabilizer``, ``StabilityCallback``) takes these by
name; a wrong one is one sentence naming the argument, what it takes and what was given (the
style of Lightning's ``EarlyStopping``), raised where the user wrote it: a policy's knob given
to the monitor says which policy takes it, a misspelled name says the name it is close to.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from stabilizer.core.detectors.base import Detector
from stabilizer.live.preflight import preflight_switches
from stabilizer.outputs.notify import Notifier, as_notifier

from .policies import Auto, Protect

__all__ = ["PRECISIONS", "Options", "check_precision", "options_from", "whole"]

PRECISIONS = (
    "64-true", "32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true",
    "transformer-engine", "transformer-engine-float16",
)  # fmt: skip
"""Lightning's precision names, which every host maps its own setting to."""


def whole(value: object) -> bool:
    """An int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_precision(precision: object) -> None:
    """Raise unless `precision` is one of `PRECISIONS`."""
    if precision not in PRECISIONS:
        names = ", ".join(repr(p) for p in PRECISIONS)
        raise ValueError(f"`precision` must be one of {names}, got {precision!r}")


@dataclass(frozen=True)
class Options:
    """What the monitor reports, and where, whatever its policy.

    Args:
        detectors: The detectors to run (default: all registered, with default settings).
        grouping: ``parameter name -> depth group``, to override the naming conventions.
        activation_every: Sample activation maxima every N steps (0: never).
        heatmap_every: Write the per-layer heatmap image every N steps (0: only at the end).
        jsonl: Path of the JSONL log; True: beside the host's logs (or a new
            ``stability_logs/version_<N>/`` under its root dir); False: none.
        strict: Raise on an internal error of the monitor instead of warning once (else an error
            in reporting stops the reports, never the protection; an unchecked step is skipped).
        preflight: At the first batch, check the configuration and run the causal self-check:
            True, False, or a dict that switches single checks off.
        notify: Send findings (rank 0) from a background thread, once per episode.
        cost_budget: The share of the step time the monitor may take; above it one warning.
    """

    detectors: Sequence[Detector] | None = None
    grouping: Callable[[str], str] | None = None
    activation_every: int = 50
    heatmap_every: int = 100
    jsonl: str | Path | bool = True
    strict: bool = False
    preflight: bool | Mapping[str, bool] = True
    notify: Notifier | None = None
    cost_budget: float | None = 0.03
    switches: Mapping[str, bool] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("activation_every", "heatmap_every"):
            value = getattr(self, name)
            if not (whole(value) and value >= 0):
                raise (ValueError if whole(value) else TypeError)(
                    f"`{name}` must be an int >= 0, got {value!r}"
                )
        budget = self.cost_budget
        if budget is not None and not (isinstance(budget, int | float) and budget > 0):
            raise ValueError(f"`cost_budget` must be > 0 or None, got {budget!r}")
        if self.grouping is not None and not callable(self.grouping):
            raise TypeError(
                "`grouping` must be a function from a parameter name to its depth group, or "
                f"None, got {self.grouping!r}"
            )
        if not isinstance(self.jsonl, str | Path | bool):
            raise TypeError(f"`jsonl` must be a path, True or False, got {self.jsonl!r}")
        if self.detectors is not None and isinstance(self.detectors, str | bytes):
            raise TypeError(f"`detectors` must be a list of detectors, got {self.detectors!r}")
        object.__setattr__(self, "switches", preflight_switches(self.preflight))


_NAMES = tuple(f.name for f in fields(Options) if f.init)
_KNOBS = {f.name: policy for policy in (Auto, Protect) for f in fields(policy)}


def options_from(given: Mapping[str, Any]) -> Options:
    """`Options` from the names a front end was given, `notify` made a `Notifier`; an unknown
    name is one sentence (see the module)."""
    unknown = [name for name in given if name not in _NAMES]
    if unknown:
        raise unknown_option(unknown[0], given[unknown[0]])
    return Options(**{**given, "notify": as_notifier(given.get("notify"))})


def unknown_option(name: str, value: Any) -> TypeError:
    """The error for an option no front end takes (a policy's knob, or a misspelling)."""
    policy = _KNOBS.get(name)
    if policy is not None:
        return TypeError(
            f"`{name}` is a knob of the policy: pass policy={policy.__name__}({name}={value!r})"
        )
    close = difflib.get_close_matches(name, _NAMES, n=1)
    hint = f"; did you mean `{close[0]}`?" if close else "."
    return TypeError(f"unknown option `{name}`{hint} The options are: {', '.join(_NAMES)}")
