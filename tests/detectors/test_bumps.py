"""`Bumps`: the largest rise of a run's last records, and its state across checkpoints."""

from __future__ import annotations

import random

from stabilizer.core.detectors._regime import Bumps


def test_the_largest_rise_of_the_last_records() -> None:
    rng = random.Random(0)
    rises = [rng.gauss(0.0, 1.0) for _ in range(500)]
    bumps = Bumps(50)
    for n, rise in enumerate(rises, 1):
        bumps.push(rise)
        assert bumps.largest() == max(0.0, *rises[max(0, n - 50) : n])
    assert Bumps(3).largest() == 0.0  # no record: no bump


def test_a_state_round_trips() -> None:
    bumps, again = Bumps(4), Bumps(4)
    for rise in (0.5, -1.0, 2.0, 0.1, 0.3):
        bumps.push(rise)
    again.load(bumps.state())
    for rise in (0.2, 0.1, 0.0, 0.0):
        assert again.largest() == bumps.largest()
        bumps.push(rise)
        again.push(rise)


def test_a_checkpoint_of_the_sliding_maxima_gives_the_same_largest_rises() -> None:
    """The earlier state (the monotonic queue's kept maxima, 1-based push counts): after 5
    pushes, size 3, it kept 2.0 (push 3) and 1.0 (push 5); then 0.5 and 0.4 come."""
    bumps = Bumps(3)
    bumps.load({"count": 5, "kept": [[3, 2.0], [5, 1.0]]})
    assert bumps.largest() == 2.0
    bumps.push(0.5)  # push 3 leaves the window
    assert bumps.largest() == 1.0
    bumps.push(0.4)
    bumps.push(0.3)  # push 5 leaves
    assert bumps.largest() == 0.5
