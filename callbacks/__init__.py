"""The Lightning layer of stabilizer (installed as ``stabilizer.callbacks``).

The only package that imports Lightning, and a host of the step (`stabilizer.step`): the
monitor's hooks (`StabilityMonitor`), the Trainer as the step's host (`LightningHost`); and the
reference GPT's LightningModule and DataModule, fault injection for the failure scenarios.
"""

from stabilizer.callbacks.demo.datamodule import StabilizerDataModule
from stabilizer.callbacks.demo.faults import FaultInjector
from stabilizer.callbacks.demo.lit_gpt import LitGPT, warmup_cosine
from stabilizer.step.policies import Auto, Observe, Protect

from .monitor import StabilityMonitor

__all__ = [
    "Auto",
    "FaultInjector",
    "LitGPT",
    "Observe",
    "Protect",
    "StabilityMonitor",
    "StabilizerDataModule",
    "warmup_cosine",
]
