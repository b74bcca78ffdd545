"""`KeyMap`: logged names → signal keys, shared by the structured readers."""

from __future__ import annotations

import pytest

from stabilizer.replay.readers._keys import KeyMap

NAMES = [
    ("loss", "loss"),
    ("train/loss", "loss"),
    ("train_loss", "loss"),
    ("train/loss_step", "loss"),
    ("lm loss", "loss"),
    ("lm_loss", "loss"),
    ("train/loss_epoch", "train/loss_epoch"),
    ("val/loss", "val/loss"),
    ("grad_norm", "grad_norm"),
    ("grad norm", "grad_norm"),
    ("gnorm", "grad_norm"),
    ("total_grad_norm", "grad_norm"),
    ("grad_2.0_norm_total", "grad_norm"),
    ("loss scale", "loss_scale"),
    ("scale", "loss_scale"),
    ("learning rate", "lr"),
    ("learning_rate", "lr"),
    ("lr-AdamW", "lr"),
    ("lr-AdamW/pg1", "lr"),
    ("lr-AdamW/pg2", "lr-AdamW/pg2"),
    ("stability/grad_norm/block_03", "grad_norm/block_03"),
    ("stability/skipped", "skipped"),
    ("hp_metric", "hp_metric"),
]


@pytest.mark.parametrize(("name", "key"), NAMES, ids=[n for n, _ in NAMES])
def test_names_map_to_signal_keys(name: str, key: str) -> None:
    assert KeyMap().values({name: 1.0}) == {key: 1.0}


def test_findings_are_dropped_and_unknown_names_optional() -> None:
    assert KeyMap().values({"stability/finding/loss_spike": 30.0}) == {}
    assert KeyMap(passthrough=False).values({"epoch": 1.0, "gnorm": 2.0}) == {"grad_norm": 2.0}


def test_parameter_norms_combine_into_depth_groups() -> None:
    raw = {
        "grad_2.0_norm/transformer.wte.weight": 1.0,
        "grad_2.0_norm/transformer.h.0.attn.c_attn.weight": 3.0,
        "grad_2.0_norm/transformer.h.0.mlp.c_fc.weight": 4.0,
        "grad_2.0_norm/transformer.h.11.mlp.c_fc.weight": 2.0,
        "grad_2.0_norm/transformer.ln_f.weight": 0.5,
        "grad_2.0_norm/lm_head.weight": float("inf"),
    }
    assert KeyMap().values(raw) == {
        "grad_norm/embed": 1.0,
        "grad_norm/block_00": 5.0,
        "grad_norm/block_11": 2.0,
        "grad_norm/head": float("inf"),
    }


def test_fairseq_clip_percentage_is_a_fraction() -> None:
    assert KeyMap().values({"clip": 25.0}) == {"clipped": 0.25}
