"""The TensorBoard reader: the scalars of event files (``events.out.tfevents.*``), none sampled.

`reader` groups the scalars of each step into a record and tells restarts; `frames` cuts the
file into TFRecord frames (length CRCs checked); `events` decodes the scalars of each event,
fast for the layouts it has seen. How and why: docs/readers.md.
"""

from .reader import WINDOW, TensorBoardReader, merge_steps

__all__ = ["WINDOW", "TensorBoardReader", "merge_steps"]
