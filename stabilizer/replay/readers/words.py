"""The trainers' own words: one catalogue of the messages with which trainers report trouble or
routine, each with the trainer that prints it, the file of its source, and what it means.

A person reading a log reads the messages beside the numbers: ``ERROR:tensorflow:Model
diverged with loss = NaN.`` is a NaN loss even where no number was printed, ``[deepspeed]
OVERFLOW! ... reducing to 32768`` is a step the fp16 scaler skipped. A message that states a
value gives the record that value (a NaN loss, a gradient norm, the loss scale in force); one
that states an event gives the record's event (``skipped``). A message that alone reports
trouble (the trainer gave up: a NaN it raised on, the loss scale at its floor) has a `severity`:
the reader says in a finding that the trainer said it (`TRAINER_SAID`). Routine messages (the
scaler probing, a scheduler lowering the LR) have none: their values are judged as the numbers
are. The table in docs/readers.md lists every row.

The patterns read a lower-cased line, anywhere in it (behind any logger's prefix). `EARLY` rows
are read before the metrics of a line (an overflow line prints ``loss scale: 65536``, no loss
scale of a record); the others only on lines the metrics alone do not make a record with a step.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from stabilizer.core.kinds import TRAINER_SAID
from stabilizer.core.records import Finding, Severity
from stabilizer.core.signals import GRAD_NORM, LOSS, LOSS_SCALE, LR, SKIPPED

from ._shapes import NUM

__all__ = [
    "EARLY_NEEDS",
    "LG",
    "WORDS",
    "Heard",
    "Overflow",
    "Told",
    "Words",
    "heard_early",
    "heard_in",
    "overflow_of",
    "printed_again",
    "said",
]

LG = "lg_loss_scale"
"""Guided diffusion's log2 of its loss scale, kept beside the scale (below 2^-1074 every scale
is the same 0, but the run still lowers its power)."""

_NAN = r"(nan|[-+]?inf(?:inity)?)"


@dataclass(frozen=True, eq=False)  # one row is one message: equal to itself only
class Words:
    """One message of the catalogue.

    Args:
        trainer: Who prints it.
        source: The file of the trainer's source that prints it.
        needs: Lower-case text every line of it holds (the cheap test before the pattern).
        pattern: A regex over the lower-cased line; its named groups give values: ``loss``,
            ``grad_norm``, ``lr``, ``scale`` (the loss scale; numbers as printed), ``step`` (the
            step it names).
        means: What it means, one line.
        values: What every such line gives its record besides its groups (``skipped`` 1, a
            NaN loss where the message says so in words).
        severity: ``"warning"`` or ``"error"`` where the message alone reports trouble; None
            for routine.
        early: It is an fp16 scaler's overflow line, read before the line's metrics: a skipped
            step, and the loss scale in force after it.
    """

    trainer: str
    source: str
    needs: str
    pattern: str
    means: str
    values: Mapping[str, float] = field(default_factory=dict)
    severity: str | None = None
    early: bool = False
    regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "regex", re.compile(self.pattern.replace("NUM", NUM)))


_SKIP = {SKIPPED: 1.0}
_NAN_LOSS = {LOSS: math.nan}

WORDS: tuple[Words, ...] = (
    # fp16 loss scalers: an overflow skips the step and lowers the scale (routine while rare).
    Words("DeepSpeed", "deepspeed/runtime/fp16/loss_scaler.py, fused_optimizer.py", "overflow",
          r"overflow!", "fp16 overflow: the step was skipped and the loss scale lowered (or, "
          "under hysteresis, kept)", _SKIP, early=True),
    Words("fairseq, DeepSpeed", "fairseq/trainer.py, fairseq/optim/amp_optimizer.py, "
          "deepspeed/runtime/fp16/fused_optimizer.py", "overflow", r"overflow detected",
          "fp16 overflow: the update was skipped and the loss scale lowered", _SKIP, early=True),
    Words("apex amp, DeepSpeed", "apex/amp/handle.py (removed in apex#1896), "
          "deepspeed/runtime/fp16/fused_optimizer.py", "overflow",
          r"grad(?:ient)? overflow|overflow\.\s+skipping",
          "fp16 overflow: the step was skipped and the loss scale lowered", _SKIP, early=True),
    Words("Megatron-LM (2019-20), apex FP16_Optimizer", "megatron/fp16/loss_scaler.py",
          "loss scale", r"(?:reducing dynamic|attempted) loss scale",
          "fp16 overflow: the step was skipped and the loss scale lowered", _SKIP, early=True),
    Words("PaddleNLP (Trainer)", "paddlenlp/trainer/trainer.py", "optimizer not run",
          r"optimizer not run", "fp16 overflow: the step was skipped and the loss scale lowered "
          "(scale_before, scale_after)", _SKIP, early=True),
    Words("guided/improved diffusion", "guided_diffusion/fp16_util.py", "lg_loss",
          r"found nan, decreased lg_loss_scale",
          "fp16 overflow: the step was skipped and log2 of the loss scale lowered by one",
          _SKIP, early=True),
    # The scaler at its floor: the run cannot go on.
    Words("DeepSpeed", "deepspeed/runtime/fp16/loss_scaler.py", "already at minimum",
          r"loss scale already at minimum",
          "fp16 overflow at the smallest loss scale: DeepSpeed exits the run", _SKIP, "error"),
    Words("fairseq", "fairseq/optim/dynamic_loss_scaler.py", "minimum loss scale reached",
          r"minimum loss scale reached \((?P<scale>NUM)\)", "fp16 overflow at the smallest loss "
          "scale: fairseq "
          "stops (its loss is probably exploding)", _SKIP, "error"),
    Words("icefall (k2-fsa) and recipes that copy its loop", "egs/*/ASR/zipformer/train.py",
          "grad scale is small", r"grad scale is small: (?P<scale>NUM)",
          "the fp16 grad scaler's scale is below 0.01: step after step overflows (icefall saves "
          "a bad model and stops below 1e-5)", _SKIP, "warning"),
    Words("icefall (k2-fsa) and recipes that copy its loop", "egs/*/ASR/zipformer/train.py",
          "grad_scale is too small", r"grad_scale is too small, exiting: (?P<scale>NUM)",
          "the fp16 grad scaler's scale fell below 1e-5: icefall stops the run", _SKIP, "error"),
    # A NaN/Inf loss the trainer stopped on.
    Words("TensorFlow (estimator, NanTensorHook)",
          "tensorflow/python/training/basic_session_run_hooks.py", "diverged",
          r"model diverged with loss = " + _NAN.replace("(", "(?P<loss>", 1),
          "the loss was NaN: NanTensorHook stopped the training", severity="error"),
    Words("TensorFlow (estimator, NanTensorHook)",
          "tensorflow/python/training/basic_session_run_hooks.py", "nan loss during training",
          r"nan loss during training", "the loss was NaN (NanLossDuringTrainingError)",
          _NAN_LOSS, "error"),
    Words("Keras (TerminateOnNaN)", "keras/src/callbacks/terminate_on_nan.py", "invalid loss",
          r"invalid loss, terminating training", "the loss was NaN or Inf: Keras stopped",
          severity="error"),  # (which of the two, its bar's next redraw says)
    Words("Composer (NaNMonitor)", "composer/callbacks/nan_monitor.py", "contains a nan",
          r"loss contains a nan", "the loss was NaN: Composer stopped", _NAN_LOSS, "error"),
    Words("OLMo, OLMo-core", "olmo/train.py, src/olmo_core/train/trainer.py", "loss encountered",
          _NAN.replace("(", "(?P<loss>", 1) + r" loss encountered(?: at step (?P<step>\d+))?",
          "the loss was NaN or Inf: OLMo stopped", severity="error"),
    Words("mmdetection (CheckInvalidLossHook)", "mmdet/engine/hooks/checkloss_hook.py",
          "infinite or nan", r"loss become infinite or nan",
          "the loss was NaN or Inf (mmdet's check of the loss)", _NAN_LOSS, "error"),
    Words("NVIDIA retinanet-examples (ODTK)", "odtk/train.py", "loss is diverging",
          r"loss is diverging!", "the loss was NaN or Inf: ODTK stopped", _NAN_LOSS, "error"),
    Words("SpeechBrain (Brain.check_gradients)", "speechbrain/core.py", "loss is not finite",
          r"loss is not finite and patience is exhausted",
          "the loss was NaN or Inf on more batches than its patience: SpeechBrain stopped",
          _NAN_LOSS, "error"),
    Words("Megatron-LM (rerun state machine)", "megatron/core/rerun_state_machine.py",
          "loss is nan", r"unexpected result .*loss is nan",
          "the loss was NaN: Megatron reruns the step to tell a fault from the data",
          _NAN_LOSS, "error"),
    Words("Megatron-LM (rerun state machine)", "megatron/core/rerun_state_machine.py",
          "spiky loss", r"unexpected result (?:tensor\()?(?P<loss>NUM).*spiky loss",
          "the loss spiked beyond 10x the largest of the first iterations", severity="warning"),
    Words("Lightning (SpikeDetection)", "src/lightning/fabric/utilities/spike.py",
          "training spike detected", r"training spike detected in batch",
          "a loss spike: Lightning stopped the training", severity="error"),
    Words("Lightning (EarlyStopping)", "src/lightning/pytorch/callbacks/early_stopping.py",
          "is not finite", r"monitored metric \S+ = \S+ is not finite",
          "the monitored metric was NaN or Inf: Lightning stopped", severity="error"),
    # Gradients.
    Words("Megatron-LM", "megatron/core/distributed/param_and_grad_buffer.py", "local grad norm",
          r"found " + _NAN.replace("(", "(?P<grad_norm>", 1) + r" in local grad norm",
          "a NaN/Inf gradient before the data-parallel reduction: Megatron stops",
          severity="error"),
    Words("Megatron-LM", "megatron/core/distributed/param_and_grad_buffer.py",
          "unexpected large grads", r"found unexpected large grads",
          "a gradient far larger than the run's first ones", severity="warning"),
    Words("PyTorch (clip_grad_norm_, error_if_nonfinite)", "torch/nn/utils/clip_grad.py",
          "non-finite, so it cannot be clipped", r"is non-finite, so it cannot be clipped",
          "the gradient norm was NaN or Inf: clipping raised", {GRAD_NORM: math.nan}, "error"),
    Words("PyTorch (detect_anomaly)", "torch/csrc/autograd/python_anomaly_mode.cpp",
          "returned nan values", r"function '\w+' returned nan values in its \d+\w* output",
          "a backward function made NaN gradients: anomaly mode raised",
          {GRAD_NORM: math.nan}, "error"),
    Words("ESPnet", "espnet2/train/trainer.py, espnet/asr/pytorch_backend/asr.py", "grad norm is",
          r"grad norm is " + _NAN.replace("(", "(?P<grad_norm>", 1)
          + r"\.\s*(?:skipping updating|do not update)",
          "a NaN/Inf gradient norm: ESPnet skipped the update", _SKIP),
    Words("verl (dp_actor, dp_critic), RL trainers derived from it",
          "verl/workers/actor/dp_actor.py, verl/workers/critic/dp_critic.py",
          "grad_norm is not finite",
          r"grad_norm is not finite: \[?(?:tensor\()?" + _NAN.replace("(", "(?P<grad_norm>", 1),
          "a NaN/Inf gradient norm: verl zeroed the gradients and skipped the update", _SKIP),
    Words("custom loops (a common guard)", "e.g. `print(f'bad grad norm {gn}; skipping')`",
          "bad grad", r"bad grad(?:ient)?[ _]norm",
          "the trainer's guard found the gradient norm bad (NaN, Inf or beyond its bound)",
          severity="warning"),
    Words("HF transformers (DebugUnderflowOverflow)", "src/transformers/debug_utils.py",
          "detected inf/nan", r"detected inf/nan during batch_number",
          "a NaN/Inf in the forward pass of that batch", severity="error"),
    # Routine: a scheduler lowering the LR.
    Words("PyTorch (ReduceLROnPlateau, verbose)", "torch/optim/lr_scheduler.py",
          "reducing learning rate", r"reducing learning rate of group 0 to (?P<lr>NUM)",
          "the LR was lowered on a plateau (routine)"),
    Words("Keras (ReduceLROnPlateau)", "keras/src/callbacks/reduce_lr_on_plateau.py",
          "reducelronplateau", r"reducelronplateau reducing (?:\S+ )?learning rate to (?P<lr>NUM)",
          "the LR was lowered on a plateau (routine)"),
)  # fmt: skip
"""Every message, one row each; the trainer's source file cited for each."""

