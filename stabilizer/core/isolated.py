"""`Isolated`: an error in one part of the monitor stops that part, never the user's training.

Each part of the live step that can fail on a model or setup nobody here saw (the probes, a
preflight check, the root-cause replay, an output, the reports) runs inside one:

    with Isolated(strict) as part:
        output.write(record)
    if part.error is not None:
        ...  # this part's own fallback: stop it, warn once, mark the step unmeasured

The error is kept, not raised, and the caller carries on without the part; under ``strict``
(``StabilityMonitor(strict=True)``: the tests, a developer after a bug) it is raised as it is.
Only an `Exception` is kept: a ``KeyboardInterrupt`` always goes through.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

__all__ = ["Isolated", "isolated"]


class Isolated:
    """Keeps the error of the ``with`` block in `error` instead of raising it, unless ``strict``.

    Args:
        strict: Raise the block's error as it is.
    """

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.error: Exception | None = None

    def __enter__(self) -> Isolated:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        if self.strict or not isinstance(error, Exception):
            return False
        self.error = error
        return True


def isolated(strict: bool, fn: Callable[..., object], *args: object) -> Exception | None:
    """``fn(*args)`` as one part: its error kept and returned (None: none), raised when
    `strict` (the `Isolated` block as one call, for a part that runs every step)."""
    with Isolated(strict) as part:
        fn(*args)
    return part.error
