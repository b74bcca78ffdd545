"""The ``stabilizer`` command line.

Exit codes: 0 success, 1 a failure the command reports, 2 usage errors (click's convention).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from .scenarios import PRECISIONS, SCENARIOS, get_scenario

if TYPE_CHECKING:
    from .model import GPT

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
    help="Failure scenario to reproduce (see `stabilizer.scenarios`).",
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
    help="TensorBoard logs go to LOG_DIR/SCENARIO/version_N.",
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
    sample: int,
) -> None:
    """Train the reference GPT on real text and write TensorBoard logs.

    Runs one scenario for a short while (about half a minute on 2 CPU cores for the default),
    prints where the logs are and a summary, then samples some text from the trained model.
    """
    from dataclasses import replace

    from stabilizer.data import CorpusError, load_corpus

    sc = get_scenario(scenario)
    if precision is not None:
        sc = replace(sc, precision=precision)
    try:
        corpus = load_corpus(data)  # build the cache now: errors surface before training starts
    except CorpusError as e:
        raise click.BadParameter(str(e), param_hint="'--data'") from None
    from stabilizer.callbacks.monitor import StabilityMonitor, format_finding
    from stabilizer.callbacks.run import run_scenario  # Lightning only loads for this command

    _quiet_lightning()  # after the import: importing lightning resets its loggers' levels

    click.echo(f"stabilizer demo: scenario {sc.name!r}: {sc.summary}")
    click.echo(
        f"corpus: {corpus.source}, {len(corpus.train):,} train / {len(corpus.val):,} val bytes"
    )
    start = time.perf_counter()
    monitor = StabilityMonitor()
    run = run_scenario(
        sc,
        steps=steps,
        accelerator=device,
        callbacks=[monitor],
        logger=True,
        log_dir=log_dir,
        data=data,
        progress=True,
    )
    elapsed = time.perf_counter() - start
    metrics = {k: float(v) for k, v in run.trainer.callback_metrics.items()}
    click.echo(f"TensorBoard logs: {run.trainer.log_dir}  (view: tensorboard --logdir {log_dir})")
    click.echo(
        f"{sc.name}: {run.trainer.global_step} steps in {elapsed:.1f} s on "
        f"{run.trainer.accelerator.__class__.__name__.removesuffix('Accelerator').lower()}, "
        f"train loss {metrics.get('train/loss', float('nan')):.3f}, "
        f"val loss {metrics.get('val/loss', float('nan')):.3f}"
    )
    click.echo(f"findings: {len(monitor.findings) or 'none'}")
    for finding in monitor.findings:
        click.echo(f"  {format_finding(finding)}")
    if sample:
        click.echo("--- sample ---")
        click.echo(_sample_text(run.module.model, corpus.decode, sample))


def _sample_text(model: GPT, decode: Callable[[list[int]], str], n: int) -> str:
    import torch

    model.eval()
    device = next(model.parameters()).device
    prompt = torch.tensor([list(b"def ")], device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    out = model.generate(prompt, n, temperature=0.8, top_k=40, generator=gen)
    return decode(out[0].tolist())


def _quiet_lightning() -> None:
    # The demo prints its own summary; Lightning's banners and tips would drown it.
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*litlogger.*")
