"""`WeightsWatch`: the check that no value turned non-finite, and the buffers' restore
(`BufferWatch`).

Every measurement counts the tensors among the parameters, optimizer state and buffers that
turned non-finite (`weights_check`: nothing since the last step, the update or code outside it,
may make a finite value NaN/Inf; read with the step's one host read). What a model holds as
NaN/Inf by design when a tensor is first seen (a ``-inf`` causal mask, observers' ``+-inf``) is
learned (`stabilizer.live.held.HeldNonFinite`), said once in a ``nonfinite_held`` note, and never
judged. Every buffer is copied at each step's start (`BufferWatch`), for a skipped step's
restore.

Why the buffers: a skipped optimizer step leaves the parameters alone, but the forward already
ran: BatchNorm's running statistics took in the bad batch (a NaN sample leaves them NaN, and
every eval output after it), and so does any running statistic a model keeps, whenever it first
starts to change (one refreshed every few batches, or only after a warm-up). Torch does not
count every in-place write in a tensor's ``_version``, so the watch copies every buffer at the
start of each step into copies it keeps (one ``_foreach_copy_`` per dtype and device: buffers
are small) and, when the step is skipped, copies them back; a buffer replaced by a new tensor is
put back as the old object. The walk over the modules is kept between steps and taken again
whenever any module registers a submodule, a parameter or a buffer (torch's global registration
hooks count them): a module added mid-run is watched from the next step. Torch only.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from stabilizer.core.kinds import NONFINITE_HELD
from stabilizer.core.records import Finding, Severity
from stabilizer.live.held import Held, HeldNonFinite
from stabilizer.live.tensors import (
    count_nonfinite,
    count_suspect,
    held_tensors,
    optimizer_state_tensors,
)

__all__ = ["CPU_SHARES", "BufferWatch", "WeightsWatch", "registrations"]

CPU_SHARES = 8
"""On the CPU each step checks an eighth of the parameters, in turn (and all of the optimizer
state, which nothing else would show before it reached the weights)."""


class WeightsWatch:
    """What the model and its optimizers hold, checked for values that turned non-finite.

    Args:
        module: The model.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.buffers = BufferWatch(module)
        self.held = HeldNonFinite()  # what the model holds as NaN/Inf by design
        self.buffers_nonfinite: torch.Tensor | None = None  # the buffers' count of this step
        self._learned: tuple[int, ...] | None = None  # what `_learn` last saw

    def begin(self, optimizers: Sequence[torch.optim.Optimizer], step: int) -> list[Finding]:
        """At a step's start, before its forward: copy the buffers, learn what is new, count
        the buffers that turned non-finite (a device count: read with the step). Returns the
        notes of tensors that hold NaN/Inf by design, first seen now."""
        buffers = self.buffers.begin()
        notes = self._learn(optimizers, step)
        noted = [(k, b) for k, b in buffers if b.is_floating_point() or b.is_complex()]
        self.buffers_nonfinite = None  # none can be non-finite (a bool mask, a counter)
        if noted:
            device = next((p.device for p in self.module.parameters()), torch.device("cpu"))
            whole, partial = self._split([b for _, b in noted], [k for k, _ in noted])
            count = count_nonfinite(whole, device)
            if partial:
                count = count + self.held.count_new(partial, device)
            self.buffers_nonfinite = count
        return notes

    def _learn(self, optimizers: Sequence[torch.optim.Optimizer], step: int) -> list[Finding]:
        """Learn what each parameter and buffer holds when first seen (and the optimizer state
        at the first step, a resumed run's): where it is NaN/Inf already, that is by design.
        Looked at again only when a module registered something or a param group changed."""
        sizes = tuple(len(g["params"]) for opt in optimizers for g in opt.param_groups)
        seen = (self.buffers.registered, *sizes)  # (as counted by `begin`, just before)
        if seen == self._learned:
            return []
        first, self._learned = self._learned is None, seen
        named: list[tuple[Any, str, torch.Tensor]] = [
            (id(p), f"parameter {name}", p) for name, p in self.module.named_parameters()
        ]
        for prefix, owner in self.module.named_modules():
            named += [
                ((id(owner), name), f"buffer {prefix + '.' if prefix else ''}{name}", b)
                for name, b in owner._buffers.items()
                if b is not None
            ]
        for i, opt in enumerate(optimizers):
            named += [(id(p), f"optimizer {i}'s tensor", p) for g in opt.param_groups
                      for p in g["params"]]  # fmt: skip
            if first:
                state = optimizer_state_tensors(opt)
                named += [(id(t), f"optimizer {i}'s state", t) for t in state]
        return [_held_finding(h, step, first) for h in self.held.learn(named)]

    def _split(
        self, tensors: list[torch.Tensor], keys: list[Any] | None = None
    ) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        """`HeldNonFinite.split`, skipped while the model holds nothing by design (nearly
        always): then every tensor is judged whole."""
        return self.held.split(tensors, keys) if self.held.masks else (tensors, [])

    def to_check(
        self, optimizer: torch.optim.Optimizer, step: int
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """What the fast test before `optimizer` steps covers: the tensors it tests whole, and
        the count already taken of the rest (a device scalar, or None): the buffers before this
        step's forward, the tensors that hold NaN/Inf by design (their other positions). Every
        state tensor every step (a NaN written into Adam's moments outside the step shows in no
        loss or gradient before it reaches the weights); the parameters too on an accelerator, a
        `CPU_SHARES`-th in turn on the CPU (a NaN parameter also makes the next loss NaN, and
        that step is then checked in full). Nothing waits."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if params and params[0].is_cpu:
            params = params[step % CPU_SHARES :: CPU_SHARES]
        whole, partial = self._split([*params, *optimizer_state_tensors(optimizer)])
        counted = self.buffers_nonfinite
        if partial:
            held = self.held.count_new(partial, partial[0][0].device)
            counted = held if counted is None else counted + held.to(counted.device)
        return whole, counted

    def check(
        self, optimizer: torch.optim.Optimizer, step: int, device: torch.device
    ) -> torch.Tensor:
        """The fast test before `optimizer` steps (a device scalar, nothing waits): above 0 when
        a value turned non-finite among what `to_check` covers."""
        whole, counted = self.to_check(optimizer, step)
        count = count_suspect(whole, device)
        return count if counted is None else count + counted.to(device)

    def count(self, optimizer: torch.optim.Optimizer, buffers: torch.Tensor | None) -> float:
        """How many of the optimizer's parameters and state, and of the buffers before the
        step (`buffers`, their count), turned non-finite: exact, over all (a sync)."""
        whole, partial = self._split(held_tensors(optimizer))
        devices = {t.device for t in whole} | {t.device for t, _ in partial}
        count = sum(float(count_nonfinite(whole, d)) for d in devices)
        if partial:
            count += float(self.held.count_new(partial, partial[0][0].device))
        return count + (float(buffers) if buffers is not None else 0.0)

    def changed(self, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
        """Whether any parameter, optimizer state or buffer turned non-finite (a sync)."""
        parts = list(self._named(optimizers))
        plain = [t for _, ts, keys in parts if keys is None for t in ts]
        keys = [k for _, _, ks in parts if ks is not None for k in ks]
        buffers = [t for _, ts, ks in parts if ks is not None for t in ts]
        return self.held.changed(plain) or self.held.changed(buffers, keys)

    def first_changed(self, optimizers: Sequence[torch.optim.Optimizer]) -> str:
        """The first tensor that turned non-finite (a failing step only: a sync per tensor)."""
        for name, tensors, keys in self._named(optimizers):
            if self.held.changed(tensors, keys):
                return name
        return "another optimizer's tensors"

    def _named(
        self, optimizers: Sequence[torch.optim.Optimizer]
    ) -> Iterator[tuple[str, list[torch.Tensor], list[Any] | None]]:
        """Parameters, optimizer state and buffers: ``(name, tensors, keys)`` (buffers are
        keyed by module and name, the rest by identity)."""
        for name, p in self.module.named_parameters():
            yield f"parameter {name}", [p], None
        for i, opt in enumerate(optimizers):
            yield f"optimizer {i}'s state", list(optimizer_state_tensors(opt)), None
            params = [p for g in opt.param_groups for p in g["params"]]
            yield f"optimizer {i}'s tensors", params, None
        for prefix, owner in self.module.named_modules():
            for name, b in owner._buffers.items():
                if b is not None:
                    full = f"{prefix}.{name}" if prefix else name
                    yield f"buffer {full}", [b], [(id(owner), name)]


def _held_finding(held: Held, step: int, first: bool) -> Finding:
    """The note that a tensor held NaN/Inf when first seen: by design, not judged."""
    when = "before training" if first else f"when first seen at step {step}"
    message = (
        f"{held.name} holds {held.count} of {held.total} values as {held.sample} {when}: "
        "held by design (a mask, an observer, an unused tensor), not judged; a value that "
        "turns non-finite from now on is"
    )
    evidence = {"nonfinite_values": float(held.count), "values": float(held.total)}
    return Finding(NONFINITE_HELD, step, step, Severity.INFO, message, evidence)


# --- the buffers: copied at each step's start, put back when the step is skipped ------------

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
