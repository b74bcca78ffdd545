"""The universal reader: any console log of steps and metrics, read the way a person reads it.

`reader` holds the loop a line goes through and the `Joiner` that puts lines together into
records; `templates` reads a record line whose template it has learnt by one match; `steps`
finds a line's step (the one list of counter names, `COUNTERS`), `values` its
metrics, `tables` writes table rows out as metrics. The rules and the logs behind them:
docs/readers.md.
"""

from .reader import UniversalReader, unreadable_message

__all__ = ["UniversalReader", "unreadable_message"]
