"""`ModelCalls`: the model's forward calls of each micro-batch, noted to replay them.

A host outside Lightning has no ``training_step`` to run again. What it can replay, for a root
cause, is what the model itself was called with: a forward pre-hook notes each call's arguments
and the autocast in force (a loop's ``with torch.autocast(...)``), and the first call after a
boundary the host marks (the last backward, a new step) begins a micro-batch. The replay calls
the model again with the same arguments under the same autocast; code outside the model (a
loss computed from the logits, a gradient written by the loop) is not replayed, which the host
says (`Host.replays_loss`).

The calls noted are the outermost ones: of the model, or of its direct children once a step has
shown that the loop calls those itself (`widen`: a GAN's container is never called, its
generator and critic are). A call made inside another noted call is part of it. A call is the
training's when gradients are enabled inside the loop's step, whatever the module's mode:
frozen-BatchNorm fine-tuning trains a model in ``eval()``.

The hooks sit on the model itself, not on a wrapper (``DistributedDataParallel``, Fabric's): a
replay through DDP's ``forward`` could start a collective (its buffers' broadcast) that the other
ranks, replaying another number of micro-batches, never join.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stabilizer.live.tensors import outside_compile
from stabilizer.step.host import MicroBatch

__all__ = ["Call", "ModelCalls", "ReplaysCalls", "loss_of", "unwrap"]


@dataclass(frozen=True)
class Call:
    """One forward call of the model (or of a child the loop calls): its arguments and the
    autocast it ran under.

    Args:
        module: The module called.
        args: Positional arguments.
        kwargs: Keyword arguments.
        autocast: ``(device type, dtype)`` of the autocast in force, or None.
    """

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    autocast: tuple[str, torch.dtype] | None = None


class ModelCalls:
    """Notes the model's calls; the first after `fresh` is set begins a micro-batch.

    Args:
        module: The model (not a wrapper: see the module).
        begin: Called with the micro-batch's list of calls (its first one in it), before the
            forward runs; the list grows with the micro-batch's later calls.
        wanted: Whether a call now belongs to the training (not the monitor's own replay, not
            an evaluation).
        returned: Called with each wanted call's output and keyword arguments, if given.
    """

    def __init__(
        self,
        module: nn.Module,
        begin: Callable[[list[Call]], None],
        wanted: Callable[[], bool],
        returned: Callable[[Any, dict[str, Any]], None] | None = None,
    ) -> None:
        self.module, self._begin, self._wanted, self._returned = module, begin, wanted, returned
        self._calls: list[Call] = []
        self.fresh = True  # the next call begins a micro-batch
        self._depth = 0  # noted calls running now (a call inside one is part of it)
        self.noted = 0  # calls noted so far
        self._device = next((p.device.type for p in module.parameters()), "cpu")
        self._handles: list[Any] = []
        self._hook(module)
        self._wide = False

    @property
    def fresh(self) -> bool:
        """Whether the next call begins a micro-batch."""
        return self._fresh

    @fresh.setter
    def fresh(self, value: bool) -> None:
        self._fresh = value
        if value:  # the batch in flight keeps the calls for a replay, until the step's end;
            self._calls = []  # kept here too, they (the inputs) would outlive the step

    def _hook(self, target: nn.Module) -> None:
        # Under ``torch.compile`` traced hooks would compile the monitor's code (and fail in it).
        called, output = outside_compile(self._called), outside_compile(self._output)
        self._handles += [
            target.register_forward_pre_hook(called, with_kwargs=True),
            target.register_forward_hook(output, with_kwargs=True, always_call=True),
        ]

    def widen(self) -> None:
        """Note the calls of the model's direct children too (the loop calls them, not the
        model: a container's parts)."""
        if not self._wide:
            self._wide = True
            for child in self.module.children():
                self._hook(child)

    def _takes(self) -> bool:
        # Under no_grad (an evaluation) the call is no training step's, whatever the mode.
        return torch.is_grad_enabled() and self._wanted()

    def _called(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._depth += 1
        if self._depth > 1 or not self._takes():
            return
        call = Call(module, args, dict(kwargs), _autocast(self._device))
        self.noted += 1
        if self.fresh:
            self.fresh, self._calls = False, [call]
            self._begin(self._calls)  # after the call is in it: the preflight reads its ids
        else:
            self._calls.append(call)

    def _output(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        self._depth = max(0, self._depth - 1)
        outermost = self._depth == 0 and module is self.module
        if outermost and self._returned is not None and self._takes():
            self._returned(output, kwargs)

    def replay(self, calls: list[Call]) -> Callable[[], torch.Tensor]:
        """A closure that calls the model again as `calls` did: the sum of their losses
        (`loss_of` each output)."""

        def run() -> torch.Tensor:
            total: torch.Tensor | None = None
            for call in calls:
                cast = call.autocast
                with torch.autocast(cast[0], cast[1]) if cast else nullcontext():
                    loss = loss_of(call.module(*call.args, **call.kwargs))
                total = loss if total is None else total + loss
            if total is None:
                raise RuntimeError("no call of the model was noted for this micro-batch")
            return total

        return run

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class ReplaysCalls:
    """The replay of a host outside Lightning: the model's recorded calls of the micro-batch
    again, not the code around them (`Host.replays_loss` is False)."""

    replays_loss = False
    _calls: ModelCalls | None = None

    def replays_with(self, calls: ModelCalls) -> None:
        """The model's calls, recorded for a replay."""
        self._calls = calls

    def replay(self, micro: MicroBatch, loss_scale: float) -> Callable[[], torch.Tensor]:
        """The micro-batch's calls of the model again; the loss from what they return."""
        if self._calls is None:
            raise RuntimeError("the model's calls are not recorded")
        return self._calls.replay(micro.batch)


def _autocast(device: str) -> tuple[str, torch.dtype] | None:
    """The autocast in force on `device`'s type now, or None (also on torch < 2.4, whose
    ``is_autocast_enabled`` takes no device type)."""
    try:
        if not torch.is_autocast_enabled(device):
            return None
    except TypeError:
        return None
    return device, torch.get_autocast_dtype(device)


def loss_of(output: Any) -> torch.Tensor:
    """The loss in what a model returned: a scalar tensor, a ``loss`` entry or attribute (a
    Hugging Face model's output), the first scalar of a tuple (nanoGPT's ``(logits, loss)``);
    else the mean of the first tensor (a replay without a loss still finds a forward NaN)."""
    found = given_loss(output)
    if found is not None:
        return found
    if isinstance(output, torch.Tensor):
        return output.float().mean()
    items = output.values() if isinstance(output, Mapping) else output if _seq(output) else ()
    tensors = [o for o in items if isinstance(o, torch.Tensor)]
    if tensors:
        return tensors[0].float().mean()
    raise TypeError(f"no tensor in the model's output ({type(output).__name__})")


def given_loss(output: Any) -> torch.Tensor | None:
    """The loss a model returned, if it returned one (see `loss_of`); None otherwise."""
    if isinstance(output, torch.Tensor):
        return output if output.numel() == 1 else None
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if _seq(output):
        scalars = [o for o in output if isinstance(o, torch.Tensor) and o.numel() == 1]
        return scalars[0] if scalars else None
    return None


def _seq(output: Any) -> bool:
    return isinstance(output, tuple | list)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside the wrappers a loop calls: ``DistributedDataParallel``,
    ``DataParallel``, Fabric's module, ``torch.compile``'s."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile
            model = model._orig_mod  # type: ignore[assignment]
        elif isinstance(getattr(model, "_original_module", None), nn.Module):  # Fabric
            model = model._original_module  # type: ignore[assignment]
        else:
            return model
