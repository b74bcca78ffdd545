"""`Host`: what only the training loop that runs the step can tell it.

The step — measure, decide inside ``optimizer.step``, check, account, report, resume — is the
same code under every host: Lightning's ``Trainer`` (`stabilizer.callbacks`), a plain PyTorch
loop or Fabric (`stabilizer.hosts.loop`), the Hugging Face ``Trainer`` (`stabilizer.hosts.hf`).
As Lightning's ``SpikeDetection`` asks its trainer for four things, the step asks its host only
for what the host alone knows: the run's facts, the step number, the model, the optimizers and
schedulers, the fp16 grad scaler, the clipping, whether its own code runs between the gradients
and the step, the last checkpoint and how to run a micro-batch again. Everything that can be
derived from those (the warmup, the loss scale, the reductions across ranks) the step derives,
once; when to stop is the step's answer (`stabilizer.step.monitor.RunMonitor.end`), which the
host acts on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from stabilizer.live.rng import RngState

__all__ = ["Host", "HostFacts", "MicroBatch"]


@dataclass(frozen=True)
class HostFacts:
    """The run's facts as its host tells them (they open ``stability.jsonl``).

    Args:
        precision: Lightning's precision names (``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``
            ...), which every host maps its own setting to.
        accelerator: ``"cpu"``, ``"cuda"`` ...
        devices: Devices of this process's run.
        strategy: The host's name for how it distributes (``"DDPStrategy"``, ``"loop"`` ...).
        world_size: Processes in the run.
        rank: This process's rank.
        log_dir: Where the run's logs go (``stability.jsonl`` beside them); None: the host's
            default root, a new ``stability_logs/version_N`` each run.
        root_dir: The default root for logs when there is no `log_dir`.
        sharded: Each rank holds a shard of every parameter (FSDP): gradient norms are partial.
        is_global_zero: Rank 0: the one that writes the outputs (from `rank`).
    """

    precision: str = "32-true"
    accelerator: str = "cpu"
    devices: int = 1
    strategy: str = ""
    world_size: int = 1
    rank: int = 0
    log_dir: Path | None = None
    root_dir: Path = field(default_factory=Path.cwd)
    sharded: bool = False
    is_global_zero: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "is_global_zero", self.rank == 0)


@dataclass
class MicroBatch:
    """One forward-and-backward of a step: its batch, random state and losses.

    Args:
        batch: What the host needs to run it again (Lightning: the batch and its index; a plain
            loop: the model's recorded calls), kept for a root-cause replay only.
        index: Its index (Lightning's ``batch_idx``).
        rng: The torch random state before it (dropout masks), or None.
        trainable: The optimizers' tensors and their ``requires_grad`` flags before it (code
            that toggles them inside a step, as Lightning's ``toggle_optimizer``, starts from
            them again on a replay), or None.
        losses: The losses it backpropagated (device tensors: read only on a failing step).
    """

    batch: Any
    index: int
    rng: RngState | None
    trainable: tuple[tuple[torch.Tensor, bool], ...] | None = None
    losses: list[torch.Tensor] = field(default_factory=list)


class Host(Protocol):
    """A training loop as the step sees it. Every member is read at the moment it is needed."""

    @property
    def facts(self) -> HostFacts:
        """The run's facts (precision, where it runs, ranks, where logs go)."""
        ...

    @property
    def step(self) -> int:
        """The global optimizer step now (the one about to run, inside a batch)."""
        ...

    @property
    def module(self) -> nn.Module:
        """The model: its parameter names name the depth groups; the probes hook it."""
        ...

    @property
    def data(self) -> object | None:
        """What the step draws its batches from (a dataloader), when the host knows: a new one
        is a new stage the run made itself (a loss that jumps there is a new level); None
        when it cannot tell."""
        ...

    @property
    def optimizers(self) -> Sequence[torch.optim.Optimizer]:
        """The optimizers that step, now (one replaced mid-run is guarded at its next step)."""
        ...

    @property
    def schedulers(self) -> Sequence[Any]:
        """The LR schedulers (a parameter group added by a remedy is added to theirs too)."""
        ...

    @property
    def scaler(self) -> Any:
        """The fp16 grad scaler that scales the loss before backward (a ``torch.amp.
        GradScaler``), or None."""
        ...

    @property
    def clip(self) -> float | None:
        """The gradient clipping threshold in force (None or 0: off)."""
        ...

    def set_clip(self, value: float) -> None:
        """Clip the gradient norm at `value` from the next step on (a remedy)."""
        ...

    @property
    def recount(self) -> bool:
        """Whether code the step cannot see may write the gradients between the moment they
        are ready and the optimizer step (then the guard counts them again before it decides,
        when they were measured before the step)."""
        ...

    @property
    def checkpoint(self) -> str | None:
        """The last checkpoint the host saved ("" when none; None when it cannot tell: a plain
        loop saves its own): the stop line names it."""
        ...

    @property
    def replays_loss(self) -> bool:
        """Whether `replay` computes the loss as the step did (Lightning's ``training_step``
        does); a host that replays the model's calls alone cannot see a NaN made outside them,
        so a replay that stays finite is then no proof of a transient fault."""
        ...

    def replay(self, micro: MicroBatch, loss_scale: float) -> Callable[[], torch.Tensor]:
        """A closure that runs `micro` again and returns its loss (for the root cause)."""
        ...

    def replaying(self) -> AbstractContextManager[None]:
        """The host's part of a replay's sandbox: no optimizer or scheduler steps, nothing
        logged, no gradient synchronisation across ranks."""
        ...
