"""The kinds table is the one home of a finding kind, and no output reads a finding's text.

Read from the source with `ast`, as `test_layout` reads the imports: a module that names three
kinds or more as strings of its own keeps facts about kinds that belong in
`stabilizer.core.kinds`; an output that searches a message for a phrase breaks when the message
is reworded.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from stabilizer.core.advice import REMEDY_TEXT
from stabilizer.core.detectors import DETECTORS, default_detectors
from stabilizer.core.kinds import KINDS, TABLE, detector_names, family_rank, kind_of
from stabilizer.core.records import REMEDIES, Severity

ROOT = Path(__file__).resolve().parents[1]
TABLE_FILE = ROOT / "stabilizer" / "core" / "kinds.py"
PRODUCT = sorted([*(ROOT / "stabilizer").rglob("*.py"), *(ROOT / "callbacks").rglob("*.py")])
IDS = [str(path.relative_to(ROOT)) for path in PRODUCT]

_TEXT = {"message", "seen", "advice"}  # a finding's words
_SEARCHES = {"startswith", "endswith", "split", "rsplit", "partition", "rpartition", "find",
             "rfind", "index", "count", "removeprefix", "removesuffix"}  # fmt: skip
_MATCHES = {"search", "match", "fullmatch", "findall", "finditer", "sub", "split"}  # re's
# A reader's own count note ("N more skipped notes like the above"), a `Note`, not a finding.
_NOTE_COUNT = ROOT / "stabilizer" / "replay" / "readers" / "base.py"


def _strings(tree: ast.AST) -> set[str]:
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


@pytest.mark.parametrize("path", PRODUCT, ids=IDS)
def test_only_the_table_names_three_kinds(path: Path) -> None:
    if path == TABLE_FILE:
        return
    named = _strings(ast.parse(path.read_text(), str(path))) & set(KINDS)
    assert len(named) < 3, f"{path.name} names kinds {sorted(named)}: use stabilizer.core.kinds"


def _is_text(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr in _TEXT


def _searches(tree: ast.AST) -> list[int]:
    """Lines that search a finding's text: ``"x" in f.message``, ``f.message.split(...)``,
    ``re.search(..., f.message)``."""
    return [node.lineno for node in ast.walk(tree) if _search(node)]


def _search(node: ast.AST) -> bool:
    if isinstance(node, ast.Compare):
        if any(isinstance(op, ast.In | ast.NotIn) for op in node.ops):
            return any(_is_text(side) for side in [node.left, *node.comparators])
        return False
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return False
    if node.func.attr in _SEARCHES and _is_text(node.func.value):
        return True
    return node.func.attr in _MATCHES and any(_is_text(arg) for arg in node.args)


@pytest.mark.parametrize("path", PRODUCT, ids=IDS)
def test_no_module_searches_a_findings_text(path: Path) -> None:
    if path == _NOTE_COUNT:
        return
    found = _searches(ast.parse(path.read_text(), str(path)))
    assert not found, f"{path.name} searches a message's text at lines {found}: use its fields"


def test_the_search_check_finds_a_phrase_search() -> None:
    tree = ast.parse('any("every module" in f.message for f in found)\nf.message.rpartition(": ")')
    assert sorted(_searches(tree)) == [1, 2]


def test_every_kind_has_a_row_title_and_cause() -> None:
    assert len(KINDS) == len(TABLE) == len(set(KINDS))
    for kind in TABLE:
        assert kind.title and kind.cause, kind.name
        assert set(kind.remedies) <= set(REMEDIES), kind.name
        assert kind.auto is None or kind.auto in REMEDIES, kind.name
        assert set(kind.refutes) <= set(REMEDIES), kind.name
        assert set(kind.remedy_text) <= set(REMEDIES), kind.name
    assert set(REMEDIES) <= set(REMEDY_TEXT)


def test_the_registry_is_the_tables_detectors_in_its_order() -> None:
    assert tuple(DETECTORS) == detector_names()
    assert [type(d).name for d in default_detectors()] == list(detector_names())
    assert detector_names()[0] == "nonfinite"  # a NaN is seen first


def test_a_detectors_class_and_its_kinds_are_read_from_the_rows() -> None:
    # LossSpike (registry name loss_spike) emits two kinds; NonFinite three.
    emitted = {kind.name: kind.detector for kind in TABLE if kind.detector}
    assert emitted["divergence"] == DETECTORS["loss_spike"].name
    assert {k for k, d in emitted.items() if d == "nonfinite"} == {
        "nonfinite_loss",
        "nonfinite_grad",
        "nonfinite_update",
    }


def test_families_rank_their_main_kind_first() -> None:
    assert family_rank("divergence") == ("spike", 0)
    assert family_rank("loss_spike") == ("spike", -1)
    assert family_rank("root_cause") is not None and family_rank("root_cause")[0] == "nonfinite"
    assert family_rank("stall") is None


def test_an_unknown_kind_falls_back_to_its_name() -> None:
    assert kind_of("new_kind").title == "new kind"
    assert kind_of("new_kind").detector is None and not kind_of("new_kind").live_only


def test_setup_advice_is_by_severity() -> None:
    assert kind_of("config_risk").setup_up_to == Severity.CRITICAL
    assert kind_of("causal_leak").setup_up_to == Severity.INFO
    assert kind_of("loss_spike").setup_up_to is None
