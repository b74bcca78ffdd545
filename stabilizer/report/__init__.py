"""Post-mortem reports: a finished run's log in, findings explained out.

`diagnose` (`stabilizer.replay.diagnose`) streams one log through the detectors, a fresh engine
per segment of a restarted run, and keeps what the reports need: findings, segments, notes and a
bounded `History`. The reports render a `Diagnosis`:

    text = render_text(diagnose("runs/megatron.log"))

- `render_text` / `render_markdown`: header, timeline of incidents with cause and remedy (the
  kinds table, `stabilizer.core.kinds`, and `advice`), verdict; `report_dict`: the JSON report;
- `stabilizer.report.plot.plot_diagnosis`: a PNG (the extra ``plot``), and
  `stabilizer.report.tensorboard_export.TensorBoardExport`: the replayed signals, the heatmap and
  the findings as TensorBoard events. Neither is imported here: matplotlib is optional and
  TensorBoard's protos take time to import, which a plain report does not need.
"""

from __future__ import annotations

from stabilizer.core.advice import REMEDY_TEXT, remedy_text
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

from .causes import advice_for
from .incidents import Incident, incidents
from .json_report import report_dict
from .markdown import render_markdown
from .text import render_text
from .verdict import verdict

__all__ = [
    "REMEDY_TEXT",
    "Diagnosis",
    "Failure",
    "History",
    "Incident",
    "Located",
    "RecordSink",
    "Segment",
    "advice_for",
    "diagnose",
    "exit_code",
    "incidents",
    "remedy_text",
    "render_markdown",
    "render_text",
    "report_dict",
    "severity_counts",
    "verdict",
]
