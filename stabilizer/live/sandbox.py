"""`sandbox`: run a model's code (a root-cause replay, a preflight check) without changing the run.

Inside the sandbox the caller may run forwards and backwards of the model; when it ends, the
parameters' gradients (the same tensor objects), ``requires_grad`` flags, every buffer (values
and objects: BatchNorm's running statistics), the modules' own attributes (``self.calls += 1``,
``training``), the containers, random generators and iterators they hold (`UserState`) and every
global random state (torch, CUDA, numpy, Python) are as they were before.
Parameters are not copied (they would cost a model's worth of memory): a parameter that the code
inside wrote in place is named in `Sandboxed.changed`, so that the caller can say so. Keeping the
optimizers from stepping is the caller's part (the guard's ``inert`` mode).

`UserState` is what a model's own Python state holds. A root-cause replay runs the user's
``training_step`` again, and the preflight runs the model: code that keeps state of its own
would keep a trace of it. It covers what the modules hold in their ``__dict__``:

- containers (lists, dicts, sets, deques, nested within them): a list a step appends to (the
  ``self.training_step_outputs.append(loss)`` of Lightning 2's epoch-end pattern), a dict of
  counters — put back to what they held, in place (the same objects);
- random generators (``torch.Generator``, numpy's ``Generator`` and ``RandomState``, Python's
  ``random.Random``), in an attribute or a container — put back to their state;
- iterators in an attribute (``self.unlabeled = iter(loader)``, drawn with ``next``): during the
  replay the attribute is a stand-in that draws from the real iterator and remembers what it
  drew; afterwards the attribute yields those items first, then the real iterator's: no item is
  lost (the attribute is then that stand-in, not the original object).

Anything else the code touches stays touched: objects that are not containers (their own
attributes), the data module, files, the network, global variables. Torch and numpy only.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from .rng import RngState

__all__ = ["Sandboxed", "UserState", "sandbox"]

_DEPTH = 4  # containers nested deeper than this are not copied
_MODULE_KEYS = frozenset({"_parameters", "_buffers", "_modules"})  # the sandbox's own


@dataclass
class Sandboxed:
    """What a sandbox found when it ended.

    Args:
        changed: Parameters written in place inside the sandbox (not undone).
    """

    changed: list[str] = field(default_factory=list)


@contextmanager
def sandbox(model: nn.Module) -> Iterator[Sandboxed]:
    """Everything but the parameters' values is put back when the block ends (even on error)."""
    report = Sandboxed()
    rng = RngState.capture(everything=True)
    params = list(model.named_parameters())
    grads = [(p, p.grad, p.requires_grad, p._version) for _, p in params]
    modules = list(model.modules())
    attrs = [(m, dict(m.__dict__), dict(m._buffers)) for m in modules]
    buffers = [
        (b, b.detach().clone()) for m in modules for b in m._buffers.values() if b is not None
    ]
    user = UserState.capture(modules)  # (iterators get stand-ins: `attrs` holds the originals)
    for _, p in params:
        p.grad = None  # a backward inside would accumulate into the caller's gradients
    try:
        yield report
    finally:
        with torch.no_grad():
            for m, saved, saved_buffers in attrs:
                _restore_dict(m.__dict__, saved)
                _restore_dict(m._buffers, saved_buffers)
            user.restore()
            for b, copy in buffers:
                b.copy_(copy)
            for p, grad, flag, _ in grads:
                p.grad = grad
                p.requires_grad_(flag)
        rng.restore()
        report.changed = [
            name for (name, p), (_, _, _, v) in zip(params, grads, strict=True) if p._version != v
        ]


def _restore_dict(current: dict[str, Any], saved: dict[str, Any]) -> None:
    """Put the saved entries back into the same dict object (others hold a reference to it)."""
    if current.keys() == saved.keys() and all(current[k] is v for k, v in saved.items()):
        return  # the usual case: nothing was reassigned
    current.clear()
    current.update(saved)


