"""The monitor under DDP: 2 CPU processes over gloo, a NaN on one rank skips the step on both.

    python examples/ddp.py --steps 20 --nan-at 10 [--accumulate 2] [--jsonl PATH]

The LM of ``examples/own_module.py``, trained with ``Trainer(strategy="ddp", devices=2)``. With
``--nan-at`` block 1 outputs NaN at that step on rank 1 only. The monitor reduces its numbers
across ranks before deciding, so both ranks skip that step together and the replicas stay
identical; rank 0 alone prints the findings (the root cause says which rank it came from). At
the end each rank prints its step count, skipped steps and a checksum of its weights: the
checksums match.
"""

from __future__ import annotations

import argparse
import hashlib

import lightning.pytorch as pl
import torch
from own_module import VOCAB, MyLM  # this folder is on the path when run as a script
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from stabilizer import StabilityMonitor

RANK_WITH_NAN = 1


def inject_nan(model: MyLM, step: int) -> None:
    """Make block 1 output NaN at `step`, on rank `RANK_WITH_NAN` only (a fault on one GPU)."""

    def hook(module: nn.Module, args: object, out: Tensor) -> Tensor | None:
        if module.training and model.global_step == step and model.global_rank == RANK_WITH_NAN:
            return out * float("nan")
        return None

    model.blocks[1].register_forward_hook(hook)


def weights_digest(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


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
    # Lightning's subprocess launcher starts ranks 1.. from rank 0's process and never joins them:
    # wait, so that rank 0's exit status is every rank's.
    children = getattr(trainer.strategy.launcher, "procs", [])
    failed = {p.pid: code for p in children if (code := p.wait(timeout=120)) != 0}
    if failed:
        raise SystemExit(f"other ranks failed: exit status by pid {failed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--nan-at", type=int, default=-1, help="step whose block 1 goes NaN")
    parser.add_argument("--log-dir", default="runs/ddp")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--jsonl", default=None, help="the JSONL's path (default: in --log-dir)")
    args = parser.parse_args()
    torch.manual_seed(0)  # the same data on every rank; each reads its half of the batches
    data = TensorDataset(torch.randint(0, VOCAB, (args.steps * 16 * args.accumulate, 16)))
    model = MyLM()
    inject_nan(model, args.nan_at)
    monitor = StabilityMonitor(jsonl=args.jsonl or True)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=args.steps,
        default_root_dir=args.log_dir,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
        accumulate_grad_batches=args.accumulate,
        callbacks=[monitor],
    )
    trainer.fit(model, DataLoader(data, batch_size=8))
    # One write per line: both ranks print to the same terminal.
    line = f"rank {trainer.global_rank}: step {trainer.global_step}, "
    line += f"{monitor.skipped_steps} skipped, weights {weights_digest(model)}\n"
    print(line, end="", flush=True)
    shut_down(trainer)


if __name__ == "__main__":
    main()
