"""The one table of metric aliases: the names trainers print → the signal keys the engine reads.

Lower-case names, as console logs print them (one word, or two for ``lm loss``, ``grad norm``,
``learning rate``). `key_of` looks a logged name up: a ``train/``, ``train_`` or ``training/``
prefix and a ``_step`` suffix (Lightning's ``on_step`` logging) are dropped first, so
``train/loss_step`` is the loss. Validation losses land on ``val_loss``, never on the training
``loss``. Two words that are not in the table are not the signal of the second: ``params norm``
is no gradient norm, ``aux loss`` no training loss; they pass through as ``params_norm``. A word
that ends a sentence qualifies nothing: in ``records/second. Loss is 1.26`` the name is ``Loss``.
A CamelCase name that ends in ``Loss`` (``CrossEntropyLoss``, ``CTCLoss``, ``train/ActionL2Loss``)
is the loss, a validation loss after ``Val``/``val/``; so is a name of the table after a path
(``optim/total_grad_norm`` is the gradient norm, ``val/loss`` a validation loss); a perplexity
(``ppl``, ``PPL``, ``Perplexity``) is kept as ``ppl``, whose log is the loss of a record that
prints no loss.
"""

from __future__ import annotations

from functools import lru_cache

from stabilizer.core.signals import GRAD_NORM, LOSS, LOSS_SCALE, LR

__all__ = ["ALIASES", "PPL", "SIGNALS", "STEP_NAMES", "VAL_LOSS", "key_of"]

VAL_LOSS = "val_loss"  # a validation loss: reported beside the training loss, never as it
PPL = "ppl"  # a perplexity: exp of the loss, the loss where none is printed

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

STEP_NAMES = frozenset(
    ("step", "steps", "global_step", "total_step", "iter", "iteration", "num_updates", "update",
     "up.", "batch", "s", "epoch")
)  # fmt: skip
"""Names of counters: they say where a record is, they are not among its values."""

_PREFIXES = ("train/", "train_", "training/")
_FILLER = frozenset(("the", "info", "debug", "warning", "error", "current"))  # no qualifiers
_HELD_OUT = ("val", "valid", "test", "eval", "dev")  # a CamelCase loss of these is no training loss


@lru_cache(maxsize=4096)
def key_of(printed: str) -> str | None:
    """The key of the value printed after a name of one word or two (``lm loss``).

    Returns an alias's signal key, None for a counter (`STEP_NAMES`), else the name as printed
    (two words joined by ``_``).
    """
    before, _, name = printed.rpartition(" ")
    low = name.lower()
    if low == "is" and before:  # "reg_loss is 0.08": the name is the word before "is"
        return key_of(before)
    if low in STEP_NAMES:
        return None
    if before and before.lower() not in _FILLER and not before.endswith("."):
        return ALIASES.get(f"{before.lower()} {low}", f"{before}_{name}")
    if low in ALIASES:
        return ALIASES[low]
    base = low.removesuffix("_step")
    for prefix in _PREFIXES:
        if base.startswith(prefix):
            base = base[len(prefix) :]
            break
    if name.endswith("Loss") and len(name) > 4 and name[-5].isalnum():  # CrossEntropyLoss, CTCLoss
        path, _, word = base[:-4].rpartition("/")
        return VAL_LOSS if (path or word).startswith(_HELD_OUT) else LOSS
    if base not in ALIASES and "/" in base:  # "optim/total_grad_norm": the alias after a path
        path, _, last = base.rpartition("/")
        key = ALIASES.get(last)
        if key is not None:
            return VAL_LOSS if key == LOSS and path.startswith(_HELD_OUT) else key
    return ALIASES.get(base, name)
