"""The monitor's console: a start line, every finding once (repeats folded), one end line."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from stabilizer.callbacks.monitor import StabilityMonitor
from stabilizer.core.detectors.grad_spike import GradSpike
from stabilizer.core.records import Finding, Severity, StepRecord
from stabilizer.core.run import Cost, RunEnd
from stabilizer.replay.diagnose import diagnose
from stabilizer.step.console import FOLD_STEPS, STOP_LINE, Console, compact_groups
from stabilizer.step.cost import CAUSES, budget_verdict
from stabilizer.step.live_outputs import LiveFacts

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, SEQ = 32, 8


class TinyLM(pl.LightningModule):
    """A user's own small LM: embedding, two blocks, a head; NaN loss on chosen steps."""

    def __init__(self, nan_every: int = 0) -> None:
        super().__init__()
        self.nan_every = nan_every
        self.emb = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        out: torch.Tensor = self.head(x)
        return out

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        logits = self(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        if self.nan_every and self.global_step % self.nan_every == self.nan_every - 2:
            loss = loss * float("nan")  # a deterministic fault in the loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(
    tmp_path: Path,
    module: pl.LightningModule,
    steps: int,
    clip: float | None = 1.0,
    extra: tuple[pl.Callback, ...] = (),
    **monitor: Any,
) -> None:
    torch.manual_seed(0)
    monitor.setdefault("cost_budget", None)  # a tiny model is over any budget: see its test
    data = TensorDataset(torch.randint(0, VOCAB, (steps * 4, SEQ)))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        default_root_dir=str(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=clip,
        callbacks=[StabilityMonitor(**monitor), *extra],
    )
    trainer.fit(module, DataLoader(data, batch_size=4))


def test_start_line_and_summary_of_a_healthy_run(tmp_path: Path, printed: list[str]) -> None:
    _fit(tmp_path, TinyLM(), steps=6)
    jsonl = tmp_path / "stability_logs" / "version_0" / "stability.jsonl"  # logger=False
    assert printed[0] == (
        f"on, policy protect; 4 depth groups: embed, block_00…block_01, head; log: {jsonl}"
    )
    cost = r"monitor cost \d+\.\d ms/step \(\d+\.\d%( of this run's \d+ ms step; [^)]*)?\)"
    assert re.fullmatch(
        f"done at step 6: healthy, no findings; 0 steps skipped; {cost}; "
        f"details: stabilizer diagnose {re.escape(str(jsonl))}",
        printed[-1],
    ), printed[-1]
    assert len(printed) == 2


def test_the_monitor_says_what_it_costs(tmp_path: Path, printed: list[str]) -> None:
    # A tiny model on the CPU: the monitor's hooks are a large share of a ~ms step, over any
    # small budget. One warning says so, names the part that costs most and its knob; the end
    # line and the JSONL's last line carry the figures, measured.
    _fit(tmp_path, TinyLM(), steps=30, cost_budget=0.001)
    warned = [line for line in printed if "over its 0% budget: mostly " in line]
    assert len(warned) == 2 and warned[0].startswith("monitor cost ")  # once, then at the end
    assert "; to lower it: " in warned[0]
    jsonl = tmp_path / "stability_logs" / "version_0" / "stability.jsonl"
    end = json.loads(jsonl.read_text(encoding="utf-8").splitlines()[-1])
    assert end["type"] == "end" and end["step"] == 30 and end["intact"] is True
    cost = end["cost"]
    assert cost["steps"] == 29  # the first batch (the preflight) is left out
    assert cost["ms_per_step"] > 0 and 0 < cost["share"] < 1 and cost["budget"] == 0.001
    parts = cost["parts"]
    assert {"measure", "guard", "report"} <= set(parts)  # (TinyLM has no module to sample)
    assert set(parts) <= set(CAUSES)  # every part the run timed has its cause and knob
    assert sum(parts.values()) == pytest.approx(cost["ms_per_step"], rel=1e-3, abs=1e-3)
    assert f"monitor cost {cost['ms_per_step']:.1f} ms/step ({cost['share']:.1%}" in printed[-1]
    # `diagnose` reads the log whole: the end line is known, not a bad line.
    diagnosis = diagnose(str(jsonl))
    assert diagnosis.records == 30 and not [n for n in diagnosis.notes if "skipped" in str(n)]


