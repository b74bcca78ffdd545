"""`BufferWatch`: put a model's buffers back when the step that changed them is skipped.

A skipped optimizer step leaves the parameters alone, but the forward already ran: BatchNorm's
running statistics took in the bad batch (a NaN sample leaves them NaN, and every eval output
after it), and so does any running statistic a model keeps, whenever it first starts to change
(one refreshed every few batches, or only after a warm-up). Torch does not count every in-place
write in a tensor's ``_version``, so the watch copies every buffer at the start of each step into
copies it keeps (one ``_foreach_copy_`` per dtype and device: buffers are small) and, when the
step is skipped, copies them back; a buffer replaced by a new tensor is put back as the old
object. The walk over the modules is kept between steps and taken again whenever any module
registers a submodule, a parameter or a buffer (torch's global registration hooks count them):
a module added mid-run is watched from the next step. Torch only.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["BufferWatch", "registrations"]

_registrations = [0]  # submodules, parameters and buffers registered since the hooks
_hooks: list[object] = []


def _count_registration(*_: object) -> None:
    _registrations[0] += 1


def registrations() -> int:
    """How many submodules, parameters and buffers any module registered (or reassigned) in
    this process since the first call: unchanged means no module gained or replaced one."""
    if not _hooks:
        module = nn.modules.module
        _hooks.append(module.register_module_module_registration_hook(_count_registration))
        _hooks.append(module.register_module_buffer_registration_hook(_count_registration))
        _hooks.append(module.register_module_parameter_registration_hook(_count_registration))
    return _registrations[0]


class BufferWatch:
    """Copies of every buffer at the start of each step, and their restore.

    Args:
        model: The model whose buffers are watched.
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._refs: list[tuple[nn.Module, str, Tensor]] = []
        self._copies: dict[int, Tensor] = {}  # id of a buffer -> its copy (kept between steps)
        self.registered = registrations()  # the count `begin` last saw
        self._walked: tuple[int, list[nn.Module]] | None = None  # (registrations, modules)

    def _holders(self) -> list[nn.Module]:
        """The modules that hold buffers, walked again after any registration."""
        count = self.registered = registrations()
        if self._walked is None or self._walked[0] != count:
            holders = [m for m in self._model.modules() if m._buffers]
            self._walked = (count, holders)
        return self._walked[1]

    def begin(self) -> list[tuple[tuple[int, str], Tensor]]:
        """At the start of a step (its first micro-batch): note and copy every buffer. Returns
        them (`buffers`); `registered` is then the count of registrations seen."""
        refs = [
            (module, name, buf)
            for module in self._holders()
            for name, buf in module._buffers.items()
            if buf is not None
        ]
        copies: dict[int, Tensor] = {}
        for _, _, buf in refs:
            kept = self._copies.get(id(buf))
            same = kept is not None and kept.shape == buf.shape and kept.dtype == buf.dtype
            copies[id(buf)] = kept if kept is not None and same else torch.empty_like(buf)
        self._refs, self._copies = refs, copies
        with torch.no_grad():
            _copy([copies[id(b)] for _, _, b in refs], [b for _, _, b in refs])
        return self.buffers

    @property
    def buffers(self) -> list[tuple[tuple[int, str], Tensor]]:
        """The buffers noted at the last `begin` (until `end`), keyed by module and name."""
        return [((id(module), name), buf) for module, name, buf in self._refs]

    def end(self, restore: bool) -> None:
        """At the end of the step: put every buffer back (`restore`). Once per `begin`: a second
        call does nothing."""
        if not self._refs:
            return
        if restore:
            with torch.no_grad():
                for module, name, buf in self._refs:
                    copy = self._copies[id(buf)]
                    if copy.shape != buf.shape:  # resized in place (an observer's first batch)
                        module._buffers[name] = copy  # the copy, at its old size, is the buffer
                    elif module._buffers.get(name) is not buf:
                        module._buffers[name] = buf
                kept = [b for _, _, b in self._refs if self._copies[id(b)].shape == b.shape]
                _copy(kept, [self._copies[id(b)] for b in kept])
        self._refs = []


def _copy(dst: list[Tensor], src: list[Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for each pair, one kernel per dtype and device."""
    groups: dict[tuple[torch.dtype, torch.device], tuple[list[Tensor], list[Tensor]]] = {}
    for d, s in zip(dst, src, strict=True):
        if d.layout != torch.strided or s.layout != torch.strided:
            d.copy_(s)
            continue
        pair = groups.setdefault((d.dtype, d.device), ([], []))
        pair[0].append(d)
        pair[1].append(s)
    for d_list, s_list in groups.values():
        torch._foreach_copy_(d_list, s_list)
