"""Every finding shows in TensorBoard as a user serves it, once per episode.

TensorBoard's default loader (the Rust data server) keeps one text per tag and step, so several
tables written at one step showed one of them. The monitor writes one table, rewritten whole at
`FINDINGS_STEP` as episodes open, grow and end; the Text tab must list every episode once. Read
back from a real ``tensorboard --logdir`` (default flags, and the Python loader for comparison)
over real Trainer runs: the nan scenario (a NaN loss and an fp16 overflow cascade at step 60, the
cascade reported again when it ends), post-ln-deep (a depth imbalance reported at its patience
and again at the end) and ``diagnose --tensorboard`` of the nan run's log.
"""

from __future__ import annotations

import re
import shutil
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from test_tensorboard import _get_json, _poll, served

from stabilizer.cli import main
from stabilizer.core.records import Finding, Severity
from stabilizer.outputs.findings_table import (
    FINDINGS_STEP,
    FINDINGS_TAG,
    FindingsTable,
    is_setup,
    table_rows,
)
from stabilizer.outputs.tensorboard import findings_text

pytestmark = pytest.mark.xdist_group("scenarios")  # one worker trains each scenario once

ERROR, WARNING, INFO = Severity.ERROR, Severity.WARNING, Severity.INFO
BAND = tuple(f"block_{i:02d}" for i in range(9))


def _f(kind: str, step: int, end: int | None, severity: Severity, message: str = "m",
       location: tuple[str, ...] = ()) -> Finding:  # fmt: skip
    return Finding(kind, step, end, severity, message, location=location)


@pytest.mark.parametrize(
    ("batches", "rows"),
    [
        (  # an fp16 overflow cascade, then its end: one row, the worst severity, the last news
            [
                [_f("fp16_overflow", 60, 62, ERROR, "cascade")],
                [_f("fp16_overflow", 60, 63, INFO, "over")],
            ],
            [_f("fp16_overflow", 60, 63, ERROR, "over")],
        ),
        (  # a depth imbalance at its patience, then at the end of the run
            [
                [_f("depth_imbalance", 27, 76, WARNING, "a", BAND)],
                [_f("depth_imbalance", 27, 199, WARNING, "b", BAND)],
            ],
            [_f("depth_imbalance", 27, 199, WARNING, "b", BAND)],
        ),
        (  # a NaN that persists: the first report names the place, the later one none
            [
                [_f("nonfinite_loss", 60, 60, ERROR, "nan", ("block_01",))],
                [_f("nonfinite_loss", 60, 90, Severity.CRITICAL, "persists")],
            ],
            [_f("nonfinite_loss", 60, 90, Severity.CRITICAL, "persists", ("block_01",))],
        ),
        (  # both sides of the stack starve from one step: two episodes
            [
                [_f("depth_imbalance", 27, 76, WARNING, "in", BAND[:2])],
                [_f("depth_imbalance", 27, 80, WARNING, "out", ("block_11",))],
            ],
            [
                _f("depth_imbalance", 27, 76, WARNING, "in", BAND[:2]),
                _f("depth_imbalance", 27, 80, WARNING, "out", ("block_11",)),
            ],
        ),
        (  # set-up checks have no last step: each its own, even at one step
            [
                [_f("config_risk", 0, None, INFO, "no clipping")],
                [_f("config_risk", 0, None, WARNING, "post-LN")],
            ],
            [
                _f("config_risk", 0, None, WARNING, "post-LN"),
                _f("config_risk", 0, None, INFO, "no clipping"),
            ],
        ),
        (  # findings of one batch are each their own
            [[_f("remedy_applied", 5, 5, INFO, "clip"), _f("remedy_applied", 5, 5, INFO, "lr")]],
            [_f("remedy_applied", 5, 5, INFO, "clip"), _f("remedy_applied", 5, 5, INFO, "lr")],
        ),
        (  # one kind again later: a new episode; rows by step, then the worst first
            [
                [_f("loss_spike", 50, 55, WARNING)],
                [_f("loss_spike", 10, 12, WARNING), _f("grad_spike", 10, 10, ERROR)],
            ],
            [
                _f("grad_spike", 10, 10, ERROR),
                _f("loss_spike", 10, 12, WARNING),
                _f("loss_spike", 50, 55, WARNING),
            ],
        ),
    ],
    ids=["fp16-over", "depth-update", "nan-persists", "two-sides", "set-up", "one-batch", "later"],
)
def test_episodes_merge_the_versions_of_one_episode(
    batches: list[list[Finding]], rows: list[Finding]
) -> None:
    table = FindingsTable()
    assert all(table.add(batch) for batch in batches)  # every batch changed the table
    assert table.rows == rows
    assert not table.add(batches[-1][-1:])  # the same news again: nothing to rewrite
    assert not table.add([])


def test_the_table_counts_episodes_and_shortens_a_long_band() -> None:
    rows = [_f("config_risk", 0, None, INFO), _f("depth_imbalance", 27, 199, WARNING, "x", BAND)]
    markdown = findings_text(rows, as_of=200).value[0].tensor.string_val[0].decode()
    # #33: the set-up note is no episode: listed apart, not counted
    assert markdown.startswith("**1 episode as of step 200**: 1 warning (one line per")
    setup = "\n\n**1 set-up note** (the checks at the first batch)\n\n- **step 0 info config_risk"
    assert setup in markdown
    assert "- **steps 27–199 warning depth_imbalance** [`block_00`, … 7 more …, `block_08`]: x" in (
        markdown
    )
    assert findings_text([], as_of=7).value[0].tensor.string_val[0] == b"No findings as of step 7."


