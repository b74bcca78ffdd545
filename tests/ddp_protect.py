"""Run by ``test_ddp.py`` (DDP needs a fresh process): 2 CPU ranks over gloo, NaN on rank 1 only.

Usage: ``python tests/ddp_protect.py OUT_DIR``. Each rank writes ``rank<N>.json``: its global
step, skip count, findings and a checksum of its weights; rank 0 also writes the JSONL log.

The script ends as a DDP program must: every rank destroys the process group before it exits, and
rank 0 (whose process launched the others) waits for them, so its exit status is every rank's.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from test_protect import Fault, tiny

from stabilizer.callbacks.demo.run import run_scenario
from stabilizer.callbacks.monitor import StabilityMonitor


class RankFault(Fault):
    """The fault of `Fault`, on rank 1 only."""

    def _active(self, trainer: pl.Trainer) -> bool:
        return trainer.global_rank == 1 and super()._active(trainer)


def main(out: Path) -> None:
    torch.set_num_threads(1)
    monitor = StabilityMonitor(jsonl=out / "stability.jsonl")
    run = run_scenario(
        tiny("32-true"),
        accelerator="cpu",
        callbacks=[RankFault("activation"), monitor],
        validate=False,
        # Each rank reads half the batches of an epoch: let epochs roll over up to max_steps.
        trainer_args={
            "devices": 2,
            "strategy": "ddp",
            "max_epochs": -1,
            "default_root_dir": str(out),
        },
    )
    digest = hashlib.sha256()
    finite = True
    for p in run.module.parameters():
        finite = finite and bool(torch.isfinite(p).all())
        digest.update(p.detach().cpu().numpy().tobytes())
    assert monitor.guard is not None
    report: dict[str, Any] = {
        "step": run.trainer.global_step,
        "skipped": monitor.guard.skipped,
        "findings": [f.kind for f in monitor.findings],
        "weights": digest.hexdigest(),
        "finite": finite,
    }
    rank = run.trainer.global_rank
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    shut_down(run.trainer)


def shut_down(trainer: pl.Trainer) -> None:
    """Destroy the process group on every rank; on rank 0, wait for the other ranks' processes.

    Lightning destroys the default process group at exit only for NCCL. A gloo group left to
    interpreter shutdown is torn down while its worker threads still hold work objects, which can
    abort the process after training finished correctly ("terminate called without an active
    exception", return code -6; pytorch/pytorch#179291). The barrier first: no rank leaves while
    another is still in a collective.
    """
    trainer.strategy.barrier()
    torch.distributed.destroy_process_group()
    # Lightning's subprocess launcher starts ranks 1.. from rank 0's process and never joins them.
    children = getattr(trainer.strategy.launcher, "procs", [])
    failed = {p.pid: code for p in children if (code := p.wait(timeout=120)) != 0}
    if failed:
        raise SystemExit(f"other ranks failed: exit status by pid {failed}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
