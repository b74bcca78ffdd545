"""Whether a change to the readers or to `diagnose` left every reading and every finding as it was.

Dumps, for every log it knows, what `diagnose` makes of it and what the readers read: the
format, the notes, the segments, every finding (whole), a digest of every item the reader
yields (each record's step and values, restarts, the trainer's words) and of the text report;
and, for every text log, a digest of the items the universal reader yields when told to read it
(``--format generic``: every line of every real log through the reader that learns templates,
whatever reader detection picks). The logs: tests/fixtures/real/, tests/fixtures/logs/,
tests/fixtures/hostile/, the shared real logs, and the throughput benchmark's generated logs
(every text format). Run it on two trees and compare::

    python benchmarks/reading_identical.py dump before.json     # PYTHONPATH=<old tree>
    python benchmarks/reading_identical.py dump after.json
    python benchmarks/reading_identical.py compare before.json after.json

``compare`` lists every log whose dump differs, and what part, and exits 1 if one does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root after PYTHONPATH's tree
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks.diagnose_throughput import write_text
from stabilizer.core.records import Finding, StepRecord
from stabilizer.replay.readers import Item, LogReadError, Restart, read_log
from stabilizer.report import diagnose, render_text

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = (
    ROOT / "tests" / "fixtures" / "real" / "logs",
    ROOT / "tests" / "fixtures" / "logs",
    ROOT / "tests" / "fixtures" / "hostile",
    ROOT.parent / "shared" / "reallogs" / "logs",  # (../shared from a worktree)
)
GENERATED_LINES = 20_000  # lines of each generated log: every format's templates, many times


def item_text(item: Item) -> str:
    """One item as a line of text that tells every difference (NaN and -0.0 too: `repr`)."""
    if isinstance(item, StepRecord):
        values = ",".join(f"{key}={value!r}" for key, value in item.values.items())
        return f"record {item.step} {values}"
    if isinstance(item, Restart):
        return f"restart {item.step} {item.line} {item.why}"
    if isinstance(item, Finding):
        return "finding " + json.dumps(item.to_dict(), sort_keys=True)
    return f"{type(item).__name__} {item!r}"


def digest(lines: Iterable[str]) -> tuple[int, str]:
    """How many lines, and the SHA-256 of them all."""
    sha, count = hashlib.sha256(), 0
    for line in lines:
        sha.update(line.encode("utf-8", "surrogatepass") + b"\n")
        count += 1
    return count, sha.hexdigest()


def items_of(path: Path, format: str) -> dict[str, Any]:
    """The digest of the items a reader yields for ``path``, or the error it raised."""
    try:
        count, sha = digest(item_text(item) for item in read_log(path, format))
    except LogReadError as exc:
        return {"error": str(exc)}
    return {"items": count, "sha256": sha}


def diagnosis_of(path: Path) -> dict[str, Any]:
    """What `diagnose` makes of ``path`` (auto-detected), or the error it raised."""
    try:
        found = diagnose(str(path))
    except LogReadError as exc:
        return {"error": str(exc)}
    report = render_text(found).replace(str(path.parent), "<folder>")  # (a temporary one)
    return {
        "format": found.format,
        "notes": [repr(note) for note in found.notes],
        "segments": [repr(segment) for segment in found.segments],
        "findings": [
            [item.segment, json.dumps(item.finding.to_dict(), sort_keys=True)]
            for item in found.findings
        ],
        "report_sha256": hashlib.sha256(report.encode()).hexdigest(),
        "items": items_of(path, "auto"),
    }


def logs() -> list[Path]:
    """Every log file of `FOLDERS` (each folder once), sorted."""
    seen: set[Path] = set()
    found: list[Path] = []
    for folder in FOLDERS:
        if not folder.is_dir() or folder.resolve() in seen:
            continue
        seen.add(folder.resolve())
        found += sorted(path for path in folder.rglob("*") if path.is_file())
    return found


def dump(out: Path, lines: int) -> None:
    """Write the dump of every log to ``out`` (JSON)."""
    result: dict[str, Any] = {}
    for path in logs():
        name = f"{path.parent.name}/{path.name}"
        result[name] = {"diagnose": diagnosis_of(path), "generic": items_of(path, "generic")}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt, path in write_text(Path(tmp), lines).items():
            result[f"generated/{fmt}"] = {
                "diagnose": diagnosis_of(path),
                "generic": items_of(path, "generic"),
            }
    out.write_text(json.dumps(result, indent=1, sort_keys=True), encoding="utf-8")
    print(f"{len(result)} logs dumped to {out}")


def compare(before: Path, after: Path) -> int:
    """Print every log whose dumps differ, and how; 1 if any does, else 0."""
    old = json.loads(before.read_text(encoding="utf-8"))
    new = json.loads(after.read_text(encoding="utf-8"))
    differing = 0
    for name in sorted(set(old) | set(new)):
        if old.get(name) == new.get(name):
            continue
        differing += 1
        parts = sorted(
            f"{how}.{key}"
            for how in ("diagnose", "generic")
            for key in set(old.get(name, {}).get(how, {})) | set(new.get(name, {}).get(how, {}))
            if old.get(name, {}).get(how, {}).get(key) != new.get(name, {}).get(how, {}).get(key)
        )
        print(f"DIFFERENT {name}: {', '.join(parts) or 'missing on one side'}")
    print(f"{len(set(old) | set(new))} logs compared, {differing} different")
    return int(differing > 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    dumping = commands.add_parser("dump", help="dump every log's reading and findings")
    dumping.add_argument("out", type=Path)
    dumping.add_argument("--lines", type=int, default=GENERATED_LINES)
    comparing = commands.add_parser("compare", help="compare two dumps")
    comparing.add_argument("before", type=Path)
    comparing.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "dump":
        dump(args.out, args.lines)
    else:
        sys.exit(compare(args.before, args.after))


if __name__ == "__main__":
    main()
