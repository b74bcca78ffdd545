"""The import rules of the layout (see the README's Layout), read from the source with `ast`.

Rooms: ``core`` (records, signals, groups, engine, detectors), ``live`` (torch), ``replay``,
``outputs``, ``report``, ``demo``, ``cli``, and the Lightning layer ``callbacks``. Nothing lower
imports anything higher; core, replay, outputs and report never import torch (``diagnose`` runs
without it); nothing under ``stabilizer/`` imports Lightning. Imports inside functions count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# room -> the rooms it may import (itself included)
ALLOWED = {
    "core": {"core"},
    "live": {"core", "live"},
    "replay": {"core", "replay"},
    "outputs": {"core", "outputs"},
    "report": {"core", "replay", "outputs", "report"},
    "demo": {"core", "demo"},
    "remedies": {"live"},  # the public name of live.remedies
    "step": {"core", "live", "outputs", "step"},  # the live step: torch, never Lightning
    "hosts": {"core", "live", "outputs", "step", "hosts"},  # its hosts beside Lightning's
    "cli": {"core", "replay", "outputs", "report", "demo", "callbacks"},
    "callbacks": {"core", "live", "outputs", "demo", "step", "callbacks"},
}
NO_TORCH = {"core", "replay", "outputs", "report"}


def _files() -> list[tuple[str, Path]]:
    """Each source file with its room and package parts."""
    out = []
    for path in sorted((ROOT / "stabilizer").rglob("*.py")):
        parts = path.relative_to(ROOT / "stabilizer").with_suffix("").parts
        if parts == ("__init__",):
            continue  # the lazy re-exports, by name only
        out.append((parts[0], path))
    out += [("callbacks", path) for path in sorted((ROOT / "callbacks").rglob("*.py"))]
    return out


def _module(path: Path) -> list[str]:
    """The dotted package of a file as installed (callbacks/ is stabilizer.callbacks)."""
    rel = path.relative_to(ROOT).with_suffix("").parts
    parts = ["stabilizer", *rel[1:]] if rel[0] == "stabilizer" else ["stabilizer", *rel]
    return parts[:-1]  # a module's package; for __init__, the package itself


def _imports(path: Path) -> list[str]:
    """Every module a file imports, relative imports resolved."""
    package = _module(path)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                found.append(".".join([*base, *([node.module] if node.module else [])]))
            else:
                found.append(node.module or "")
    return found


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "stabilizer" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in ALLOWED else "cli" if parts[1] == "cli" else None


CASES = _files()


@pytest.mark.parametrize(("room", "path"), CASES, ids=[str(p.relative_to(ROOT)) for _, p in CASES])
def test_imports_follow_the_rooms(room: str, path: Path) -> None:
    imported = _imports(path)
    higher = [m for m in imported if (r := _room(m)) is not None and r not in ALLOWED[room]]
    assert not higher, f"{room} may import only {sorted(ALLOWED[room])}, imports {higher}"
    if path.is_relative_to(ROOT / "stabilizer"):
        lightning = [m for m in imported if m.split(".")[0] in ("lightning", "pytorch_lightning")]
        assert not lightning, f"nothing under stabilizer/ imports Lightning: {lightning}"
    if room in NO_TORCH:
        torch = [m for m in imported if m.split(".")[0] == "torch"]
        assert not torch, f"{room} never imports torch: {torch}"


def test_every_room_has_files() -> None:
    rooms = {room for room, _ in CASES}
    assert rooms == set(ALLOWED), sorted(rooms ^ set(ALLOWED))
