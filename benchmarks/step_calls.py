"""How much of the project one optimizer step walks through: files entered, cross-file calls.

    python benchmarks/step_calls.py [--steps 8] [--nan-at 6] [--detail]

A `sys.setprofile` hook is on around exactly one training step — a healthy one (step
``--nan-at - 1``) and the first non-finite one (step ``--nan-at``: the guard skips it and the
root cause replays it) — under Lightning's ``Trainer`` (``StabilityMonitor``, from the batch's
start to its end, the monitor's hooks and the guard inside ``optimizer.step`` included) and
under a plain loop (``Stabilizer``: the ``with stab.step():`` block). It counts:

- files: the project's files (``stabilizer/`` and ``callbacks/``, installed as
  ``stabilizer.callbacks``; not the reference GPT of ``stabilizer/demo/``, the user's model
  here) in which a Python function ran during the step;
- cross-file calls: calls into a project function from a frame in another file: from another
  project module, or from outside (Lightning calling a hook, torch calling the guard's
  ``step``, a ``with`` statement entering a context manager); the column "from outside" says
  how many of them came from outside. A call within one module does not count, nor does a
  generator resumed (the profile says "call" at each resumption: no new call).

A step that a newcomer can read in one module enters few files; calls that go back and forth
between modules show as cross-file calls. The model is the reference GPT (2 blocks, width 32),
policy ``protect`` (the default), the JSONL on, no other logger, on the CPU. The figures are
recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

import stabilizer
from stabilizer.callbacks import StabilityMonitor
from stabilizer.demo.model import GPT, GPTConfig
from stabilizer.hosts.loop import Stabilizer

_ROOTS = tuple(
    str(Path(p).resolve())
    for p in (Path(stabilizer.__file__).parent, Path(stabilizer.callbacks.__file__).parent)
)
_OWN = str(Path(__file__).resolve())


_RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
_MODEL = str(Path(stabilizer.__file__).parent / "demo")  # the user's model here, not the step


def _project(filename: str) -> bool:
    return filename.startswith(_ROOTS) and not filename.startswith(_MODEL)


@dataclass
class Walk:
    """What one step entered."""

    files: Counter[str] = field(default_factory=Counter)  # file -> calls into it from elsewhere
    cross: int = 0  # calls into a project file from another file (project or outside)
    entries: int = 0  # of those, calls from outside the project (the host, torch, contextlib)
    calls: int = 0  # every project call, within a file or not
    pairs: Counter[tuple[str, str]] = field(default_factory=Counter)  # (caller, callee) files
    _resumable: dict[int, FrameType] = field(default_factory=dict)  # generator frames entered

    def _resumed(self, frame: FrameType) -> bool:
        """Whether `frame` is a generator's (or a context manager's) going on: the profile
        says "call" at each resumption, which is no new call."""
        if not frame.f_code.co_flags & _RESUMABLE:
            return False
        if id(frame) in self._resumable:
            return True
        self._resumable[id(frame)] = frame  # (held: its id is not reused while the walk lasts)
        return False

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee = frame.f_code.co_filename
        if not _project(callee) or self._resumed(frame):
            return
        self.calls += 1
        caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
        self.files[callee] += 0
        if caller == callee:
            return
        self.files[callee] += 1
        self.pairs[(caller if _project(caller) else "(outside)", callee)] += 1
        self.cross += 1
        self.entries += not _project(caller)


@contextmanager
def profiled(walk: Walk) -> Iterator[None]:
    sys.setprofile(walk.hook)
    try:
        yield
    finally:
        sys.setprofile(None)


class Windows(Dataset[tuple[Tensor, Tensor]]):
    """Deterministic random token windows."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 256, (n, 8, 32), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.x[i]


def model(nan_at: int, step: list[int]) -> GPT:
    """A small GPT whose block 1 MLP outputs NaN at step `nan_at`."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32))

    def fault(module: nn.Module, args: Any, out: Tensor) -> Tensor | None:
        return out * float("nan") if module.training and step[0] == nan_at else None

    gpt.get_submodule("blocks.1.mlp").register_forward_hook(fault)
    return gpt


class Lit(pl.LightningModule):
    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.gpt = gpt

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss: Tensor | None = self.gpt(*batch)[1]
        assert loss is not None
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Around(pl.Callback):
    """Starts the profile at a batch's start (listed first) or stops it at its end (last)."""

    def __init__(self, walks: dict[int, Walk], step: list[int], start: bool) -> None:
        self.walks, self.step, self.start = walks, step, start

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.step[0] = trainer.global_step
        if self.start and trainer.global_step in self.walks:
            sys.setprofile(self.walks[trainer.global_step].hook)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if not self.start:
            sys.setprofile(None)


def lightning(steps: int, nan_at: int, root: Path) -> dict[int, Walk]:
    walks = {nan_at - 1: Walk(), nan_at: Walk()}
    step = [0]
    gpt = model(nan_at, step)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
        callbacks=[Around(walks, step, True), StabilityMonitor(), Around(walks, step, False)],
    )  # fmt: skip
    trainer.fit(Lit(gpt), DataLoader(Windows(steps), batch_size=None))
    return walks


def loop(steps: int, nan_at: int, root: Path) -> dict[int, Walk]:
    walks = {nan_at - 1: Walk(), nan_at: Walk()}
    step = [0]
    gpt = model(nan_at, step)
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-3)
    data = Windows(steps)
    with Stabilizer(gpt, optimizer, log_dir=root) as stab:
        for i in range(steps):
            step[0] = i
            with profiled(walks[i]) if i in walks else _nothing(), stab.step():
                _, loss = gpt(*data[i])
                assert loss is not None
                stab.backward(loss)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    return walks


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--nan-at", type=int, default=6)
    parser.add_argument("--root", type=Path, default=Path("runs/step_calls"))
    parser.add_argument("--detail", action="store_true", help="list the files of each step")
    args = parser.parse_args()
    logging.getLogger("stabilizer").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for host, run in (("lightning", lightning), ("loop", loop)):
            walks = run(args.steps, args.nan_at, args.root / host)
            for name, walk in zip(("healthy", "NaN"), walks.values(), strict=True):
                rows.append((host, name, walk))
    print(f"{'host':<10} {'step':<8} {'files':>5} {'cross-file calls':>16} {'from outside':>12} "
          f"{'calls':>6}")  # fmt: skip
    for host, name, walk in rows:
        print(
            f"{host:<10} {name:<8} {len(walk.files):>5} {walk.cross:>16} {walk.entries:>12} "
            f"{walk.calls:>6}"
        )
    if args.detail:
        for host, name, walk in rows:
            print(f"\n{host}, {name} step:")
            for path, n in sorted(walk.files.items(), key=lambda kv: -kv[1]):
                print(f"  {n:>4}  {_short(path)}")
            print("  calls between files (caller -> callee):")
            for (caller, callee), n in sorted(walk.pairs.items(), key=lambda kv: -kv[1]):
                print(f"  {n:>4}  {_short(caller)} -> {_short(callee)}")


def _short(path: str) -> str:
    for root in _ROOTS:
        if path.startswith(root):
            return Path(root).name + path[len(root) :]
    return path


if __name__ == "__main__":
    main()
