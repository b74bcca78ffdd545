"""What TensorBoard shows of an episode, read back with TensorBoard's own reader (#33).

A real Trainer at Lightning's default kind of cadence (every 25 steps here) and a loss spike
between two logged steps: the loss chart has the steps the spike started and peaked at, not
only the step it was reported; the skipped/clipped chart plots counts, which TensorBoard's
"ignore outliers" cannot flatten; the Text tab does not count the set-up note as an episode.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import (
    SCALARS,
    TENSORS,
    EventAccumulator,
)
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from stabilizer.callbacks import StabilityMonitor
from stabilizer.outputs.tensorboard import FINDINGS_TAG

from test_tb_layout import VOCAB, Stack  # isort: skip

pytestmark = pytest.mark.usefixtures("one_thread")


class Spiked(Stack):
    """Its loss ten times as large at steps 40-41 (a bad batch), NaN at step 70."""

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_step in (40, 41):
            loss = loss * 10.0
        return loss * float("nan") if self.global_step == 70 else loss


def test_a_spike_between_two_logged_steps_is_in_the_loss_chart(tmp_path: Path) -> None:
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=90, log_every_n_steps=25, enable_checkpointing=False,
        logger=TensorBoardLogger(str(tmp_path), name="run", version=0),
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[StabilityMonitor(jsonl=False)],
    )  # fmt: skip
    data = TensorDataset(torch.randint(0, VOCAB, (90 * 4, 9)))
    trainer.fit(Spiked(2), DataLoader(data, batch_size=4))
    monitor = next(c for c in trainer.callbacks if isinstance(c, StabilityMonitor))
    [spike] = [f for f in monitor.findings if f.kind == "loss_spike"]
    assert spike.step == 40  # reported when the loss came back, after its peak

    events = EventAccumulator(str(tmp_path / "run" / "version_0"), {SCALARS: 0, TENSORS: 0})
    events.Reload()
    loss_steps = [event.step for event in events.Scalars("stability/loss")]
    assert loss_steps == sorted(loss_steps)  # in order: TensorBoard drops what a step undoes
    assert {24, 49, 74} <= set(loss_steps)  # the cadence
    peak = int(spike.evidence["peak_step"])
    assert {40, peak} <= set(loss_steps), loss_steps  # the spike's start and peak
    # Steps skipped so far: a count (70 skipped by the guard) that steps from 0 to 1.
    skipped = {e.step: e.value for e in events.Scalars("stability/so_far/skipped")}
    assert skipped[49] == 0.0 and skipped[74] == 1.0
    # The Text tab: one episode per line under the heading; the set-up note (no clipping)
    # apart, not counted.
    [text] = events.Tensors(FINDINGS_TAG)[-1:]
    markdown = text.tensor_proto.string_val[0].decode()
    heading = markdown.splitlines()[0]
    assert heading.startswith("**4 episodes as of step 90**: 2 error, 2 warning"), markdown
    assert "**1 set-up note**" in markdown and "no gradient clipping" in markdown
