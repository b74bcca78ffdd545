"""`RunHeader` and `RunEnd`: the facts of a run that no step record carries, at its start and end.

The monitor writes it as the first line of ``stability.jsonl`` (and again when a resumed run
appends to the same file)::

    {"type":"run","precision":"32-true","accelerator":"cpu","devices":1,
     "strategy":"SingleDeviceStrategy","world_size":1,"policy":"protect",
     "groups":["embed","block_00","block_01","head"],"version":"0.1.0"}

The JSONL reader yields it as an item of the record stream, as TensorBoard's loader yields a
session start, and `diagnose` hands it to the reports: advice that only fits a low-precision run
(fp32 islands, bf16) is left out of the replayed report of an fp32 run, as it is on the live
console. Logs written before the header existed simply have none; nothing is then assumed.

`RunEnd` is the last line, ``{"type":"end",...}``: the last step, the steps skipped, the last
check of the weights and what the monitor cost (`Cost`), as the console's end line says them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["FULL_PRECISION", "REFERENCE_STEP_MS", "Cost", "RunEnd", "RunHeader", "low_precision"]

FULL_PRECISION = ("32", "64")
"""How Lightning's fp32/fp64 precisions start (``"32-true"``, ``"64-true"``, ``"32"``)."""


def low_precision(precision: str) -> bool | None:
    """Whether a Lightning precision computes in 16 bits; None when it is not known (``""``)."""
    if not precision:
        return None
    return not precision.startswith(FULL_PRECISION)


