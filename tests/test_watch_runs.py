"""`stabilizer watch` of a folder never lets go of a live run (#41).

A real Lightning `Trainer` with the `StabilityMonitor` trains in a subprocess under ``runs/``:
Lightning's TensorBoard logger writes its event file first, the monitor opens
``stability.jsonl`` beside it a moment later (here: once the watch follows the event file), and
the loss goes NaN later. The watch, started
before ``runs/`` exists, follows the event file, switches to the richer JSONL (no rotation: the
event file's last record may be half-written), and sees the NaN. A run that starts later in a
new subfolder with a plain console log is followed too. Each phase waits for the watcher's line
about it, never for a time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_watch import _WAIT, _WATCH, _healthy, _Watcher, _write

from stabilizer.replay.sources import RunFinder

_TRAIN = """
import sys, time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from stabilizer import StabilityMonitor

root, go, nan_at = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
VOCAB = 32


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        logits = self.head(torch.tanh(self.emb(ids[:, :-1])))
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        if self.global_step >= nan_at:
            loss = loss * float("nan")  # the fault, 'at 3 a.m.'
        time.sleep(0.02)  # a step that takes a while: the watch follows a live run
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class EventFileFirst(pl.Callback):
    # At fit start the TensorBoard logger's event file comes first, the monitor's JSONL (its
    # on_fit_start, after this one's) second: wait between the two until the watch follows
    # the event file (the test says go).
    def on_fit_start(self, trainer, pl_module):
        trainer.logger.experiment.add_scalar("started", 1.0, 0)
        trainer.logger.experiment.flush()
        while not go.exists():
            time.sleep(0.05)


torch.manual_seed(0)
torch.set_num_threads(1)
data = DataLoader(TensorDataset(torch.randint(0, VOCAB, (400, 9))), batch_size=4)
trainer = pl.Trainer(
    accelerator="cpu", max_steps=nan_at + 30, logger=TensorBoardLogger(str(root), name="exp0"),
    callbacks=[EventFileFirst(), StabilityMonitor(policy="observe", cost_budget=None)],
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    log_every_n_steps=1,
)
trainer.fit(Tiny(), data)
"""


def test_watch_switches_from_the_event_file_to_the_jsonl_and_sees_the_nan(
    tmp_path: Path, watcher: list[_Watcher]
) -> None:
    """#41: the JSONL that appeared beside the event file was taken for a rotation of it; the
    watch printed the report of a partial event file and exited 0 a second into the run, and
    the NaN was never seen."""
    runs, go = tmp_path / "runs", tmp_path / "go"
    w = _Watcher(str(runs), "--exit-on", "error")
    watcher.append(w)
    w.wait_for("not there yet", "err")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    train = subprocess.Popen(
        [sys.executable, "-c", _TRAIN, str(runs), str(go), "25"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        w.wait_for("events.out.tfevents", "err")  # following the event file
        go.touch()
        w.wait_for("stability.jsonl (a richer log of the run)", "err")
        assert w.proc.wait(_WAIT) == 1, (w.out, w.err)  # --exit-on error: the NaN stopped it
    finally:
        train.kill()
        train.wait()
    assert any("step 25 error nonfinite_loss" in line for line in w.out), (w.out, w.err)
    assert not any("rotated" in line for line in w.err), w.err
    assert not any("Traceback" in line for line in w.err), w.err


def test_watch_of_a_folder_follows_a_run_created_later_in_a_subfolder(
    tmp_path: Path, watcher: list[_Watcher]
) -> None:
    """#41: ``watch runs/`` with a finished run in it waited for ever when a new experiment's
    folder ``runs/exp1/`` appeared with a plain ``train.log``, and missed its NaN."""
    old = tmp_path / "runs" / "exp0"
    old.mkdir(parents=True)
    _write(old / "train.log", _healthy(1, 40), "w")  # a finished run
    w = _Watcher(str(tmp_path / "runs"))
    watcher.append(w)
    w.wait_for("following", "err")
    new = tmp_path / "runs" / "exp1"
    new.mkdir()
    _write(new / "train.log", _healthy(1, 30), "w")
    w.wait_for("exp1/train.log (a new run)", "err")
    _write(new / "train.log", ["steps: 31 loss: nan lr: [0.0001]", *_healthy(32, 35)])
    w.wait_for("step 31 error nonfinite_loss")
    status = w.interrupt()
    text = "\n".join(w.out)
    assert status == 1, text
    assert f"diagnosis of {old / 'train.log'}" in text  # each run its own report
    assert f"diagnosis of {new / 'train.log'}" in text
    assert "restart" not in text  # a new run is no restart of the last


def test_two_growing_runs_do_not_take_the_watch_back_and_forth(tmp_path: Path) -> None:
    """The newest run is chosen once; a log that grows elsewhere is no reason to move, a log
    that appears elsewhere is a new run, a richer log of the run is a switch of its source; a
    console log with no training record in it is no run's log."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    log = "".join(line + "\n" for line in _healthy(1, 3))
    (a / "train.log").write_text(log)
    (b / "train.log").write_text(log)
    os.utime(a / "train.log", (1, 1))
    (tmp_path / "wandb").mkdir()  # a tracker's own log, the newest file of all: no records
    (tmp_path / "wandb" / "debug.log").write_text("2024-05-01 INFO Starting the internal service\n")
    finder = RunFinder(tmp_path)
    first = finder.look()
    assert first is not None and first.log.path == b / "train.log"  # the newest run
    (a / "train.log").write_text(log * 2)  # the other run grows: no switch
    again = finder.look()
    assert again is not None and again.log.path == b / "train.log" and not again.new_run
    (b / "events.out.tfevents.1.host").write_bytes(b"")  # a richer log of the same run
    richer = finder.look()
    assert richer is not None and richer.log.format == "tensorboard" and not richer.new_run
    (b / "events.out.tfevents.1.host.stabilizer-replay").write_bytes(b"")  # a replay: no log
    (b / "events.out.tfevents.2.host").write_bytes(b"")  # a new session's event file
    again = finder.look()
    assert again is not None and again.new_run and again.log.path.name.endswith(".2.host")
    (tmp_path / "c" / "deep" / "er").mkdir(parents=True)
    (tmp_path / "c" / "deep" / "er" / "stability.jsonl").write_text("")
    new = finder.look()
    assert new is not None and new.new_run and new.log.run == tmp_path / "c" / "deep" / "er"


def test_watch_refuses_a_markdown_file_and_a_device_as_diagnose_does() -> None:
    """#41: `watch` read a markdown file as a log and waited for ever on /dev/zero, where
    `diagnose` refuses both with one line."""
    readme = str(Path(__file__).parents[1] / "README.md")
    for path, why in ((readme, "a markdown document"), ("/dev/zero", "a device")):
        done = subprocess.run(
            [*_WATCH, path], capture_output=True, text=True, timeout=_WAIT, stdin=subprocess.DEVNULL
        )
        assert done.returncode == 2 and why in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_an_empty_pipe_is_called_standard_input_by_watch_and_diagnose() -> None:
    """#41: an empty standard input was called ``-`` (``-: empty file``) by diagnose, and "no
    training steps found" by watch."""
    for command in ("watch", "diagnose"):
        done = subprocess.run(
            [*_WATCH[:-1], command, "-"], input="", capture_output=True, text=True, timeout=_WAIT
        )
        assert done.returncode == 2
        assert done.stderr == (
            f"stabilizer {command}: error: standard input: empty (nothing was written to it)\n"
        )