_ITEM = re.compile(r"<li><strong>steps? (\d+)(?:–\d+)? (\w+) (\w+)</strong>")


def _rows(html: str) -> list[tuple[str, int]]:
    """(kind, first step) of each line of a served findings table, as TensorBoard renders it."""
    return [(kind, int(first)) for first, _, kind in _ITEM.findall(html)]


def _texts(opener: Any, base: str, proc: Any, run: str, ready: Callable[[Any], bool]) -> Any:
    query = urllib.parse.urlencode({"run": run, "tag": FINDINGS_TAG})
    url = f"{base}/data/plugin/text/text?{query}"
    return _poll(opener, url, proc, ready, f"the findings of {run}")


def _expected(findings: Sequence[Finding]) -> list[tuple[str, int]]:
    """The rows as listed: the episodes, then the set-up notes."""
    rows = table_rows(findings)
    ordered = [f for f in rows if not is_setup(f)] + [f for f in rows if is_setup(f)]
    return [(f.kind, f.step) for f in ordered]


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags", [(), ("--load_fast", "false")], ids=["default-loader", "python-loader"]
)
def test_every_finding_of_real_runs_is_one_row_of_one_entry(
    tmp_path: Path, scenario_run: Callable[[str], Any], flags: tuple[str, ...]
) -> None:
    nan, deep = scenario_run("nan"), scenario_run("post-ln-deep")
    shutil.copytree(nan.log_dir, tmp_path / "nan")
    shutil.copytree(deep.log_dir, tmp_path / "post-ln-deep")
    jsonl, replayed = nan.log_dir / "stability.jsonl", tmp_path / "replayed"
    replay = CliRunner().invoke(main, ["diagnose", str(jsonl), "--tensorboard", str(replayed)])
    assert replay.exit_code == 1, replay.output  # errors found
    # At one step, several findings; an episode reported twice (the test's premise).
    at_60 = [f.kind for f in nan.monitor.findings if f.step == 60]
    assert {"nonfinite_loss", "fp16_overflow"} <= set(at_60) and len(at_60) >= 3
    assert [f.kind for f in deep.monitor.findings].count("depth_imbalance") >= 2

    expected = {  # run: (its rows, the step its table is as of); the replay: (None, None)
        "nan": (_expected(nan.monitor.findings), nan.run.trainer.global_step),
        "post-ln-deep": (_expected(deep.monitor.findings), deep.run.trainer.global_step),
        "replayed": (None, None),
    }
    with served(tmp_path, *flags) as (opener, base, proc):
        for run, (rows, as_of) in expected.items():
            heading = f"as of step {as_of}" if as_of is not None else "episodes"
            texts = _texts(opener, base, proc, run, lambda t, h=heading: h in str(t))
            assert all(t["step"] == FINDINGS_STEP for t in texts)
            if not flags:  # the default loader keeps one entry: the newest table
                assert len(texts) == 1
            (newest,) = [t for t in texts if heading in t["text"]]
            served_rows = _rows(newest["text"])
            assert len(set(served_rows)) == len(served_rows)  # each episode once
            if rows is not None:
                assert served_rows == rows
            else:  # what diagnose finds again: the NaN and the cascade, once each
                assert {"nonfinite_loss", "fp16_overflow"} <= {kind for kind, _ in served_rows}
        assert FINDINGS_TAG in _get_json(opener, base + "/data/plugin/text/tags")["nan"]


@pytest.mark.slow
def test_a_run_resumed_into_its_tensorboard_run_keeps_its_earlier_findings(
    tmp_path: Path, one_thread: None
) -> None:
    # The resumed run writes a new event file into the same run; its table, at the same step,
    # replaces the first run's, so it must list the first run's episodes too.
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import TensorBoardLogger
    from test_tb_layout import VOCAB, Stack
    from torch.utils.data import DataLoader, TensorDataset

    from stabilizer.callbacks import StabilityMonitor

    def fit(steps: int, ckpt: str | None) -> None:
        torch.manual_seed(0)
        trainer = pl.Trainer(
            accelerator="cpu", max_steps=steps, log_every_n_steps=1, enable_progress_bar=False,
            logger=TensorBoardLogger(str(tmp_path), name="run", version=0),
            enable_model_summary=False, callbacks=[StabilityMonitor(jsonl=False),
            ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)],
        )  # fmt: skip
        data = TensorDataset(torch.randint(0, VOCAB, (12, 6)))
        trainer.fit(Stack(2), DataLoader(data, batch_size=4), ckpt_path=ckpt)

    fit(3, None)
    fit(6, str(tmp_path / "ckpt" / "last.ckpt"))
    with served(tmp_path) as (opener, base, proc):
        ready = lambda texts: "as of step 6" in str(texts)  # noqa: E731
        (text,) = _texts(opener, base, proc, "run/version_0", ready)
    assert _rows(text["text"]) == [("config_risk", 0)]  # no clipping: found by the first run
