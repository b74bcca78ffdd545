"""The README's commands run as written after its set-up command, from a clean clone's point
of view: the venv is not on PATH (#21: `sh examples/ci_gate.sh runs/hf_gpt2` failed with
`stabilizer: not found` after `make demo`). Its console samples are the current output."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
VENV = ROOT / ".venv" / "bin"
PROGRAMS = ("python", "python3", "pip", "sh", "make", "stabilizer", "tensorboard", "pytest")
# What a clean machine has without the venv on PATH (`echo` for the `$ echo $?` of a sample).
BARE = ("make", "sh", "python3", "echo")

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_SPAN = re.compile(r"`([^`\n]+)`")


def commands(text: str) -> list[str]:
    """Every command the README gives: lines of ``bash`` blocks, ``$`` lines of ``console``
    blocks, and code spans that start with a program and pass it an argument (``stabilizer
    diagnose`` alone names the command; ``stabilizer diagnose runs`` runs it)."""
    found: list[str] = []
    for lang, body in _FENCE.findall(text):
        lines = [line.split("  #")[0].strip() for line in body.splitlines()]
        if lang == "bash":
            found += [line for line in lines if line and not line.startswith("#")]
        elif lang == "console":
            found += [line[2:] for line in lines if line.startswith("$ ")]
    prose = _FENCE.sub("", text)
    for span in _SPAN.findall(prose):
        words = span.split()
        program = words[0]
        if program not in PROGRAMS and not program.startswith(".venv/bin/"):
            continue
        subcommand = program.endswith("stabilizer")  # demo / diagnose
        if len(words) > 1 + subcommand:
            found.append(span)
    return found


def clean_env() -> dict[str, str]:
    """The environment of a new shell in a clean clone after `make`: no venv on PATH."""
    venvs = {str(VENV), str(Path(sys.executable).parent)}
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p not in venvs]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, "PATH": os.pathsep.join(path)}


def _made() -> None:
    if not (VENV / "stabilizer").exists():
        pytest.skip("the README's set-up (make) did not make this checkout's .venv")


def test_the_readme_gives_its_commands() -> None:
    found = commands(README)
    assert "make demo" in found and "sh examples/ci_gate.sh runs/hf_gpt2" in found
    assert ".venv/bin/stabilizer diagnose examples/logs/megatron_gpt345m.log" in found
    assert len(found) > 20


@pytest.mark.parametrize("command", commands(README))
def test_each_command_runs_without_the_venv_on_path(command: str) -> None:
    """Its program is one a clean shell has, or the venv's by path; its files are there."""
    _made()
    words = shlex.split(command)
    program = words[0]
    if program.startswith(".venv/bin/"):
        assert (ROOT / program).is_file(), f"{command}: {program} is not made by make"
    else:
        assert program in BARE, f"{command}: {program} is not on a clean PATH: use .venv/bin/"
    for word in words[1:]:
        if word.endswith((".py", ".sh")):
            assert (ROOT / word).is_file(), f"{command}: no {word}"


def test_the_ci_gate_finds_the_command_without_the_venv_on_path() -> None:
    _made()
    log = "examples/logs/nanogpt_shakespeare_char.log"  # a divergence: error
    gate = subprocess.run(
        ["sh", "examples/ci_gate.sh", log],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=clean_env(),
    )  # fmt: skip
    assert gate.returncode == 1, gate.stderr
    assert "loss divergence" in gate.stdout


def test_the_console_samples_are_the_current_output() -> None:
    """Each ``console`` block's ``$`` command, run as written, prints what the block shows."""
    _made()
    for lang, body in _FENCE.findall(README):
        if lang != "console":
            continue
        shown = body.split("$ ")[1:]
        [run, status] = shown  # a command, then `echo $?`
        command, _, want = run.partition("\n")
        done = subprocess.run(
            shlex.split(command), cwd=ROOT, capture_output=True, text=True, timeout=300,
            env=clean_env(),
        )  # fmt: skip
        assert done.stdout == want, command
        assert status.startswith("echo $?\n") and status.split("\n")[1] == str(done.returncode)


