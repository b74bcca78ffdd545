"""The universal reader: any console log of steps and metrics, read the way a person reads it.

`reader` holds the loop a line goes through; `steps` finds its step (the one list of counter
names, `COUNTERS`), `values` its metrics, `tables` writes table rows out as metrics, `joiner`
puts lines together into records. See docs/readers.md for the rules and the logs behind them.
"""

from .reader import UniversalReader, unreadable_message

__all__ = ["UniversalReader", "unreadable_message"]
