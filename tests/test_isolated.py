"""`Isolated`: a part's error is kept for its fallback, raised under ``strict``, and an interrupt
always goes through."""

from __future__ import annotations

import pytest

from stabilizer.core.isolated import Isolated


def test_the_error_is_kept_and_the_code_after_the_block_runs() -> None:
    with Isolated(strict=False) as part:
        raise RuntimeError("probe exploded")
    assert isinstance(part.error, RuntimeError) and str(part.error) == "probe exploded"
    with Isolated(strict=False) as fine:
        pass
    assert fine.error is None


def test_strict_raises_the_error_as_it_is() -> None:
    with pytest.raises(RuntimeError, match="probe exploded"), Isolated(strict=True):
        raise RuntimeError("probe exploded")


def test_an_interrupt_is_never_kept() -> None:
    with pytest.raises(KeyboardInterrupt), Isolated(strict=False):
        raise KeyboardInterrupt
