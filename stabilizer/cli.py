"""The ``stabilizer`` command line.

Exit codes: 0 success, 1 a failure the command reports, 2 usage errors (click's convention).
``stabilizer diagnose`` imports neither torch nor Lightning; ``stabilizer demo`` loads them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from stabilizer.core.records import Severity
from stabilizer.demo.scenarios import PRECISIONS, SCENARIOS, get_scenario
from stabilizer.outputs.event_file import tensorboard_command
from stabilizer.outputs.notify import ENV_WEBHOOK
from stabilizer.replay.readers import FORMAT_ALIASES, READERS
from stabilizer.report import (
    Diagnosis,
    Failure,
    exit_code,
    render_markdown,
    render_text,
    report_dict,
)
from stabilizer.report.advising import advised_run
from stabilizer.report.inputs import Wrap
from stabilizer.report.session import (
    OutputError,
    Outputs,
    diagnose_input,
    expand_runs,
    plan_outputs,
    progress_bar,
    warnings_as_lines,
)
from stabilizer.report.text import render_overall
from stabilizer.report.watching import WATCH_HELP, WatchSession

__all__ = ["main"]

_DEVICES = ("auto", "cpu", "cuda", "gpu", "mps")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="stabilizer-lightning", prog_name="stabilizer")
def main() -> None:
    """Catch, prevent and explain training instabilities of Transformers."""


@main.command()
@click.option(
    "--scenario",
    type=click.Choice(list(SCENARIOS)),
    default="healthy",
    show_default=True,
    help="Failure scenario to reproduce (see `stabilizer.demo.scenarios`).",
)
@click.option("--steps", type=click.IntRange(min=1), help="Optimizer steps [default: scenario's].")
@click.option(
    "--device",
    type=click.Choice(_DEVICES),
    default="auto",
    show_default=True,
    help="Lightning accelerator; auto uses the GPU when there is one.",
)
@click.option(
    "--precision",
    type=click.Choice(PRECISIONS),
    help="Numeric precision [default: scenario's]; fp16 is mixed precision with loss scaling.",
)
@click.option(
    "--data",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Train on this text file instead of the Python standard library's sources.",
)
@click.option(
    "--log-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("runs"),
    show_default=True,
    help="TensorBoard logs go to LOG_DIR/SCENARIO/version_N (with --data FILE: "
    "LOG_DIR/SCENARIO-FILE/version_N, FILE without its suffix).",
)
@click.option(
    "--policy",
    type=click.Choice(["protect", "observe", "auto"]),
    default="protect",
    show_default=True,
    help="The monitor's policy: observe reports, protect also skips NaN/Inf steps, auto also "
    "applies the remedies.",
)
@click.option(
    "--sample",
    type=click.IntRange(min=0),
    default=240,
    show_default=True,
    help="Bytes of text to generate after training (0: none).",
)
def demo(
    scenario: str,
    steps: int | None,
    device: str,
    precision: str | None,
    data: Path | None,
    log_dir: Path,
    policy: str,
    sample: int,
) -> None:
    """Train the reference GPT on real text and write TensorBoard logs.

    Runs one scenario for a short while (about half a minute on 2 CPU cores for the default),
    prints where the logs are and a summary, then samples some text from the trained model.
    """
    from dataclasses import replace

    from stabilizer.demo.data import CorpusError, load_corpus

    sc = get_scenario(scenario)
    if precision is not None:
        sc = replace(sc, precision=precision)
    try:
        corpus = load_corpus(data)  # build the cache now: errors surface before training starts
    except CorpusError as e:
        raise click.BadParameter(str(e), param_hint="'--data'") from None
    # Lightning only loads for this command
    from stabilizer.callbacks.demo.run import (
        cpu_threads,
        quiet_lightning,
        run_scenario,
        sample_text,
    )
    from stabilizer.callbacks.demo.summary import missing, run_lines
    from stabilizer.callbacks.monitor import StabilityMonitor

    if missing(device):  # one line and exit 2, not Lightning's traceback
        raise click.BadParameter(missing(device), param_hint="'--device'")
    quiet_lightning()  # after the import: importing lightning resets its loggers' levels

    click.echo(f"stabilizer demo: scenario {sc.name!r}: {sc.summary}")
    click.echo(
        f"corpus: {corpus.source}, {len(corpus.train):,} train / {len(corpus.val):,} val bytes"
    )
    threads = cpu_threads(device)
    if threads:
        click.echo(threads)
    start = time.perf_counter()
    monitor = StabilityMonitor(policy=policy)
    name = sc.name if data is None else f"{sc.name}-{data.stem}"  # not the stdlib's "healthy"
    # Lightning's default cadence is 50; every step's logging would cost this tiny model's short
    # step more than the monitor does (spikes are logged at their steps anyway)
    run = run_scenario(
        sc, steps=steps, accelerator=device, callbacks=[monitor], logger=True, log_dir=log_dir,
        name=name, data=data, progress=True, trainer_args={"log_every_n_steps": 10},
    )  # fmt: skip
    elapsed = time.perf_counter() - start
    click.echo(f"TensorBoard logs: {run.trainer.log_dir}  (view: {tensorboard_command(log_dir)})")
    jsonl = Path(run.trainer.log_dir or log_dir) / "stability.jsonl"
    found = advised_run(monitor.findings, jsonl)  # one per episode, as the console counts
    for line in run_lines(sc.name, run.trainer, elapsed, monitor.skipped_steps, policy, found):
        click.echo(line)
    if sample:
        click.echo("--- sample ---")
        click.echo(sample_text(run.module.model, corpus.decode, sample))


_SEVERITIES = [severity.name.lower() for severity in Severity]


@main.command(name="diagnose")
@click.argument("paths", nargs=-1, required=True, metavar="PATH...")
@click.option(
    "--format",
    "format_",
    type=click.Choice(["auto", *READERS, *FORMAT_ALIASES]),
    default="auto",
    show_default=True,
    help="Log format; auto detects it from the first lines. generic reads any console log "
    "(nanogpt, modded_nanogpt: the same).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--markdown", is_flag=True, help="Print the report as markdown.")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Save loss, gradient norm, loss scale and a per-layer heatmap as this PNG "
    "(needs matplotlib; with several PATHs: FILE-1.png, FILE-2.png, ...).",
)
@click.option(
    "--tensorboard",
    "tb_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write the replayed signals, the heatmap and the findings as TensorBoard events in "
    "this new or empty directory (with several PATHs: one run per PATH inside it).",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace an existing --plot file; write --tensorboard into a directory that is not "
    "empty, replacing an earlier replay there.",
)
@click.option(
    "--fail-on",
    type=click.Choice(_SEVERITIES),
    default="warning",
    show_default=True,
    help="Exit 1 when a finding is at least this severe.",
)
@click.pass_context
def diagnose(
    ctx: click.Context,
    paths: tuple[str, ...],
    format_: str,
    as_json: bool,
    markdown: bool,
    plot: Path | None,
    tb_dir: Path | None,
    force: bool,
    fail_on: str,
) -> None:
    """Diagnose finished runs from their logs: what went wrong, when, where, and what to do.

    PATH is a log file (plain or .gz), a run directory (TensorBoard, Lightning CSV, HF Trainer
    output, a W&B run folder), a tracker's store (mlflow.db, mlruns/, a trackio project's .db,
    mlflow:URI for a tracking server, a W&B CSV export; STORE#RUN for one run) or - for standard
    input. Formats: the monitor's stability.jsonl, Lightning metrics.csv, TensorBoard event
    files and downloads, the console logs of Megatron-LM, DeepSpeed, the Hugging Face Trainer
    and fairseq, and any other console log that prints steps and metrics (generic: nanoGPT,
    llm.c, Keras, tqdm bars, ...). Each PATH is diagnosed on its own; a directory or store of
    several runs (runs/, lightning_logs/, wandb/, mlflow.db) is each of its runs, then one
    overall line.

    Exit status: 0 when no finding is at or above --fail-on, 1 when one is, 2 for a usage error,
    an unreadable input or an output that cannot be written (the worst over all PATHs).
    """
    if as_json and markdown:
        raise click.UsageError("--json and --markdown exclude each other")
    if paths.count("-") > 1:
        raise click.UsageError("- (standard input) can be given only once")
    paths = tuple(expand_runs(paths, format_))  # a directory of runs: each run
    try:
        plans = plan_outputs(paths, plot, tb_dir, force)
    except OutputError as exc:
        _fail(str(exc))
        ctx.exit(2)
    severity = Severity.parse(fail_on)
    render = None if as_json else render_markdown if markdown else render_text
    try:
        outcomes = _diagnose_all(paths, format_, plans, render, severity)
        if tb_dir is not None and any(isinstance(o, Diagnosis) for o in outcomes):
            # one TensorBoard for every run written (several PATHs: one run each inside it)
            _tell(f"stabilizer diagnose: view: {tensorboard_command(tb_dir)}")
        if as_json:
            _say(json.dumps(report_dict(outcomes, severity), indent=2, allow_nan=False))
        elif len(paths) > 1:
            _say("\n" + render_overall(outcomes, severity))
    except _StdoutFailed as exc:
        _fail(f"cannot write to standard output ({exc})")
        _silence_stdout()
        ctx.exit(2)
    ctx.exit(max(exit_code(outcome, severity) for outcome in outcomes))


def _diagnose_all(
    paths: tuple[str, ...],
    format_: str,
    plans: list[Outputs],
    render: Callable[[Diagnosis, Severity], str] | None,
    severity: Severity,
) -> list[Diagnosis | Failure]:
    """Diagnose each input in turn, printing its report (unless ``render`` is None: JSON)."""
    outcomes: list[Diagnosis | Failure] = []
    with warnings_as_lines(sys.stderr, "stabilizer diagnose"):
        for index, (path, outputs) in enumerate(zip(paths, plans, strict=True), 1):
            with contextlib.ExitStack() as stack:
                progress = _progress(path, stack)  # (shown once the reading takes a while)
                outcome, messages = diagnose_input(path, format_, outputs, progress)
            outcomes.append(outcome)
            if isinstance(outcome, Failure):
                _fail(outcome.message)
            elif render is not None:
                _say(("\n" if index > 1 else "") + render(outcome, severity))
            for message in messages:
                _tell(f"stabilizer diagnose: {message}")
    return outcomes


class _StdoutFailed(Exception):
    """Standard output cannot be written (a full disk, a closed pipe); the message says why."""


def _say(text: str) -> None:
    """Print ``text`` on standard output."""
    try:
        click.echo(text)
    except OSError as exc:
        raise _StdoutFailed(exc.strerror or str(exc)) from None


def _silence_stdout() -> None:
    """Point standard output at the null device: Python flushes it on exit, which would fail
    again, with a traceback."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _tell(line: str) -> None:
    """Print ``line`` on standard error; if even that fails, there is no one left to tell."""
    with contextlib.suppress(OSError):
        click.echo(line, err=True)


