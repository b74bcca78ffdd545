"""`stabilizer watch`: latency of a finding, CPU while idle, and keeping up with a fast log.

Runs the real CLI (``stabilizer watch LOG``) in a subprocess on a nanoGPT-style log in a
temporary directory and prints a table:

- latency: from writing (and flushing) the line with a NaN loss to reading the watcher's line
  about it on its standard output; the median and the worst of `--trials` NaNs. Target: ≤ 1 s.
- idle CPU: the watcher's CPU time (user + system, from ``/proc``) over `--idle` seconds in which
  nothing is written, as a share of one core. Target: ≤ 1 %.
- keeping up: `--rate` lines a second appended for `--seconds` seconds, then the time until the
  watcher has read the last of them (a NaN at the end). Target: caught up ≤ 1 s after. And
  `--burst` lines appended at once: how fast the watcher reads them (lines/s).

    python benchmarks/watch.py
    python benchmarks/watch.py --trials 3 --idle 5 --seconds 3   # quick
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

_CLI = [sys.executable, "-c", "from stabilizer.cli import main; main()", "watch"]


class _Watcher:
    def __init__(self, log: Path) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [*_CLI, str(log)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self.lines: queue.Queue[tuple[float, str]] = queue.Queue()
        self.err: queue.Queue[tuple[float, str]] = queue.Queue()
        for stream, q in ((self.proc.stdout, self.lines), (self.proc.stderr, self.err)):
            threading.Thread(target=_pump, args=(stream, q), daemon=True).start()

    def expect(self, q: queue.Queue[tuple[float, str]], text: str) -> float:
        while True:
            at, line = q.get(timeout=60)
            if text in line:
                return at

    def cpu(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def _pump(stream: object, q: queue.Queue[tuple[float, str]]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        q.put((time.monotonic(), line))


def _line(step: int, loss: str) -> str:
    return f"iter {step}: loss {loss}, time 12.34ms, mfu 30.00%\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=10, help="NaNs whose latency is measured")
    parser.add_argument("--idle", type=float, default=20.0, help="seconds of idle CPU measured")
    parser.add_argument("--rate", type=int, default=10_000, help="lines a second appended")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds of appending")
    parser.add_argument("--burst", type=int, default=200_000, help="lines appended at once")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "train.log"
        with log.open("w") as out:
            out.writelines(_line(i, f"{2.5 - i * 1e-4:.4f}") for i in range(1, 101))
        watcher = _Watcher(log)
        try:
            watcher.expect(watcher.err, "following")
            rows = _measure(watcher, log, args)
        finally:
            watcher.stop()
    load = os.getloadavg()[0]
    print(f"stabilizer watch  (load average {load:.1f} on {os.cpu_count()} cores)")
    print(f"{'measure':<34}{'value':>14}  target")
    for name, value, target in rows:
        print(f"{name:<34}{value:>14}  {target}")


def _measure(watcher: _Watcher, log: Path, args: argparse.Namespace) -> list[tuple[str, str, str]]:
    step, latencies = 101, []
    with log.open("a") as out:
        for _ in range(args.trials):
            for _ in range(30):  # healthy steps between two NaN episodes
                out.write(_line(step, "2.4000"))
                step += 1
            out.flush()
            time.sleep(0.3 + random.random() / 3)  # any phase of the watcher's polling
            out.write(_line(step, "nan"))
            out.flush()
            written = time.monotonic()
            latencies.append(watcher.expect(watcher.lines, f"step {step} error") - written)
            step += 1
        time.sleep(1.0)
        before, start = watcher.cpu(), time.monotonic()
        time.sleep(args.idle)
        idle = (watcher.cpu() - before) / (time.monotonic() - start)
        start, total = time.monotonic(), int(args.rate * args.seconds)
        for i in range(total):  # in bursts of 1/100 s, as a logger flushes
            out.write(_line(step + i, "2.4000"))
            if i % (args.rate // 100 or 1) == 0:
                out.flush()
                lag = start + i / args.rate - time.monotonic()
                if lag > 0:
                    time.sleep(lag)
        out.write(_line(step + total, "nan"))
        out.flush()
        written = time.monotonic()
        behind = watcher.expect(watcher.lines, f"step {step + total} error") - written
        elapsed = written - start
        step += total + 1
        time.sleep(1.0)
        out.writelines(_line(step + i, "2.4000") for i in range(args.burst))  # all at once
        out.write(_line(step + args.burst, "nan"))
        out.flush()
        written = time.monotonic()
        burst = watcher.expect(watcher.lines, f"step {step + args.burst} error") - written
    return [
        ("latency, median (s)", f"{statistics.median(latencies):.3f}", "<= 1 s"),
        ("latency, worst (s)", f"{max(latencies):.3f}", "<= 1 s"),
        ("idle CPU (% of a core)", f"{100 * idle:.2f}", "<= 1 %"),
        ("appended (lines/s)", f"{total / elapsed:,.0f}", ">= 10,000"),
        ("caught up after the last (s)", f"{behind:.3f}", "<= 1 s"),
        (f"{args.burst:,} lines at once (lines/s)", f"{args.burst / burst:,.0f}", ">= 10,000"),
    ]


if __name__ == "__main__":
    main()
