"""A checkpoint written after `auto` swapped the model to pre-LN loads back (and resumes):
under every policy, and with a plain `load_from_checkpoint` where the module's hyperparameters
say its norm placement."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from stabilizer.callbacks import StabilityMonitor
from stabilizer.callbacks.demo.lit_gpt import LitGPT
from stabilizer.core.detectors import default_detectors
from stabilizer.core.records import Finding, Severity, StepRecord
from stabilizer.demo.model import GPTConfig
from stabilizer.step.swap import restore_pre_ln, swapped_in

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, SEQ = 32, 8


class Starved:
    """A detector that reports starved blocks at step 1: what makes `auto` swap to pre-LN (a
    real band takes a deep post-LN stack hundreds of steps; the swap's checkpoint is the point).
    """

    name: ClassVar[str] = "starved"
    requires: ClassVar[tuple[str, ...]] = ("loss",)

    def update(self, record: StepRecord) -> list[Finding]:
        if record.step != 1:
            return []
        return [Finding("depth_imbalance", 1, 1, Severity.WARNING, "blocks starved", {})]

    def finish(self) -> list[Finding]:
        return []

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore."""


class PostLNEncoderLM(pl.LightningModule):
    """A user's own post-LN LM on ``nn.TransformerEncoder`` (no final norm), no LR warmup."""

    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok = nn.Embedding(VOCAB, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.size(1))
        out: Tensor = self.head(self.encoder(self.tok(ids), mask=mask, is_causal=True))
        return out

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        (ids,) = batch
        logits = self(ids[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        constant = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": constant, "interval": "step"}}


class RestoringEncoderLM(PostLNEncoderLM):
    """The same module with the one line `load_from_checkpoint` needs."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        restore_pre_ln(self, checkpoint)


class SwitchedEncoderLM(PostLNEncoderLM):
    """A module whose hyperparameters say its norm placement (and that gives a pre-LN stack its
    final norm): a plain `load_from_checkpoint` builds it as the model it became."""

    def __init__(self, norm_first: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        layer = nn.TransformerEncoderLayer(
            16, 2, 32, dropout=0.0, batch_first=True, norm_first=norm_first
        )
        final = nn.LayerNorm(16) if norm_first else None
        self.encoder = nn.TransformerEncoder(layer, 4, norm=final, enable_nested_tensor=False)


def _trainer(tmp_path: Path, steps: int, policy: str = "auto") -> pl.Trainer:
    detectors = [*default_detectors(), Starved()] if policy == "auto" else None
    return pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
        callbacks=[
            StabilityMonitor(policy=policy, jsonl=False, detectors=detectors),
            ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True),
        ],
    )


def _data() -> DataLoader[tuple[Tensor, ...]]:
    torch.manual_seed(0)
    return DataLoader(TensorDataset(torch.randint(0, VOCAB, (32, SEQ))), batch_size=4)


@pytest.fixture
def swapped_run(tmp_path: Path) -> tuple[PostLNEncoderLM, Path]:
    """A user's post-LN module trained 4 steps under `auto`: swapped at step 1, checkpointed."""
    torch.manual_seed(0)
    model = PostLNEncoderLM()
    _trainer(tmp_path, steps=4).fit(model, _data())
    assert model.encoder.norm is not None and model.encoder.layers[0].norm_first
    path = tmp_path / "ckpt" / "last.ckpt"
    assert swapped_in(torch.load(path, weights_only=True))
    return model, path


@pytest.mark.parametrize("policy", ["auto", "protect", "observe"])
def test_trainer_resumes_from_the_checkpoint_of_a_swapped_model(
    swapped_run: tuple[PostLNEncoderLM, Path], tmp_path: Path, policy: str
) -> None:
    """The regression: the fresh module had no ``encoder.norm`` ("Unexpected key(s) ..."), and
    only `auto` could resume it."""
    _, path = swapped_run
    fresh = PostLNEncoderLM()
    trainer = _trainer(tmp_path / "resumed", steps=6, policy=policy)
    trainer.fit(fresh, _data(), ckpt_path=str(path))
    assert trainer.global_step == 6
    assert fresh.encoder.norm is not None and fresh.encoder.layers[0].norm_first
    optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert all(id(p) in optimized for p in fresh.parameters())  # the new norm trains too
    assert len(trainer.optimizers[0].param_groups) == 2  # as in the run that swapped
    # The resumed run's own checkpoint still records the swap, whatever its policy.
    assert swapped_in(torch.load(tmp_path / "resumed" / "ckpt" / "last.ckpt", weights_only=True))


def test_plain_load_from_checkpoint_builds_the_model_it_became(tmp_path: Path) -> None:
    # No line added to the module: its hyperparameters (norm_first) are saved as pre-LN.
    torch.manual_seed(0)
    model = SwitchedEncoderLM()
    _trainer(tmp_path, steps=4).fit(model, _data())
    assert model.encoder.layers[0].norm_first and model.encoder.norm is not None
    loaded = SwitchedEncoderLM.load_from_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    assert loaded.hparams["norm_first"] is True
    ids = torch.randint(0, VOCAB, (2, SEQ))
    model.eval(), loaded.eval()
    torch.testing.assert_close(loaded(ids), model(ids))


def test_load_from_checkpoint_with_the_one_line(swapped_run: tuple[PostLNEncoderLM, Path]) -> None:
    trained, path = swapped_run
    loaded = RestoringEncoderLM.load_from_checkpoint(path)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    trained.eval(), loaded.eval()
    torch.testing.assert_close(loaded(ids), trained(ids))
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*encoder\.norm\.weight"):
        PostLNEncoderLM.load_from_checkpoint(path)  # what the one line is for


def test_litgpt_loads_back_as_the_pre_ln_model_it_became(tmp_path: Path) -> None:
    """The reference GPT's swap is a flag outside the state dict: without the record it
    would load silently as post-LN and compute something else."""
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=16, block_size=SEQ, norm_position="post"
    )
    model = LitGPT(config, warmup_steps=0, max_steps=4)
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (32, SEQ))
    data = DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=4)
    _trainer(tmp_path, steps=4).fit(model, data)
    assert all(block.norm_position == "pre" for block in model.model.blocks)
    loaded = LitGPT.load_from_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    assert all(block.norm_position == "pre" for block in loaded.model.blocks)
    ids = torch.randint(0, VOCAB, (2, SEQ - 1))
    model.eval(), loaded.eval()
    torch.testing.assert_close(loaded(ids), model(ids))
