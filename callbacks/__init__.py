"""The Lightning layer of stabilizer (installed as ``stabilizer.callbacks``).

The only package that imports Lightning. It holds no detection logic: the reference GPT's
LightningModule and DataModule, fault injection for the failure scenarios, and the trainer glue.
"""

from .auto import AutoRemedies
from .datamodule import StabilizerDataModule
from .faults import FaultInjector
from .lit_gpt import LitGPT, warmup_cosine
from .monitor import StabilityMonitor

__all__ = [
    "AutoRemedies",
    "FaultInjector",
    "LitGPT",
    "StabilityMonitor",
    "StabilizerDataModule",
    "warmup_cosine",
]
