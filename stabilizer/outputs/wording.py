"""How a finding reads, the same on the console, in TensorBoard and in the reports.

An output that lists a finding's remedies shows what was seen (`Finding.seen`) without its
advice, which the remedies say again, so that one remedy is said once; a finding without
remedies shows its whole message. Which remedies fit the run is `stabilizer.core.advice`.
"""

from __future__ import annotations

from stabilizer.core.records import Finding

__all__ = ["counted", "observation"]


def observation(finding: Finding) -> str:
    """What was seen, when the remedies carry the advice; else the whole message.

    ``"loss spiked from 2.5 to 7.5 (3.0x) at step 121, back after 8 steps"`` for the message
    ``"...back after 8 steps: clip gradients (norm 1.0)"``.
    """
    return finding.seen if finding.remedies else finding.message


def counted(count: int, noun: str) -> str:
    """``"1 record"``, ``"2 records"``: a count and its noun, singular for one."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