@pytest.mark.slow
def test_the_console_sample_of_the_nan_scenario_is_its_output(tmp_path: Path) -> None:
    """The README's console lines of ``stabilizer demo --scenario nan``, as printed now (but the
    times, which vary)."""
    _made()
    intro = "from `stabilizer demo\n--scenario nan`, copied as printed"
    sample = README.split(intro)[1].split("```text\n")[1].split("```")[0]
    done = subprocess.run(
        [str(VENV / "stabilizer"), "demo", "--scenario", "nan", "--sample", "0", "--device", "cpu"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env=clean_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    printed = [line for line in done.stderr.splitlines() if line.startswith("stabilizer: ")]

    def timeless(lines: list[str]) -> list[str]:
        # What varies by machine: the replay's time, the monitor's measured cost (and its one
        # warning when a loaded machine puts it over the budget).
        lines = [line for line in lines if not line.startswith("stabilizer: monitor cost")]
        lines = [re.sub(r"replay \d+\.\d+ s", "replay N s", line) for line in lines]
        return [re.sub(r"monitor cost .*?(?=; details:|$)", "monitor cost N", x) for x in lines]

    assert timeless(printed) == timeless(sample.splitlines())


def test_the_remedies_name_their_article() -> None:
    """docs/remedies.md names the article its remedies come from, and the section (§6.3)."""
    text = (ROOT / "docs" / "remedies.md").read_text(encoding="utf-8")
    head = text.split("\n## ")[0]
    assert "《Transformer 到 GPT：自注意力如何取代循环" in head and "§6.3" in head
    assert "https://aihist.net/go/csdn05" in head


def test_the_watch_transcript_is_the_output_of_watch() -> None:
    """#33: the README's `watch` transcript showed a critical line no watch could print (updates
    of an episode were no alerts). Its lines, but the times, are what ``stabilizer watch -``
    prints for the Megatron log it stands for."""
    block = README.split("$ torchrun --nproc-per-node 8 pretrain_gpt.py")[1].split("^C")[0]
    shown = [line[9:] for line in block.splitlines() if re.match(r"\d\d:\d\d:\d\d ", line)]
    log = (ROOT / "examples" / "logs" / "megatron_gpt345m.log").read_bytes()
    done = subprocess.run(
        [sys.executable, "-c", "from stabilizer.cli import main; main()", "watch", "-"],
        input=log, capture_output=True, timeout=300,
    )  # fmt: skip
    printed = [line[9:] for line in done.stdout.decode().splitlines()[: len(shown)]]
    assert len(shown) == 5 and "critical nonfinite_loss" in shown[-1]
    assert printed == shown


def _sample_after(intro: str) -> list[str]:
    """The lines of the first ``text`` block after `intro` in the README."""
    return README.split(intro)[1].split("```text\n")[1].split("```")[0].splitlines()


def _same_but_times(lines: list[str]) -> list[str]:
    """What varies by machine left out: the replay's time, the monitor's cost (and its one
    warning when a loaded machine puts it over the budget)."""
    lines = [line for line in lines if not line.startswith("stabilizer: monitor cost")]
    lines = [re.sub(r"replay \d+\.\d+ s", "replay N s", line) for line in lines]
    return [re.sub(r"monitor cost .*?(?=; details:|$)", "monitor cost …", x) for x in lines]


HOSTS = [
    ("examples/plain_loop.py", "plain_loop", "plain_loop"),
    ("examples/fabric.py", "plain_loop", "fabric"),  # the README says: the same lines
    ("examples/hf_trainer.py", "hf_trainer", "hf_trainer"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("script", "sample", "runs"), HOSTS, ids=[h[2] for h in HOSTS])
def test_the_console_samples_of_the_other_hosts_are_their_output(
    tmp_path: Path, script: str, sample: str, runs: str
) -> None:
    """The README's console lines of the plain-loop, Fabric and HF Trainer examples, as they
    print them now (run as the README gives them, from a fresh directory)."""
    _made()
    if runs == "hf_trainer" and not os.environ.get("CI"):
        pytest.importorskip("transformers")
    shown = _sample_after(f"`.venv/bin/python examples/{sample}.py --steps 40 --nan-at 20`")
    shown = [line.replace(f"runs/{sample}/", f"runs/{runs}/") for line in shown]
    done = subprocess.run(
        [str(VENV / "python"), str(ROOT / script), "--steps", "40", "--nan-at", "20"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env=clean_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    printed = [line for line in done.stderr.splitlines() if line.startswith("stabilizer: ")]
    assert _same_but_times(printed) == _same_but_times(shown)


def test_the_readme_counts_the_real_logs() -> None:
    """#41: the README said 92 real logs where tests/fixtures/real/ held 111."""
    labels = (ROOT / "tests" / "fixtures" / "real" / "labels.jsonl").read_text(encoding="utf-8")
    said = re.search(r"`tests/fixtures/real/` holds (\d+) real", README.replace("\n", " "))
    assert said is not None
    assert int(said.group(1)) == len([line for line in labels.splitlines() if line.strip()])
