"""Post-mortem reports: a finished run's log in, findings explained out.

`diagnose` (`stabilizer.replay.diagnose`) streams one log (any format `stabilizer.replay.readers`
reads) through the detectors, a fresh `stabilizer.core.engine.Engine` per segment of a restarted
run, and keeps only what the reports need: findings, segments, notes and a bounded `History`.
The reports render a `Diagnosis`:

    from stabilizer.report import diagnose, render_text

    diagnosis = diagnose("runs/megatron.log")
    text = render_text(diagnosis)

- `render_text` / `render_markdown`: header, timeline of episodes with cause and remedy (from the
  kinds table, `stabilizer.core.kinds`, and `advice`), verdict;
- `report_dict`: the JSON report of several inputs;
- `stabilizer.report.plot.plot_diagnosis`: a PNG (needs matplotlib, the extra ``plot``);
- `stabilizer.report.tensorboard_export.TensorBoardExport`: the replayed signals, the heatmap and
  the findings as TensorBoard events.

The last two are not imported here: matplotlib is optional and TensorBoard's protos take time to
import, which a plain report does not need.
"""

from __future__ import annotations

from stabilizer.replay.diagnose import (
    Diagnosis,
    Failure,
    Located,
    RecordSink,
    Segment,
    diagnose,
    exit_code,
    severity_counts,
)
from stabilizer.replay.history import History

from .advice import REMEDY_TEXT, advice_for, remedy_text
from .episodes import Episode, episodes
from .json_report import report_dict
from .markdown import render_markdown
from .text import render_text
from .verdict import verdict

__all__ = [
    "REMEDY_TEXT",
    "Diagnosis",
    "Episode",
    "Failure",
    "History",
    "Located",
    "RecordSink",
    "Segment",
    "advice_for",
    "diagnose",
    "episodes",
    "exit_code",
    "remedy_text",
    "render_markdown",
    "render_text",
    "report_dict",
    "severity_counts",
    "verdict",
]