EARLY_NEEDS = tuple(dict.fromkeys(row.needs for row in WORDS if row.early))
"""What a lower-cased line must hold one of to be an overflow line (for `heard_early`)."""
_LATE = tuple(row for row in WORDS if not row.early)
TRIGGERS = ("nan", "loss", "grad", "diverg", "minimum", "spike", "finite", "learning rate",
            "plateau")  # fmt: skip
"""Words one of which every message that is no overflow holds (its `Words.needs` holds one):
a line with none of them is none (one regex scan, cheaper than a test a row)."""
_TRIGGER = re.compile("|".join(TRIGGERS))
_GROUPS = {"loss": LOSS, "grad_norm": GRAD_NORM, "lr": LR, "scale": LOSS_SCALE}
_NEW_SCALE = re.compile(
    r"(?:reducing (?:loss scale )?to|setting (?:loss )?scale to:?(?: to)?|loss scale from \S+ "
    r"to|scale_after:)\s*(" + NUM + ")"
)
_ATTEMPTED = re.compile(r"attempted loss scale:?\s*(" + NUM + ")")
_LG_SCALE = re.compile(r"lg_loss_scale to\s*(" + NUM + ")")
_RANK = re.compile(r"\brank\s*(\d+)")


@dataclass(frozen=True)
class Heard:
    """What a line of the catalogue says.

    Args:
        words: Its row.
        values: The values it gives its record.
        rank: The rank that printed it, where the line names one.
        step: The step it names, where it names one.
    """

    words: Words
    values: dict[str, float]
    rank: int | None = None
    step: int | None = None


