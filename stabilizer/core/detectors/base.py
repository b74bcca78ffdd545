"""The detector interface, and the argument checks every detector shares.

A detector is a small streaming object. It sees one `StepRecord` at a time (plain floats, never
tensors or a trainer), so it behaves identically live and in replay, and it keeps its memory in
plain JSON-able data so that it rides in a checkpoint.

Reporting rules every detector follows:

- An *episode* (a spike that lasts 30 steps, a run of NaN steps) is reported once, with the step it
  started (`Finding.step`) and the last step the finding covers (`Finding.end_step`).
- A finding is emitted as soon as its classification is settled. A loss spike is told apart from a
  divergence only by what follows it, so it is reported when it ends; a NaN, an fp16 overflow
  cascade or an activation near the fp16 limit is reported at the step it is seen, because the run
  may never leave that state and a live guard must act now.
- A record that lacks a detector's signals is a no-op: no counter moves. Missing keys, NaN and Inf
  never raise.
- `finish` closes an episode still open when the stream ends.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from stabilizer.core.records import Finding, StepRecord

__all__ = ["Detector", "check_at_least", "check_fraction"]


class Detector(Protocol):
    """A streaming detector of one instability.

    A detector that keeps a baseline of the loss or the gradients may also define ``restart()``
    (no arguments): training went back to earlier weights, the baseline starts over
    (`Engine.restart`; `LossSpike`, `GradSpike`). One whose judgement depends on what the run is
    may define ``set_run(run)``, a `stabilizer.core.run.RunHeader` (`Engine.set_run`;
    `OverflowRisk`: the fp16 range matters only in a run that computes in fp16). One that can
    run out of things to judge in a stream may keep a ``done`` attribute (a bool, not a
    property: the engine reads it after every record while it is False): while it is True its
    `update` returns [] and changes nothing, and the engine stops calling it (`Diverged` past
    the stream's first records; `OverflowRisk` in a run that does not compute in fp16).

    Attributes:
        name: The snake_case name: registry key, CLI value, log tag segment.
        requires: The signal keys the detector reads, of which a record needs at least one; a key
            ending in ``/`` is a prefix (``"grad_norm/"`` matches ``"grad_norm/block_03"``).
    """

    name: ClassVar[str]
    requires: ClassVar[tuple[str, ...]]

    def update(self, record: StepRecord) -> list[Finding]:
        """Consume one step; return the findings whose episodes were settled by it."""
        ...

    def finish(self) -> list[Finding]:
        """End of stream: report and close any episode still open."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The detector's memory as plain JSON-able data (ints, floats, str, lists, dicts, None)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the memory saved by `state_dict` (of an instance with the same arguments)."""
        ...


def check_at_least(name: str, value: float, minimum: float) -> None:
    """Raise ``ValueError("`window` must be >= 2, got 1")`` unless ``value >= minimum``."""
    if not value >= minimum:  # also catches NaN
        raise ValueError(f"`{name}` must be >= {minimum}, got {value}")


def check_fraction(name: str, value: float) -> None:
    """Raise ``ValueError("`fraction` must be in (0, 1), got 2")`` unless ``0 < value < 1``."""
    if not 0 < value < 1:
        raise ValueError(f"`{name}` must be in (0, 1), got {value}")
