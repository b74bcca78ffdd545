"""The Lightning layer of stabilizer (installed as ``stabilizer.callbacks``).

The only package that imports Lightning. It holds no detection logic: the reference GPT's
LightningModule and DataModule, fault injection for the failure scenarios, and the trainer glue.
"""

from stabilizer.callbacks.demo.datamodule import StabilizerDataModule
from stabilizer.callbacks.demo.faults import FaultInjector
from stabilizer.callbacks.demo.lit_gpt import LitGPT, warmup_cosine

from .auto import AutoRemedies
from .monitor import StabilityMonitor

__all__ = [
    "AutoRemedies",
    "FaultInjector",
    "LitGPT",
    "StabilityMonitor",
    "StabilizerDataModule",
    "warmup_cosine",
]
