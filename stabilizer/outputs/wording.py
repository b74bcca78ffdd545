"""Words the outputs share, the same on the console, in TensorBoard and in the reports.

How a finding reads beside its remedies is the finding's own (`Finding.observation`: what was
seen, without the advice the remedies say again); which remedies fit the run is
`stabilizer.core.advice`.
"""

from __future__ import annotations

__all__ = ["counted"]


def counted(count: int, noun: str) -> str:
    """``"1 record"``, ``"2 records"``: a count and its noun, singular for one."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
