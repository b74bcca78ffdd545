"""The one episode rule (`stabilizer.core.episode`): when a later finding updates an episode, what
the episode is then, and how the reports group episodes into incidents."""

from __future__ import annotations

import pytest

from stabilizer.core.episode import Episodes, continues, fold_updates, group_incidents
from stabilizer.core.records import Finding, Severity

ERROR, CRITICAL, INFO = Severity.ERROR, Severity.CRITICAL, Severity.INFO
GROUPS = ("embed", "block_00", "block_01", "head")


def _nan_first(step: int = 5) -> Finding:
    """`NonFinite`'s first finding: every depth group whose gradient went non-finite."""
    return Finding(
        "nonfinite_loss", step, step, ERROR, "loss is nan", {"loss": float("nan")}, GROUPS,
        ("skip_step", "upcast_to_fp32", "rollback"),
    )  # fmt: skip


def _nan_persists(step: int = 5, end: int = 14) -> Finding:
    """Its "persists": no location, no more skipping."""
    return Finding(
        "nonfinite_loss", step, end, CRITICAL, "persists", {"steps": 10.0}, (),
        ("rollback", "upcast_to_fp32"),
    )  # fmt: skip


def test_a_nan_that_persists_is_one_episode_at_its_worst() -> None:
    """#34: the episode key held the location, and the first finding names every group while
    its update names none: the console counted the NaN twice."""
    episodes = Episodes()
    episodes.add(_nan_first())
    episode = episodes.add(_nan_persists())
    assert (episode.index, episode.updates, episode.was) == (0, 1, ERROR)
    now = episode.finding
    assert (now.severity, now.step, now.end_step, now.seen) == (CRITICAL, 5, 14, "persists")
    assert now.location == GROUPS  # every place either named
    assert now.remedies == ("rollback", "upcast_to_fp32")  # the update's: no more skipping
    closed = Finding("nonfinite_loss", 5, 14, INFO, "finite again")
    assert episodes.add(closed).finding.severity == CRITICAL  # the worst it reached
    assert len(episodes.all) == 1


@pytest.mark.parametrize(
    ("later", "same"),
    [
        (Finding("nonfinite_loss", 5, 9, CRITICAL, "x", location=GROUPS), True),
        (Finding("nonfinite_loss", 5, 9, CRITICAL, "x", location=("block_01",)), False),
        (Finding("nonfinite_loss", 6, 9, CRITICAL, "x"), False),
        (Finding("nonfinite_grad", 5, 9, CRITICAL, "x"), False),
        (Finding("root_cause", 5, 5, ERROR, "x"), False),
    ],
    ids=["same-places", "other-places", "other-start", "other-kind", "live-only"],
)
def test_what_continues_an_episode(later: Finding, same: bool) -> None:
    assert continues(later, _nan_first()) is same


def test_live_only_findings_are_never_updates() -> None:
    """Two ``config_risk`` at step 0 are two risks, however alike."""
    risks = [Finding("config_risk", 0, None, INFO, text) for text in ("no clipping", "post-LN")]
    assert fold_updates(risks) == risks


def test_two_bands_at_one_step_are_two_episodes_and_one_incident() -> None:
    """Both sides of the stack starve from one step: the console and the table show two
    episodes; the report's timeline one entry."""
    inputs = Finding("depth_imbalance", 27, 76, Severity.WARNING, "in", location=GROUPS[:2])
    outputs = Finding("depth_imbalance", 27, 80, Severity.WARNING, "out", location=GROUPS[3:])
    assert fold_updates([inputs, outputs]) == [inputs, outputs]
    assert group_incidents([(1, inputs), (1, outputs)]) == [(1, [inputs, outputs])]


def test_incidents_group_a_family_whose_steps_touch_within_a_segment() -> None:
    spike = Finding("loss_spike", 100, 104, Severity.WARNING, "spike")
    grad = Finding("grad_spike", 105, 105, Severity.WARNING, "grad")  # touches the spike's end
    later = Finding("grad_spike", 200, 200, Severity.WARNING, "later")
    resumed = Finding("grad_spike", 105, 105, Severity.WARNING, "resumed")
    found = group_incidents([(1, later), (1, grad), (1, spike), (2, resumed)])
    assert found == [(1, [spike, grad]), (1, [later]), (2, [resumed])]