def heard_early(low: str) -> Heard | None:
    """The overflow a lower-cased line that holds one of `EARLY_NEEDS` reports, or None."""
    for row in WORDS:
        if row.early and row.needs in low and row.regex.search(low):
            rank = _RANK.search(low)
            return Heard(row, _scale(low), rank and int(rank[1]))
    return None


Overflow = tuple[dict[str, float], int | None]
"""An overflow line's record (a skipped step, the scale in force after it) and the rank it names."""


def overflow_of(line: str) -> Overflow | None:
    """The record of an fp16 overflow line and the rank it names, if any; None for any other."""
    low = line.lower()
    heard = heard_early(low) if any(map(low.__contains__, EARLY_NEEDS)) else None
    return None if heard is None else (heard.values, heard.rank)


def printed_again(line: str, found: Overflow, last_line: str, last: Overflow) -> bool:
    """Whether an overflow line is the last one printed again (by another rank or logger): the
    scale it names, if any, is the last one's, and it is not the same rank reporting anew at
    another time (at the floor the scale stays 1, skip after skip)."""
    (values, rank), (last_values, last_rank) = found, last
    scale = values.get(LOSS_SCALE)
    same = scale is None or last_values.get(LOSS_SCALE, scale) == scale
    same = same and values.get(LG) == last_values.get(LG)
    return same and not (rank is not None and rank == last_rank and line != last_line)