def _fail(message: str) -> None:
    _tell(f"stabilizer diagnose: error: {message}")


def _stderr_is_terminal() -> bool:
    return sys.stderr.isatty()


def _progress(path: str, stack: contextlib.ExitStack) -> Wrap | None:
    """A progress bar on stderr, by bytes of the input read, on a terminal."""
    if not _stderr_is_terminal():
        return None
    name = "standard input" if path == "-" else path
    return progress_bar(f"reading {name}", stack, sys.stderr)


@main.command(name="watch")
@click.argument("paths", nargs=-1, required=True, metavar="PATH...")
@click.option(
    "--format",
    "format_",
    type=click.Choice(["auto", *READERS, *FORMAT_ALIASES]),
    default="auto",
    show_default=True,
    help="Log format; auto detects it from the first lines.",
)
@click.option("--from-start", is_flag=True, help=WATCH_HELP["from_start"])
@click.option("--exit-on", type=click.Choice(_SEVERITIES), help=WATCH_HELP["exit_on"])
@click.option(
    "--fail-on", type=click.Choice(_SEVERITIES), default="warning", help=WATCH_HELP["fail_on"]
)
@click.option("--exec", "command", metavar="CMD", help=WATCH_HELP["exec"])
@click.option("--webhook", metavar="URL", envvar=ENV_WEBHOOK, help=WATCH_HELP["webhook"])
@click.option(
    "--notify-on", type=click.Choice(_SEVERITIES), default="error", help=WATCH_HELP["notify_on"]
)
@click.option("--notify-close", is_flag=True, help=WATCH_HELP["notify_close"])
@click.pass_context
def watch(ctx: click.Context, /, paths: tuple[str, ...], format_: str, **options: Any) -> None:
    """Follow running jobs' logs and report each finding the moment it is found.

    PATH is a log file (it may appear later, rotate or be truncated), a folder (the newest run
    below it, at any depth, its richest log: stability.jsonl, then an event file, metrics.csv,
    *.log or *.out; a run that starts later below it is followed too) or - for standard input
    (torchrun ... | tee log | stabilizer watch -), in any format diagnose reads. Each finding
    is printed as it is found, with the wall time; Ctrl-C, SIGTERM or the end of standard input
    prints the report diagnose would print.

    Exit status: 1 at the first finding at or above --exit-on; otherwise, at the end, 0 when
    no finding is at or above --fail-on, 1 when one is, 2 for a usage error or an input that
    cannot be read.
    """
    if paths.count("-") > 1:
        raise click.UsageError("- (standard input) can be given only once")
    try:
        session = WatchSession.of_options(paths, format_, options, _say, _tell)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--webhook'") from None
    before = signal.signal(signal.SIGTERM, _interrupt)  # a scheduler's stop: as Ctrl-C
    try:
        try:
            with warnings_as_lines(sys.stderr, "stabilizer watch"):
                outcomes = session.run()
        finally:  # (the caller's handler back however the run ends)
            signal.signal(signal.SIGTERM, before)
        for to_stderr, text in session.summary(outcomes):
            _tell(text) if to_stderr else _say(text)
    except _StdoutFailed:
        _silence_stdout()
        ctx.exit(2)
    ctx.exit(session.exit_status(outcomes))


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