@dataclass
class UserState:
    """A snapshot of the modules' containers, generators and iterators (`capture`), and its
    restore (`restore`)."""

    containers: list[tuple[Any, Any]] = field(default_factory=list)  # (object, its contents)
    generators: list[tuple[Any, Any]] = field(default_factory=list)  # (generator, its state)
    iterators: list[tuple[dict[str, Any], str, _Drawn]] = field(default_factory=list)

    @classmethod
    def capture(cls, modules: list[nn.Module]) -> UserState:
        """Note every container and generator the modules hold, and put stand-ins in front of
        their iterators (call `restore` afterwards, even on error)."""
        state, seen = cls(), set[int]()
        for module in modules:
            attrs = module.__dict__
            for name, value in list(attrs.items()):
                if name in _MODULE_KEYS:
                    continue
                if _is_iterator(value):
                    drawn = _Drawn(value)
                    state.iterators.append((attrs, name, drawn))
                    attrs[name] = drawn
                else:
                    state._note(value, seen, 0)
        return state

    def _note(self, value: Any, seen: set[int], depth: int) -> None:
        if id(value) in seen or depth > _DEPTH:
            return
        seen.add(id(value))
        generator_state = _state_of(value)
        if generator_state is not None:
            self.generators.append((value, generator_state))
            return
        if isinstance(value, list | deque):
            items: list[Any] = list(value)
            self.containers.append((value, items))
        elif isinstance(value, dict):
            items = list(value.values())
            self.containers.append((value, dict(value)))
        elif isinstance(value, set):
            items = []
            self.containers.append((value, set(value)))
        elif isinstance(value, tuple):
            items = list(value)
        else:
            return
        for item in items:
            self._note(item, seen, depth + 1)

    def restore(self) -> None:
        """Containers hold again what they held, generators are back in their state, iterators
        yield first what the run drew from them."""
        for obj, contents in self.containers:
            if isinstance(obj, list):
                obj[:] = contents
            else:  # dict, set, deque
                obj.clear()
                obj.update(contents) if not isinstance(obj, deque) else obj.extend(contents)
        for generator, generator_state in self.generators:
            _set_state(generator, generator_state)
        for attrs, name, drawn in self.iterators:
            current = attrs.get(name)
            if current is drawn or current is drawn.real:  # (the sandbox may have put it back)
                attrs[name] = drawn.replayed()


class _Drawn:
    """An iterator's stand-in while the monitor runs the user's code: draws from the real one
    and remembers what it drew; other attributes are the real iterator's."""

    def __init__(self, real: Any) -> None:
        self.real, self.items = real, list[Any]()

    def __iter__(self) -> _Drawn:
        return self

    def __next__(self) -> Any:
        item = next(self.real)
        self.items.append(item)
        return item

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def replayed(self) -> Any:
        """The real iterator when nothing was drawn, else what was drawn followed by it."""
        return self.real if not self.items else _Chained(self.items, self.real)


class _Chained:
    """Yields `items` first, then the rest of `real`; other attributes are `real`'s."""

    def __init__(self, items: list[Any], real: Any) -> None:
        self._items: Iterator[Any] = iter(items)
        self.real = real

    def __iter__(self) -> _Chained:
        return self

    def __next__(self) -> Any:
        for item in self._items:
            return item
        return next(self.real)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def _is_iterator(value: Any) -> bool:
    """An iterator a step may draw from with ``next`` (not a container, tensor or module)."""
    if isinstance(value, torch.Tensor | nn.Module | str | bytes):
        return False
    return hasattr(type(value), "__next__") and hasattr(type(value), "__iter__")


def _state_of(value: Any) -> Any:
    """A random generator's state, or None when `value` is none."""
    if isinstance(value, torch.Generator):
        return value.get_state()
    if isinstance(value, np.random.Generator):
        return value.bit_generator.state
    if isinstance(value, np.random.RandomState):
        return value.get_state(legacy=False)
    if isinstance(value, random.Random):
        return value.getstate()
    return None


def _set_state(generator: Any, state: Any) -> None:
    if isinstance(generator, torch.Generator):
        generator.set_state(state)
    elif isinstance(generator, np.random.Generator):
        generator.bit_generator.state = state
    elif isinstance(generator, np.random.RandomState):
        generator.set_state(state)
    else:
        generator.setstate(state)
