"""`FabricSetup`: what a ``lightning.fabric.Fabric`` tells the Stabilizer of its loop.

``Stabilizer(model, optimizer, fabric=fabric)`` takes Fabric's backward (it scales the loss under
fp16), its precision plugin's name and grad scaler, its loggers (and the ``SummaryWriter`` of a
TensorBoard one) and their log dir. Read by name: ``stabilizer`` never imports Lightning.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["FabricSetup"]


@dataclass(frozen=True)
class FabricSetup:
    """A Fabric's settings, as the Stabilizer uses them.

    Args:
        precision: Its precision (Lightning's names).
        scaler: Its fp16 grad scaler, or None.
        backward: ``fabric.backward``.
        loggers: ``fabric.loggers``.
        tensorboard: The ``SummaryWriter`` of a TensorBoard logger among them, or None.
        log_dir: The first logger's log dir, or None.
        strategy: Its strategy's class name.
    """

    precision: str
    scaler: Any
    backward: Callable[..., Any]
    loggers: list[Any]
    tensorboard: Any
    log_dir: Path | None
    strategy: str

    @classmethod
    def of(cls, fabric: Any) -> FabricSetup:
        plugin = fabric.strategy.precision
        loggers = list(fabric.loggers)
        log_dir = getattr(loggers[0], "log_dir", None) if loggers else None
        writers = [lg.experiment for lg in loggers if "TensorBoard" in type(lg).__name__]
        return cls(
            str(plugin.precision), getattr(plugin, "scaler", None), fabric.backward, loggers,
            writers[0] if writers else None, Path(log_dir) if log_dir else None,
            type(fabric.strategy).__name__,
        )  # fmt: skip
