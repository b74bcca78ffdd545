"""`BufferWatch`: put a model's buffers back when the step that changed them is skipped.

A skipped optimizer step leaves the parameters alone, but the forward already ran: BatchNorm's
running statistics took in the bad batch (a NaN sample leaves them NaN, and every eval output
after it). Torch does not count those in-place writes in a tensor's ``_version``, so the watch
copies the buffers that can change: those of modules that track running statistics, plus every
buffer seen to change during the first `LEARN_STEPS` steps (when all of them are copied and
compared). A buffer replaced by a new tensor is put back as the old object. Buffers are small;
a buffer that never changed in those steps and changes later is not copied, and the monitor's
check of the weights after each step still sees it if it goes non-finite. The walk over the
modules is kept between steps and taken again whenever any module registers a submodule or a
buffer (torch's global registration hooks count them): a module added mid-run is watched from
the next step. Torch only.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["BufferWatch"]

_Key = tuple[int, str]  # (id of the owning module, buffer name)
_registrations = [0]  # submodules and buffers registered in this process since the hooks


def _count_registration(*_: object) -> None:
    _registrations[0] += 1


_hooks: list[object] = []


def _watch_registrations() -> None:
    """Count every submodule and buffer registration from now on (once per process)."""
    if not _hooks:
        _hooks.append(
            nn.modules.module.register_module_module_registration_hook(_count_registration)
        )
        _hooks.append(
            nn.modules.module.register_module_buffer_registration_hook(_count_registration)
        )


class BufferWatch:
    """Copies of the changeable buffers at the start of each step, and their restore.

    Args:
        model: The model whose buffers are watched.
    """

    LEARN_STEPS = 2

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._mutable: set[_Key] = set()
        self._steps = 0
        self._refs: list[tuple[nn.Module, str, Tensor]] = []
        self._copies: dict[_Key, Tensor] = {}
        _watch_registrations()
        self._walked: tuple[int, list[nn.Module]] | None = None  # (registrations, modules)

    def _holders(self) -> list[nn.Module]:
        """The modules that hold buffers, walked again after any registration."""
        if self._walked is None or self._walked[0] != _registrations[0]:
            holders = [m for m in self._model.modules() if m._buffers]
            self._walked = (_registrations[0], holders)
        return self._walked[1]

    def begin(self) -> None:
        """At the start of a step (its first micro-batch): note and copy what may change."""
        learning = self._steps < self.LEARN_STEPS
        self._refs, self._copies = [], {}
        with torch.no_grad():
            for module in self._holders():
                tracks = bool(getattr(module, "track_running_stats", False))
                for name, buf in module._buffers.items():
                    if buf is None:
                        continue
                    self._refs.append((module, name, buf))
                    key = (id(module), name)
                    if learning or tracks or key in self._mutable:
                        self._copies[key] = buf.detach().clone()

    @property
    def buffers(self) -> list[Tensor]:
        """The buffers noted at the last `begin` (until `end`)."""
        return [buf for _, _, buf in self._refs]

    def end(self, restore: bool) -> None:
        """At the end of the step: put every buffer back (`restore`), or learn which changed.
        Once per `begin`: a second call does nothing."""
        if not self._refs:
            return
        with torch.no_grad():
            for module, name, buf in self._refs:
                key = (id(module), name)
                if module._buffers.get(name) is not buf:
                    self._mutable.add(key)
                    if restore:
                        module._buffers[name] = buf
                copy = self._copies.get(key)
                if copy is None:
                    continue
                if restore:
                    buf.copy_(copy)
                elif self._steps < self.LEARN_STEPS and not torch.equal(buf, copy):
                    self._mutable.add(key)
        self._steps += 1
        self._refs, self._copies = [], {}