def heard_in(low: str) -> Heard | None:
    """What a lower-cased line that is no overflow line says, if it is in the catalogue."""
    if _TRIGGER.search(low) is None:
        return None
    for row in _LATE:
        if row.needs in low and (found := row.regex.search(low)):
            values = dict(row.values)
            for name, text in found.groupdict().items():
                if text is not None and name in _GROUPS:
                    values[_GROUPS[name]] = float(text.replace(",", ""))
            step = found.groupdict().get("step")
            rank = _RANK.search(low)
            return Heard(row, values, rank and int(rank[1]), None if step is None else int(step))
    return None


def _scale(low: str) -> dict[str, float]:
    """An overflow line's record: a skipped step, and the scale in force after it."""
    scale = _NEW_SCALE.search(low) or _ATTEMPTED.search(low)  # (hysteresis keeps the scale)
    if scale is not None:
        return {SKIPPED: 1.0, LOSS_SCALE: float(scale[1].replace(",", ""))}
    lg = _LG_SCALE.search(low)
    if lg is not None:  # "Found NaN, decreased lg_loss_scale to -16199.354": 2 to that power
        power = float(lg[1].replace(",", ""))
        return {SKIPPED: 1.0, LOSS_SCALE: 2.0 ** max(min(power, 1000.0), -1075.0), LG: power}
    return {SKIPPED: 1.0}


def said(words: Words, step: int, text: str) -> Finding:
    """The finding that the trainer said ``text`` (a message of ``words``, which has a
    `Words.severity`) at ``step``."""
    assert words.severity is not None
    quoted = " ".join(text.split())[:160]
    return Finding(
        kind=TRAINER_SAID,
        step=step,
        end_step=None,
        severity=Severity.parse(words.severity),
        seen=f"the trainer said {quoted!r} at step {step}: {words.means} ({words.trainer})",
    )


class Told:
    """The rows a reader has said in a finding already: each is said once, the first time."""

    def __init__(self) -> None:
        self.rows: set[Words] = set()

    def tell(self, words: Words | None, step: int, text: str) -> list[Finding]:
        """The finding that the trainer said ``text`` (a message of ``words``) at ``step``,
        where the row reports trouble and was not said yet; none otherwise."""
        if words is None or words.severity is None or words in self.rows:
            return []
        self.rows.add(words)
        return [said(words, step, text)]

    def said(self, line: str, step: int) -> list[Finding]:
        """`tell` what ``line`` says, if it is a message of the catalogue."""
        heard = heard_in(line.lower())
        return [] if heard is None else self.tell(heard.words, step, line)
