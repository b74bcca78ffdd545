"""stabilizer: catch, prevent and explain training instabilities of Transformers.

The engine, readers, the step, remedies, model and CLI live here and never import Lightning; the
Lightning host is the subpackage ``stabilizer.callbacks`` (the top-level ``callbacks/`` folder of
the repository); a plain loop or Fabric use `Stabilizer`, the Hugging Face ``Trainer`` uses
`StabilityCallback`. Names from it are re-exported lazily, so ``stabilizer diagnose`` never pays for
importing Lightning.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

__all__ = [
    "Auto",
    "LitGPT",
    "Observe",
    "Protect",
    "StabilityCallback",
    "StabilityMonitor",
    "Stabilizer",
    "StabilizerDataModule",
    "__version__",
]
__version__ = "0.1.0"

# Installed, callbacks/ sits inside this package as stabilizer/callbacks. In a source checkout it is
# the sibling folder ../callbacks: make it importable as stabilizer.callbacks when Python runs from
# the repository root (where ./stabilizer shadows any installed copy).
_here = Path(__file__).resolve().parent
if not (_here / "callbacks").is_dir() and (_here.parent / "callbacks" / "__init__.py").is_file():
    __path__.append(str(_here.parent))

_LAZY = {
    "Auto": "stabilizer.step.policies",
    "Observe": "stabilizer.step.policies",
    "Protect": "stabilizer.step.policies",
    "Stabilizer": "stabilizer.hosts.loop",
    "StabilityCallback": "stabilizer.hosts.hf",
    "LitGPT": "stabilizer.callbacks.demo.lit_gpt",
    "StabilityMonitor": "stabilizer.callbacks.monitor",
    "StabilizerDataModule": "stabilizer.callbacks.demo.datamodule",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'stabilizer' has no attribute {name!r}")
