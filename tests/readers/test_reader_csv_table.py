"""`CsvTableReader`: any CSV with a step or epoch column and loss-like columns."""

from __future__ import annotations

import math

from reader_cases import parse

from stabilizer.replay.readers import detect_format

# YOLOv5's results.csv: headers and values padded with blanks, epochs counted from 0
YOLOV5 = (
    "               epoch,      train/box_loss,      train/obj_loss,      train/cls_loss,"
    "   metrics/precision,      metrics/recall,     metrics/mAP_0.5,metrics/mAP_0.5:0.95,"
    "        val/box_loss,        val/obj_loss,        val/cls_loss,               x/lr0\n"
    "                   0,             0.07348,            0.027402,            0.02,"
    "             0.1,            0.2,           0.05,           0.02,"
    "            0.06,           0.03,            0.02,         0.0033\n"
    "                   1,                 nan,                 nan,             nan,"
    "               0,              0,              0,              0,"
    "             nan,            nan,             nan,         0.0032\n"
)


def test_a_padded_results_csv_is_read_in_epochs() -> None:
    assert detect_format(YOLOV5.splitlines()) == "csv"
    first, second = parse("csv", YOLOV5)
    assert (first.step, second.step) == (0, 1)  # the log counts epochs: so does the report
    assert math.isclose(first.values["loss"], 0.07348 + 0.027402 + 0.02)  # training parts only
    assert first.values["val/box_loss"] == 0.06 and first.values["lr"] == 0.0033  # x/lr0
    assert math.isnan(second.values["loss"])


def test_a_step_column_wins_and_a_loss_column_is_the_loss() -> None:
    text = (
        "epoch, iteration, train/loss, val/loss, lr\n0, 100, 2.5, , 1e-4\n0, 200, 2.4, 2.6, 1e-4\n"
    )
    assert detect_format(text.splitlines()) == "csv"
    got = [(r.step, r.values) for r in parse("csv", text)]
    assert got == [
        (100, {"loss": 2.5, "lr": 1e-4}),
        (200, {"loss": 2.4, "val/loss": 2.6, "lr": 1e-4}),
    ]


def test_no_counter_or_no_loss_is_no_table_of_training() -> None:
    for text in ("name, loss, time\na, 1.0, 2\n", "epoch, accuracy, time\n1, 0.9, 2\n"):
        assert detect_format(text.splitlines()) != "csv"
    assert parse("csv", "epoch, loss, lr\nx, 1.0, 2\n3, 2.0, 1e-3\n")[0].step == 3  # x: no row
