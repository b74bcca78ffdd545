"""The distribution's layout: callbacks/ installs as stabilizer.callbacks; stabilizer/ never
imports Lightning."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed_in_pyproject() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for top, name in (("stabilizer", "stabilizer"), ("callbacks", "stabilizer.callbacks")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top).parts
            found.add(".".join((name, *rel)))
    assert found == listed


def test_stabilizer_never_imports_lightning() -> None:
    code = (
        "import sys, stabilizer, stabilizer.cli, stabilizer.demo.model, stabilizer.demo.data, "
        "stabilizer.demo.scenarios; "
        "print(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('lightning', 'pytorch_lightning')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_callbacks_import_from_repository_root() -> None:
    code = "import stabilizer.callbacks as c; print(c.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert Path(out.stdout.strip()).parent.name == "callbacks"


def test_lazy_reexport() -> None:
    import stabilizer

    assert stabilizer.LitGPT.__name__ == "LitGPT"