class NormedLM(TinyLM):
    """TinyLM with a LayerNorm before its head: a module whose activations are sampled."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.norm(self.emb(ids)))
        return out


def test_the_sampled_activations_are_a_part_of_the_cost(tmp_path: Path) -> None:
    # Their hooks' time is moved to the meter at the end of each sampled step (only those).
    _fit(tmp_path, NormedLM(), steps=12, activation_every=3)
    jsonl = tmp_path / "stability_logs" / "version_0" / "stability.jsonl"
    end = json.loads(jsonl.read_text(encoding="utf-8").splitlines()[-1])
    assert end["cost"]["parts"]["activations"] > 0


def _outcome(path: Path, module: TinyLM) -> tuple[list[Any], list[torch.Tensor]]:
    """What a run detected and did: its JSONL's records and findings (the root cause's replay
    time, a wall-clock figure, set aside), its last line less the cost, its weights."""
    items = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    for item in items:
        item.pop("cost", None)
        item.get("evidence", {}).pop("elapsed_s", None)
        if "message" in item:  # (the JSONL's finding: its whole message)
            item["message"] = re.sub(r"replay \d+\.\d+ s", "replay _ s", item["message"])
    return items[1:], [p.detach().clone() for p in module.parameters()]


def test_a_monitor_over_its_budget_detects_and_does_the_same(
    tmp_path: Path, printed: list[str]
) -> None:
    """The cost meter only measures and warns: a run whose monitor is over its budget (as a
    loaded machine makes it) finds, skips, remedies and ends as the same run within it."""
    runs = []
    for name, budget in (("within", None), ("over", 1e-9)):
        torch.manual_seed(0)
        module = TinyLM(nan_every=8)
        _fit(tmp_path / name, module, steps=30, policy="auto", cost_budget=budget)
        path = tmp_path / name / "stability_logs" / "version_0" / "stability.jsonl"
        runs.append(_outcome(path, module))
    assert sum("over its 0% budget" in line for line in printed) == 2  # the warning, the end
    (within, weights), (over, over_weights) = runs
    assert over == within and any(item["type"] == "finding" for item in over)
    assert all(torch.equal(a, b) for a, b in zip(weights, over_weights, strict=True))


def test_a_nan_every_8_steps_is_folded(tmp_path: Path, printed: list[str]) -> None:
    _fit(tmp_path, TinyLM(nan_every=8), steps=48)
    assert printed[1] == (
        "step 6 error nonfinite_loss: loss is nan at step 6; step skipped, weights intact -> try: "
        "rollback"
    )  # the guard skipped the step and the run is fp32: no skip_step, no upcast_to_fp32; (#33)
    # the NaN loss made every group's gradient NaN: no list of every group
    assert printed[2].startswith("step 6 error root_cause:")
    assert "every module output is finite" in printed[2]
    folded = "NaN/Inf loss at 5 more steps (14…46), each skipped; weights intact"
    assert printed[3:5] == [folded, "root cause at 5 more steps (14…46)"]
    assert printed[-1].startswith(
        "done at step 48: 12 findings (12 error), worst: step 6 nonfinite_loss; "
        "6 steps skipped, weights checked finite at the end"
    )
    assert len(printed) == 6  # start, NaN, root cause, two folds, end: not two printed per NaN


class AlwaysNaN(TinyLM):
    """A NaN loss from step 5 on: protect skips every step and stops the run."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step >= 5 else loss


