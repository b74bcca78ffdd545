"""The one table of metric aliases: the names trainers print → the signal keys the engine reads.

Lower-case names, as console logs print them (one word, or two for ``lm loss``, ``grad norm``,
``learning rate``). Validation losses land on ``val_loss``, never on the training ``loss``; a
perplexity is kept as ``ppl``. Console names are looked up by the universal reader's `key_of`,
the names of structured logs by `_keys.KeyMap`.
"""

from __future__ import annotations

from stabilizer.core.signals import GRAD_NORM, LOSS, LOSS_SCALE, LR, PPL

__all__ = ["ALIASES", "BAR_LOSS", "HELD_OUT", "PPL", "SIGNALS", "VAL_LOSS"]

VAL_LOSS = "val_loss"  # a validation loss: reported beside the training loss, never as it
HELD_OUT = ("val", "valid", "validation", "test", "eval", "dev")
"""First words of the names of held-out (evaluation) metrics: never the training loss."""
BAR_LOSS = "bar/loss"  # a progress bar's loss beside the trainer's own: shown, never judged

ALIASES: dict[str, str] = {
    **dict.fromkeys(
        (
            "loss", "train loss", "training loss", "train_loss", "training_loss", "lm loss",
            "lm_loss", "total loss", "total_loss", "loss_total", "xent", "nll_loss", "trl",
            "avg loss", "average loss", "mean loss", "running loss", "batch loss", "loss train",
            "avg_loss", "average_loss", "mean_loss", "running_loss", "batch_loss", "loss total",
            "step_loss", "avr_loss", "cost",
        ),
        LOSS,
    ),
    **dict.fromkeys(
        (
            "grad_norm", "grad norm", "gnorm", "total_norm", "norm", "gradient norm",
            "gradient_norm", "grad_norm_total", "total_grad_norm",
        ),
        GRAD_NORM,
    ),
    **dict.fromkeys(("loss scale", "loss_scale", "scale", "grad_scale"), LOSS_SCALE),
    **dict.fromkeys(("lr", "learning rate", "learning_rate"), LR),
    **dict.fromkeys(
        (
            "val loss", "val_loss", "validation loss", "validation_loss", "valid loss",
            "valid_loss", "eval loss", "eval_loss", "test loss", "test_loss", "dev loss", "tel",
            "evaluation loss", "evaluation_loss",
        ),
        VAL_LOSS,
    ),
    **dict.fromkeys(("ppl", "perplexity"), PPL),
}  # fmt: skip
"""Lower-case printed names → signal keys (``trl``, ``tel`` and ``norm`` are llm.c's, ``avr_loss``
kohya-ss sd-scripts' running average)."""

SIGNALS = frozenset(ALIASES.values())
"""The keys of the table: a line holding one of these is a record even without a step."""
