"""Screenshots of TensorBoard for the README: three real runs in one logdir.

A maintainer script, not a test. It trains the demo's ``healthy`` (4 blocks, pre-LN),
``post-ln-deep`` (12 blocks, post-LN: the input-side blocks starve) and ``nan`` (fp16: a NaN loss
and an overflow cascade at step 60) scenarios with a real Lightning Trainer, TensorBoardLogger and
StabilityMonitor (2 to 4 minutes on 2 CPU cores), starts ``tensorboard --logdir`` on them with
its default flags, as a user does, and has headless Chromium, driven by ``shoot.mjs`` with
playwright-core, save ``tensorboard-custom-scalars.png``, ``tensorboard-heatmap.png`` and
``tensorboard-findings.png`` in ``docs/``::

    npm install --prefix docs/screenshots --no-package-lock   # playwright-core, no browser
    .venv/bin/python docs/screenshots/make.py [--logdir DIR] [--out DIR] [--chromium PATH]

A run already in ``--logdir`` is not trained again.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import PIL.Image

from stabilizer.demo.scenarios import get_scenario
from stabilizer.outputs.tensorboard import HEATMAP_TAG

HERE = Path(__file__).resolve().parent
# written by shoot.mjs
PICTURES = ("tensorboard-custom-scalars.png", "tensorboard-heatmap.png", "tensorboard-findings.png")
RUNS = {"healthy": "healthy_4_blocks", "post-ln-deep": "post-ln-deep_12_blocks", "nan": "nan_fp16"}


def train(logdir: Path) -> None:
    """Train both scenarios into ``logdir``, one run (subfolder) each."""
    from lightning.pytorch.loggers import TensorBoardLogger

    from stabilizer.callbacks import StabilityMonitor
    from stabilizer.callbacks.demo.run import run_scenario

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    for scenario, run in RUNS.items():
        if (logdir / run).exists():
            continue
        logger = TensorBoardLogger(str(logdir), name="", version=run)
        run_scenario(scenario, accelerator="cpu", callbacks=[StabilityMonitor()], logger=logger)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _loaded(url: str, opener: urllib.request.OpenerDirector) -> bool:
    """Whether tensorboard has read every run to its end: the final heatmap image."""
    for scenario, run in RUNS.items():
        query = urllib.parse.urlencode({"run": run, "tag": HEATMAP_TAG, "sample": 0})
        try:
            with opener.open(f"{url}/data/plugin/images/images?{query}", timeout=5) as response:
                images = json.load(response)
        except (OSError, ValueError):  # not up yet, or the run not listed yet (400)
            return False
        if max((image["step"] for image in images), default=-1) < get_scenario(scenario).steps:
            return False
    return True


def _wait_until_loaded(url: str, server: subprocess.Popen[bytes]) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    for _ in range(120):
        if server.poll() is not None:
            raise SystemExit(f"tensorboard exited with {server.returncode}")
        if _loaded(url, opener):
            return
        time.sleep(1)
    raise SystemExit("tensorboard did not load the runs within 2 minutes")


def shoot(logdir: Path, out: Path, chromium: str) -> None:
    """Serve ``logdir`` with tensorboard and save the screenshots in ``out`` with shoot.mjs."""
    port = _free_port()
    tensorboard = Path(sys.executable).with_name("tensorboard")
    command = [str(tensorboard), "--logdir", str(logdir), "--host", "127.0.0.1"]
    command += ["--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as profile:
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_until_loaded(url, server)
            env = {**os.environ, "TB_URL": url, "CHROMIUM": chromium, "PROFILE": profile}
            env["OUT"] = str(out)
            subprocess.run(["node", str(HERE / "shoot.mjs")], env=env, check=True)
        finally:
            server.terminate()
            server.wait(timeout=30)
    for name in PICTURES:  # 256 colours: a third of the size, no visible change
        path = out / name
        PIL.Image.open(path).convert("RGB").quantize(256).save(path, optimize=True)
        print(f"{path}: {path.stat().st_size // 1024} KiB")


def main() -> None:
    parser = argparse.ArgumentParser(description="Screenshots of TensorBoard for the README.")
    parser.add_argument("--logdir", type=Path, help="keep the runs here (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=HERE.parent, help="default: docs/")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        logdir = args.logdir or Path(tmp)
        train(logdir)
        shoot(logdir, args.out.resolve(), args.chromium)


if __name__ == "__main__":
    main()