def test_nothing_but_the_end_line_follows_the_stop_line(tmp_path: Path, printed: list[str]) -> None:
    """#33: after "stopping at step 14" came "update: NaN/Inf loss persists until the end of
    the log", a live run's end called a log's; the end line quoted the episode's first span.
    The JSONL's end says the run was stopped, and why (not inferred from the console's lines)."""
    _fit(tmp_path, AlwaysNaN(), steps=60)
    [stop] = [i for i, line in enumerate(printed) if line.startswith("stopping at step 14")]
    assert printed[stop + 1 :] == printed[-1:] and printed[-1].startswith("done at step 15")
    assert "worst: steps 5-14 nonfinite_loss" in printed[-1]  # the episode as it ended
    assert not [line for line in printed if "end of the log" in line]
    [jsonl] = tmp_path.rglob("stability.jsonl")
    end = json.loads(jsonl.read_text().splitlines()[-1])
    assert end["type"] == "end" and end["stopped"] in printed[stop]


def test_a_stopped_run_ends_with_the_end_line_alone_whatever_the_logger_showed(
    printed: list[str],
) -> None:
    """The end knows the run was stopped from the monitor (`RunEnd.stopped`), not from the
    console's own lines: a fold pending at the stop is not printed after it, even where the stop
    line never went through the logger (a handler or filter of the user's dropped it)."""
    console = _console()
    console.start(nn.Linear(2, 2), ["block_00"], lambda name: "block_00", None)
    for step, ratio in ((10, 2.0), (20, 3.0)):
        console.write(StepRecord(step, {"loss": 2.0}), [_spike(step, ratio)])
    before = len(printed)
    console.close(RunEnd(31, stopped="10 non-finite steps in a row"))
    assert len(printed) == before + 1 and printed[-1].startswith("done at step 31")


def test_several_findings_at_one_step_fold_as_places(printed: list[str]) -> None:
    """#33: "overflow_risk at 19 more steps (200)" meant 19 more modules at one step."""
    console = _console()
    risks = [
        Finding("overflow_risk", 200, 200, Severity.WARNING, f"near 65504 in m{i}", {}, (f"m{i}",))
        for i in range(20)
    ]
    console.write(StepRecord(200, {"loss": 2.0}), risks)
    console.write(StepRecord(260, {"loss": 2.0}), [])
    assert printed[1:] == ["overflow_risk in 19 more places at step 200"]
    for step, module in ((300, "m0"), (300, "m1"), (310, "m0")):
        risk = Finding("overflow_risk", step, step, Severity.WARNING, "near", {}, (module,))
        console.write(StepRecord(step, {"loss": 2.0}), [risk])
    console.close(RunEnd(400))
    assert printed[2] == "overflow_risk at 2 more steps (300…310), 3 findings"