@dataclass(frozen=True)
class RunHeader:
    """What the run was: precision, hardware, strategy, policy, depth groups, monitor version.

    Args:
        precision: Lightning's precision (``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``, ...).
        accelerator: ``"cpu"``, ``"cuda"``, ``"mps"``, ...
        devices: Devices of this process's node that train.
        strategy: The strategy's class name (``"SingleDeviceStrategy"``, ``"DDPStrategy"``).
        world_size: Processes that train together.
        policy: The monitor's policy (``observe``, ``protect`` or ``auto``).
        groups: The depth groups, input side first.
        version: The version of stabilizer that wrote the log.
    """

    precision: str = ""
    accelerator: str = ""
    devices: int = 1
    strategy: str = ""
    world_size: int = 1
    policy: str = ""
    groups: tuple[str, ...] = ()
    version: str = ""

    @property
    def low_precision(self) -> bool | None:
        """Whether the run computes in 16 bits (None: the precision is not known)."""
        return low_precision(self.precision)

    def describe(self) -> str:
        """``"32-true on 1 cpu, SingleDeviceStrategy, policy protect, 4 depth groups"``."""
        parts = [f"{self.precision or 'precision unknown'} on {self.devices} {self.accelerator}"]
        if self.world_size > 1:
            parts[0] += f" (world size {self.world_size})"
        parts += [self.strategy] if self.strategy else []
        parts += [f"policy {self.policy}"] if self.policy else []
        plural = "s" if len(self.groups) != 1 else ""
        parts += [f"{len(self.groups)} depth group{plural}"] if self.groups else []
        parts += [f"stabilizer {self.version}"] if self.version else []
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """A strict-JSON-able dict with ``"type": "run"``."""
        return {
            "type": "run",
            "precision": self.precision,
            "accelerator": self.accelerator,
            "devices": self.devices,
            "strategy": self.strategy,
            "world_size": self.world_size,
            "policy": self.policy,
            "groups": list(self.groups),
            "version": self.version,
        }

    def to_json(self) -> str:
        """One line of strict JSON (see `to_dict`)."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunHeader:
        """The header of a `to_dict` dict; a missing key takes its default (a later version may
        add facts, an earlier one lacked some).

        Raises:
            ValueError: ``type`` is not ``"run"`` or a value has the wrong type.
        """
        if data.get("type") != "run":
            raise ValueError(f"`type` must be 'run', got {data.get('type')!r}")
        groups = data.get("groups", [])
        if not isinstance(groups, list) or not all(isinstance(g, str) for g in groups):
            raise ValueError(f"`groups` must be a list of names, got {groups!r}")
        return cls(
            precision=_text(data, "precision"),
            accelerator=_text(data, "accelerator"),
            devices=_count(data, "devices"),
            strategy=_text(data, "strategy"),
            world_size=_count(data, "world_size"),
            policy=_text(data, "policy"),
            groups=tuple(groups),
            version=_text(data, "version"),
        )


def _text(data: Mapping[str, Any], key: str) -> str:
    value = data.get(key, "")
    if not isinstance(value, str):
        raise ValueError(f"`{key}` must be a string, got {value!r}")
    return value


def _count(data: Mapping[str, Any], key: str) -> int:
    value = data.get(key, 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{key}` must be an integer >= 1, got {value!r}")
    return value


REFERENCE_STEP_MS = 300.0
"""The shortest step the budget judges the monitor against. The monitor's time per step is a
few milliseconds whatever the model's size (its per-tensor work is small beside the step's), so
on a tiny model's short step (the demo's 2-block model, ~40 ms on a CPU) it is a large share;
on the step of a model worth protecting (a GPU step of 0.3 s or more) it is a few percent."""


@dataclass(frozen=True)
class Cost:
    """What the monitor cost a run, measured: its host time in its hooks (the guard's judge
    inside the optimizer step, the activation probes inside the forward included) per
    optimizer step and against the wall time of the same steps. The budget judges it against a
    step of at least `REFERENCE_STEP_MS`: a tiny model's short step is said, not warned about.

    Args:
        steps: Optimizer steps in the measured window (the first batch, which pays one-time
            work such as the preflight, is left out).
        ms_per_step: The monitor's host time per step, in milliseconds.
        share: That time over the window's wall time (0.011 is 1.1%).
        wait_ms_per_step: Of it, the time spent waiting for the device (host reads).
        parts: Milliseconds per step by part (``measure``, ``guard``, ``report`` ...).
        budget: The share above which the monitor warns (None: no budget).
        warned: Whether the monitor warned, during the run, that it was over the budget.
    """

    steps: int
    ms_per_step: float
    share: float
    wait_ms_per_step: float = 0.0
    parts: tuple[tuple[str, float], ...] = ()
    budget: float | None = None
    warned: bool = False

    @property
    def step_ms(self) -> float:
        """The run's wall time per step, in milliseconds."""
        return self.ms_per_step / self.share if self.share > 0 else math.inf

    @property
    def judged_share(self) -> float:
        """The share the budget judges: of the run's step, or of a `REFERENCE_STEP_MS` step
        when the run's is shorter."""
        return self.ms_per_step / max(self.step_ms, REFERENCE_STEP_MS)

    @property
    def over_budget(self) -> bool:
        return self.budget is not None and self.judged_share > self.budget

    def describe(self) -> str:
        """``"monitor cost 0.9 ms/step (1.1%)"``, with the device wait when there was one; for
        a step shorter than `REFERENCE_STEP_MS`, what it would be of such a step, and why."""
        text = f"monitor cost {self.ms_per_step:.1f} ms/step ({self.share:.1%}"
        if self.step_ms < REFERENCE_STEP_MS:
            text += (
                f" of this run's {self.step_ms:.0f} ms step; the monitor's time per step hardly "
                "grows with the model, so a short step pays a large share: "
                f"{self.judged_share:.1%} of a {REFERENCE_STEP_MS:.0f} ms step"
            )
        if self.wait_ms_per_step >= 0.05:
            text += f"; {self.wait_ms_per_step:.1f} ms of it waiting for the device"
        return text + ")"

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "ms_per_step": round(self.ms_per_step, 4),
            "share": round(self.share, 6),
            "wait_ms_per_step": round(self.wait_ms_per_step, 4),
            "parts": {k: round(v, 4) for k, v in self.parts},
            "budget": self.budget,
            "warned": self.warned,
        }


@dataclass(frozen=True)
class RunEnd:
    """How the run ended, as the monitor checked it.

    Args:
        step: The last step.
        skipped: Steps whose update did not happen (guard or grad scaler); None: not counted.
        intact: The last check of the parameters, optimizer state and buffers (None: not
            checked, policy ``observe``).
        cost: What the monitor cost (None: too few steps to measure).
        stopped: Why the monitor stopped the run, as its stop line said ("": it did not).
    """

    step: int
    skipped: int | None = None
    intact: bool | None = None
    cost: Cost | None = None
    stopped: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A strict-JSON-able dict with ``"type": "end"``."""
        return {
            "type": "end",
            "step": self.step,
            "skipped": self.skipped,
            "intact": self.intact,
            "cost": self.cost.to_dict() if self.cost is not None else None,
            "stopped": self.stopped or None,
        }

    def to_json(self) -> str:
        """One line of strict JSON (see `to_dict`)."""
        return json.dumps(self.to_dict(), separators=(",", ":"))
