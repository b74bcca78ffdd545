"""Each fact of the package has one home, read from the source with `ast` as `test_kinds` reads it.

- Remedies: only the remedy table (`stabilizer/core/remedies.py`) names three remedies or more
  as strings of its own; every other module names them by the table's constants.
- Episodes: only `stabilizer/core/episode.py` decides when two findings are one episode (keys a
  finding by its kind and start step, or compares two findings' kinds, steps or places) or
  defines a class of episodes.
- Errors: only `stabilizer/core/isolated.py` writes "keep this error, or raise it when strict".
- Names: no two classes of the package share a name.
- Size: no module is over 400 lines.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

from stabilizer.core.remedies import REMEDIES, TABLE

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "stabilizer" / "core"
PRODUCT = sorted([*(ROOT / "stabilizer").rglob("*.py"), *(ROOT / "callbacks").rglob("*.py")])
IDS = [str(path.relative_to(ROOT)) for path in PRODUCT]
TREES = {path: ast.parse(path.read_text(), str(path)) for path in PRODUCT}


def _own_strings(tree: ast.AST) -> set[str]:
    """The module's string constants, less the names in its ``__all__`` (a remedy's function
    is named as the remedy: ``clip_gradients``)."""
    exported: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            exported |= {id(c) for c in ast.walk(node.value)}
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        and id(node) not in exported
    }  # fmt: skip


@pytest.mark.parametrize("path", PRODUCT, ids=IDS)
def test_only_the_remedy_table_names_three_remedies(path: Path) -> None:
    if path == CORE / "remedies.py":
        return
    named = _own_strings(TREES[path]) & set(REMEDIES)
    assert not named, f"{path.name} names remedies {sorted(named)}: use core.remedies"


def test_the_remedy_check_sees_a_tuple_of_names_but_not_an_export_list() -> None:
    tree = ast.parse('__all__ = ["clip_gradients", "rollback", "scale_lr"]\nx = ("rollback",)')
    assert _own_strings(tree) & set(REMEDIES) == {"rollback"}
    assert len(_own_strings(ast.parse(repr(REMEDIES))) & set(REMEDIES)) == len(TABLE)


_FINDING_PARTS = ("kind", "step", "location")


def _attr(node: ast.AST) -> str | None:
    """``x.kind`` → ``"kind"``, for an attribute of anything but ``self``."""
    if not isinstance(node, ast.Attribute):
        return None
    owner = node.value
    return None if isinstance(owner, ast.Name) and owner.id == "self" else node.attr


def _episode_rules(tree: ast.AST) -> list[str]:
    """What decides episodes: a key of a finding's kind and start step (``(f.kind, f.step)``),
    a function that compares two findings' kinds and their steps, a class named for episodes."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Tuple):
            parts = [_attr(e) for e in node.elts]
            if "kind" in parts and "step" in parts and set(parts) <= {*_FINDING_PARTS, None}:
                found.append(f"line {node.lineno}: a key {ast.unparse(node)}")
        elif isinstance(node, ast.FunctionDef | ast.Lambda) and {"kind", "step"} <= _compared(node):
            found.append(f"line {node.lineno}: compares kinds and steps")
        elif isinstance(node, ast.ClassDef) and "episode" in node.name.lower():
            found.append(f"line {node.lineno}: class {node.name}")
    return found


def _compared(function: ast.AST) -> set[str]:
    """The parts two things are compared by in ``function`` (``a.kind == b.kind``: kind)."""
    parts = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.Eq | ast.NotEq):
            sides = {_attr(side) for side in (node.left, *node.comparators)}
            parts |= sides & set(_FINDING_PARTS) if len(sides) == 1 else set()
    return parts


@pytest.mark.parametrize("path", PRODUCT, ids=IDS)
def test_only_core_episode_decides_episodes(path: Path) -> None:
    if path == CORE / "episode.py":
        return
    found = _episode_rules(TREES[path])
    assert not found, f"{path.name} decides episodes itself: {found}; use core.episode"


def test_the_episode_check_finds_the_rules_that_were_written_thrice() -> None:
    """The rules #34 replaced: the notifier's key, TensorBoard's merge, the report's own
    `Episode` class (the tuples of a sort order stay allowed)."""
    notify = "key = (where, segment, finding.kind, finding.step)"
    table = "def continues(new, old):\n    return new.kind == old.kind and new.step == old.step"
    report = "class Episode:\n    number: int"
    order = "key = (finding.step, -finding.severity, finding.kind, finding.message)"
    one_part = "def same_note(a, b):\n    return a.kind == b.kind"
    codes = (notify, table, report, order, one_part)
    assert [len(_episode_rules(ast.parse(code))) for code in codes] == [1, 1, 1, 0, 0]


def _keeps_or_raises(handler: ast.ExceptHandler) -> bool:
    """``except Exception: if strict: raise`` (``self.strict``, ``self.options.strict``)."""
    for node in ast.walk(handler):
        if isinstance(node, ast.If) and any(isinstance(s, ast.Raise) for s in node.body):
            test = node.test
            name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", "")
            if name == "strict":
                return True
    return False


@pytest.mark.parametrize("path", PRODUCT, ids=IDS)
def test_only_isolated_keeps_an_error_or_raises_it(path: Path) -> None:
    handlers = [n for n in ast.walk(TREES[path]) if isinstance(n, ast.ExceptHandler)]
    found = [h.lineno for h in handlers if _keeps_or_raises(h)]
    assert not found, f"{path.name} lines {found}: use `with Isolated(strict)` (core.isolated)"


def test_the_strict_check_finds_the_block() -> None:
    code = "try:\n    f()\nexcept Exception as e:\n    if self.strict:\n        raise\n    g(e)"
    [handler] = [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.ExceptHandler)]
    assert _keeps_or_raises(handler)


def test_no_two_classes_share_a_name() -> None:
    """A name says which thing it is: two `Episodes` (a live stream's, TensorBoard's table),
    two `_Replay` (a diagnosis, a stream's first bytes again) read as one thing."""
    where: dict[str, list[str]] = defaultdict(list)
    for path, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(f"{path.relative_to(ROOT)}:{node.lineno}")
    shared = {name: places for name, places in where.items() if len(places) > 1}
    assert not shared, shared


_MOST_LINES = 400  # (style.md: split past 400)


def test_no_module_is_over_400_lines() -> None:
    """A module a reader can hold: none of the package's is longer than 400 lines."""
    long = {
        str(path.relative_to(ROOT)): n
        for path in PRODUCT
        if (n := len(path.read_text().splitlines())) > _MOST_LINES
    }
    assert not long, long