class TwoNaNs(TinyLM):
    """A NaN loss at steps 6 and 14 only: the second is folded, then every step is quiet."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step in (6, 14) else loss


def test_a_quiet_step_reaches_the_console_only_while_a_fold_waits(
    tmp_path: Path, printed: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The console prints findings: a step without any is given to it only while a folded
    repeat waits for its line (due `FOLD_STEPS` after it), which still comes on time."""
    quiet: list[int] = []
    write = Console.write

    def counted(self: Console, record: StepRecord | None, found: list[Finding]) -> None:
        if record is not None and not found:
            quiet.append(record.step)
        write(self, record, found)

    monkeypatch.setattr(Console, "write", counted)
    folded = "NaN/Inf loss at 1 more step (14), each skipped; weights intact"
    at: list[int] = []  # the step at which the fold line was printed

    class Watch(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if folded in printed and not at:
                at.append(trainer.global_step - 1)

    _fit(tmp_path, TwoNaNs(), steps=70, extra=(Watch(),))
    assert at == [14 + FOLD_STEPS]  # on time, not at the end
    assert quiet == list(range(15, 15 + FOLD_STEPS))  # (every quiet step, before)


def test_fold_lines_come_within_fold_steps(printed: list[str]) -> None:
    console = _console()
    for step in range(0, 200, 8):
        # Each step's weights were checked finite before it, and its update skipped.
        record = StepRecord(step, {"skipped": 1.0, "nonfinite_weights": 0.0})
        console.write(record, [_nan(step)])
    assert printed[0].startswith("step 0 error nonfinite_loss")
    assert printed[1:4] == [
        "NaN/Inf loss at 7 more steps (8…56), each skipped; weights intact",
        "NaN/Inf loss at 7 more steps (64…112), each skipped; weights intact",
        "NaN/Inf loss at 7 more steps (120…168), each skipped; weights intact",
    ]
    console.close(RunEnd(200))
    assert printed[4] == "NaN/Inf loss at 3 more steps (176…192), each skipped; weights intact"


def test_no_claim_about_the_weights_without_their_check(printed: list[str]) -> None:
    console, facts = _console(), LiveFacts("bf16-mixed")
    for record in (
        StepRecord(0, {"skipped": 1.0}),  # skipped, weights not checked
        StepRecord(8, {"skipped": 1.0, "nonfinite_weights": 2.0}),
    ):
        facts.see(record.step, record.values)
        console.write(record, facts.advise([_nan(record.step)]))
    console.close(RunEnd(10, skipped=2, intact=False))
    assert printed[0].endswith("step skipped -> try: upcast_to_fp32, rollback")
    assert "NOT intact" in printed[-1] and "weights intact" not in " ".join(printed)


def test_remedy_applied_and_critical_findings_always_print(printed: list[str]) -> None:
    console = _console(policy="auto")
    applied = Finding("remedy_applied", 5, 5, Severity.INFO, "clip_gradients after grad_spike")
    stuck = Finding("nonfinite_loss", 3, 12, Severity.CRITICAL, "NaN/Inf loss persists")
    for step in range(12, 15):
        console.write(StepRecord(step, {"loss": float("nan")}), [applied, stuck])
    assert len(printed) == 6
    assert printed[0] == "step 5 info remedy_applied: clip_gradients after grad_spike"


@pytest.mark.parametrize(
    ("precision", "remedies"),
    [("32-true", "rollback"), ("bf16-mixed", "upcast_to_fp32, rollback")],
    ids=["fp32", "bf16"],
)
def test_fp16_advice_only_in_low_precision(
    precision: str, remedies: str, printed: list[str]
) -> None:
    """The console prints what `LiveFacts` advise (`LiveOutputs` advises every output)."""
    console, facts = _console(policy="observe"), LiveFacts(precision)
    record = StepRecord(9, {"loss": float("nan"), "skipped": 0.0})
    facts.see(record.step, record.values)
    console.write(record, facts.advise([_nan(9)]))
    assert printed == [
        "step 9 error nonfinite_loss: loss is nan at step 9; the update was applied "
        f"(policy observe) -> try: skip_step, {remedies}"
    ]


@pytest.mark.parametrize(
    ("groups", "text"),
    [
        (["embed", "block_00", "block_01", "block_02", "head"], "embed, block_00…block_02, head"),
        (["block_00", "block_02", "block_03", "other"], "block_00, block_02…block_03, other"),
        (["encoder", "decoder"], "encoder, decoder"),
        ([], ""),
    ],
    ids=["stack", "gap", "custom", "none"],
)
def test_compact_groups(groups: list[str], text: str) -> None:
    assert compact_groups(groups) == text


def test_info_reaches_stderr_without_any_logging_config(tmp_path: Path) -> None:
    """A user's script that configures no logging still sees info lines (as Lightning's)."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        from test_console import TinyLM, _fit
        _fit(Path({str(tmp_path)!r}), TinyLM(), steps=2, clip=None)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    )
    assert "stabilizer: on, policy protect; 4 depth groups" in done.stderr
    assert "stabilizer: step 0 info config_risk: no gradient clipping" in done.stderr
    # (#41) set-up advice is no finding: counted apart, as `diagnose` counts it
    assert (
        "stabilizer: done at step 2: healthy, no findings; 1 set-up note (1 info); 0 steps skipped"
        in done.stderr
    )


@pytest.fixture
def printed() -> Iterator[list[str]]:
    """The lines the ``stabilizer`` logger prints, without the ``stabilizer: `` prefix."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage().removeprefix("stabilizer: "))

    logger, handler = logging.getLogger("stabilizer"), Collect(logging.DEBUG)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def _console(policy: str = "protect") -> Console:
    """A console that prints (the trainer, which only tells the rank, plays no part)."""
    console = Console(policy)
    console.enabled = True
    return console


def _nan(step: int) -> Finding:
    return Finding(
        kind="nonfinite_loss",
        step=step,
        end_step=step,
        severity=Severity.ERROR,
        seen=f"loss is nan at step {step}",
        evidence={"loss": float("nan")},
        remedies=("skip_step", "upcast_to_fp32", "rollback"),
        advice="skip the step; if it recurs, run LayerNorm/softmax in fp32",
    )


def test_an_episode_prints_once_then_its_updates(printed: list[str]) -> None:
    """#21: the closing finding of starved layers was folded into "depth_imbalance at 1 more
    step (27)", and an fp16 cascade counted as an error and an info. An update prints as the
    episode's update, is never folded, and the end line counts the episode once."""
    console = _console()
    band = ("block_00", "block_01")
    opened = Finding("depth_imbalance", 27, 76, Severity.WARNING, "blocks 0-1 starve", {}, band)
    closed = Finding(
        "depth_imbalance", 27, 199, Severity.WARNING, "blocks 0-1 to the end", {}, band
    )
    cascade = Finding("fp16_overflow", 60, 62, Severity.ERROR, "cascade: 3 skipped steps")
    over = Finding("fp16_overflow", 60, 63, Severity.INFO, "cascade: 4 skipped steps; over")
    for step, found in ((76, [opened]), (62, [cascade]), (63, [over])):
        console.write(StepRecord(step, {"loss": 2.0}), found)
    console.write(None, [closed])  # the engine's findings at the run's end (no record)
    console.close(RunEnd(200))
    assert printed == [
        "steps 27-76 warning depth_imbalance [block_00…block_01]: blocks 0-1 starve",
        "steps 60-62 error fp16_overflow: cascade: 3 skipped steps",
        "steps 60-63 fp16_overflow, update: cascade: 4 skipped steps; over",
        # (#33) the end's update that does not escalate is the end line's to say
        "done at step 200: 2 findings (1 error, 1 warning), worst: steps 60-63 fp16_overflow; "
        "0 steps skipped",
    ]  # the worst as it stands: its latest span (#33: not the first, 60-62)


def test_a_nan_that_persists_is_one_episode(printed: list[str]) -> None:
    """#34: a NaN's first finding names every depth group whose gradient went non-finite, its
    "persists" none; the episode key held the location, so the end line counted two episodes
    (1 critical, 1 error). The one episode rule (`stabilizer.core.episode`) takes a finding
    that names no place as an update of one that names some."""
    console = _console()
    console.start(nn.Linear(2, 2), ["embed", "block_00", "head"], None, None)
    first = replace(_nan(5), location=("embed", "block_00", "head"))
    persists = Finding(
        "nonfinite_loss", 5, 14, Severity.CRITICAL, "NaN/Inf loss persists for 10 steps since "
        "step 5: the run is not recovering", {"steps": 10.0}, (), ("rollback", "upcast_to_fp32"),
    )  # fmt: skip
    console.write(StepRecord(5, {"loss": float("nan")}), [first])
    console.write(StepRecord(14, {"loss": float("nan")}), [persists])
    console.close(RunEnd(15))
    # (#41) the escalation says its severity
    assert printed[-2].startswith("steps 5-14 critical nonfinite_loss, update: NaN/Inf loss")
    assert printed[-1].startswith(
        "done at step 15: 1 finding (1 critical), worst: steps 5-14 nonfinite_loss"
    ), printed[-1]


def test_an_fp32_run_prints_no_idle_detector_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """#21: ``detector 'fp16_overflow' idle`` printed on every fp32 run, without the prefix."""
    with caplog.at_level(logging.INFO):
        _fit(tmp_path, TinyLM(), steps=105)  # past the engine's grace of 100 records
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert not [line for line in lines if "idle" in line]
    assert all(line.startswith("stabilizer: ") for line in lines if r"stabilizer" in line)


def _spike(step: int, ratio: float) -> Finding:
    return Finding(
        "loss_spike", step, step + 2, Severity.WARNING,
        f"loss spiked from 2 to {2 * ratio:g} ({ratio:.1f}x) at step {step}, back after 2 steps",
        {"ratio": ratio, "peak": 2 * ratio}, (), ("clip_gradients",), "clip gradients",
    )  # fmt: skip


def test_a_fold_line_says_the_largest_of_its_repeats(printed: list[str]) -> None:
    """#41: `loss_spike at 1 more step (160)` hid a 47.9x spike behind the 2.2x one printed."""
    console = _console()
    for step, ratio in ((100, 2.2), (130, 2.1), (160, 47.9), (170, 2.3)):
        console.write(StepRecord(step, {"loss": 2.0}), [_spike(step, ratio)])
    console.close(RunEnd(200))
    assert printed[1] == (
        "loss_spike at 3 more steps (130…170); the largest: loss spiked from 2 to 95.8 (47.9x) "
        "at step 160, back after 2 steps"
    )


def test_set_up_notes_are_lines_of_their_own_and_nothing_follows_the_stop_line(
    printed: list[str],
) -> None:
    """#41 (the softmax-fp16 demo): the second set-up note was folded and printed after the
    stop line, as "config_risk at 1 more step (0)"; the end line counted it a finding."""
    console = _console()
    console.start(nn.Linear(2, 2), ["block_00"], lambda name: "block_00", None)
    notes = [
        Finding("config_risk", 0, None, Severity.INFO, f"note {i}", {}, (), ("clip_gradients",))
        for i in range(2)
    ]
    console.write(StepRecord(0, {"loss": 2.0}), notes)
    for step, ratio in ((10, 2.0), (20, 3.0)):  # a fold pending when the run stops
        console.write(StepRecord(step, {"loss": 2.0}), [_spike(step, ratio)])
    logging.getLogger("stabilizer").error("%s30: 10 non-finite steps in a row", STOP_LINE)
    console.close(RunEnd(31, stopped="10 non-finite steps in a row"))
    assert printed[0] == "on, policy protect; 1 depth group: block_00; no JSONL log"  # (#41)
    assert [line.split(" -> ")[0] for line in printed[1:3]] == [
        "step 0 info config_risk: note 0",
        "step 0 info config_risk: note 1",
    ]
    assert printed[-2].startswith("stopping at step 30") and printed[-1].startswith("done at")
    assert (
        "done at step 31: 2 findings (2 warning), worst: steps 10-12 loss_spike; " in printed[-1]
        and "; 2 set-up notes (2 info); 0 steps skipped" in printed[-1]
    )


def test_the_end_line_has_the_last_word_on_the_budget() -> None:
    """#41: on a quiet machine the cost warning said "over its 3% budget" (3.1%) and the end
    line, at 2.9%, said nothing of the budget: the warning stood. The end line says "within"
    where the monitor warned (`Cost.warned`), whatever the share: not where it might have."""

    def cost(ms: float, budget: float | None = 0.03, warned: bool = True) -> Cost:  # 119 ms step
        return Cost(40, ms, ms / 119, 0.0, (("measure", ms),), budget, warned)

    assert budget_verdict(cost(8.7)) == "within its 3% budget over the whole run"  # 2.9%
    assert budget_verdict(cost(1.0)) == "within its 3% budget over the whole run"  # (warned)
    assert budget_verdict(cost(8.7, warned=False)) == ""  # no warning to answer
    assert budget_verdict(cost(1.0, warned=False)) == "" and budget_verdict(cost(8.7, None)) == ""
    assert budget_verdict(cost(20.0)).startswith("over its 3% budget: mostly measuring each step")


def test_a_huge_ratio_is_no_21_digit_integer() -> None:
    """#41: a gradient norm 1e20 times its median was printed as a 21-digit integer ratio."""
    detector = GradSpike()
    found: list[Finding] = []
    for step in range(40):
        norm = 1e20 if step == 12 else 1.0 + 0.01 * (step % 3)
        found += detector.update(StepRecord(step, {"grad_norm": norm}))
    found += detector.finish()
    assert found and all(not re.search(r"\d{8,}x", f.seen) for f in found), [f.seen for f in found]
    assert "(9.9e+19x the" in found[0].seen
