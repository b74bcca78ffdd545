"""Log readers: the replay feed. Any supported log in, a stream of items out, for the `Engine`.

    from stabilizer.replay.readers import Restart, read_log

    stream = read_log("runs/gpt/version_3")
    for item in stream:  # StepRecord, Restart, RunHeader, Finding (stability.jsonl)
        if isinstance(item, Restart):  # the run restarted here: a new segment
            print(f"restart at step {item.step}: {item.why}")
    print(stream.format, stream.notes)

`read_log` and `detect_format` live in `reading`; the items and notes in `base`; one module per
format that needs a reader of its own, the `universal` reader for every other console log. How
they read, and why: docs/readers.md.
"""

from ._lines import MAX_LINE
from ._rundir import REPLAY_SUFFIX, find_runs
from .base import (
    MAX_NOTES,
    NOTE_KINDS,
    BaseReader,
    Item,
    LogReadError,
    Note,
    Reader,
    Restart,
    add_note,
)
from .csv_table import CsvTableReader
from .deepspeed import DeepSpeedReader
from .fairseq import FairseqReader
from .hf_trainer import HfTrainerReader
from .hf_trainer_state import HfTrainerStateReader
from .jsonl import JsonlReader
from .lightning_csv import LightningCsvReader
from .megatron import MegatronReader
from .reading import FORMAT_ALIASES, READERS, LogStream, detect_format, read_log
from .tensorboard import TensorBoardReader
from .universal import UniversalReader, unreadable_message

__all__ = [
    "FORMAT_ALIASES",
    "MAX_LINE",
    "MAX_NOTES",
    "NOTE_KINDS",
    "READERS",
    "REPLAY_SUFFIX",
    "BaseReader",
    "CsvTableReader",
    "DeepSpeedReader",
    "FairseqReader",
    "HfTrainerReader",
    "HfTrainerStateReader",
    "Item",
    "JsonlReader",
    "LightningCsvReader",
    "LogReadError",
    "LogStream",
    "MegatronReader",
    "Note",
    "Reader",
    "Restart",
    "TensorBoardReader",
    "UniversalReader",
    "add_note",
    "detect_format",
    "find_runs",
    "read_log",
    "unreadable_message",
]
