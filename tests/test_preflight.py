"""Tests of the preflight checks: the causal self-check and the configuration risks."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from stabilizer.callbacks.monitor import StabilityMonitor
from stabilizer.core.records import Finding, Severity
from stabilizer.demo.model import GPT, GPTConfig
from stabilizer.live.preflight import (
    PREFLIGHT_CHECKS,
    causal_by_design,
    causal_self_check,
    config_risks,
    preflight_switches,
)

TINY = {"vocab_size": 64, "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 12}
SAFE: dict[str, Any] = {
    "warmup_steps": 100,
    "precision": "32-true",
    "gradient_clip_val": 1.0,
    "seq_len": 12,
    "max_positions": 12,
}


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_gpt(**overrides: Any) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**TINY, **overrides}))


def ids(batch: int = 3) -> Tensor:
    g = torch.Generator().manual_seed(0)
    out = torch.randint(0, TINY["vocab_size"], (batch, TINY["block_size"]), generator=g)
    out[0, -1] = 0  # the check must change a 0 to something else, too
    return out


class EncoderLM(nn.Module):
    """A tiny LM on ``nn.TransformerEncoder``, with or without its causal mask."""

    def __init__(self, causal: bool, norm_first: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.causal = causal
        self.tok = nn.Embedding(TINY["vocab_size"], 16)
        layer = nn.TransformerEncoderLayer(
            16, 2, 32, dropout=0.0, batch_first=True, norm_first=norm_first
        )
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, TINY["vocab_size"])

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.size(1)
        mask = nn.Transformer.generate_square_subsequent_mask(T) if self.causal else None
        logits: Tensor = self.head(self.encoder(self.tok(idx), mask=mask, is_causal=self.causal))
        return logits


def only(findings: list[Finding], remedy: str | None) -> list[Finding]:
    return [f for f in findings if (f.remedies[:1] or (None,))[0] == remedy]


# -- causal self-check ---------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["sdpa", "manual"])
@pytest.mark.parametrize("norm_position", ["pre", "post"])
@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_reference_gpt_is_causal(attention: str, norm_position: str, positions: str) -> None:
    model = tiny_gpt(attention=attention, norm_position=norm_position, positions=positions)
    assert causal_self_check(model, ids()) == []


def test_encoder_with_its_mask_is_causal() -> None:
    assert causal_self_check(EncoderLM(causal=True), ids()) == []


def test_full_attention_mask_leaks_from_position_0() -> None:
    model = tiny_gpt(attention="manual")
    for block in model.blocks:
        block.attn.mask.fill_(True)  # every position attends to every other
    [finding] = causal_self_check(model, ids(), step=7)
    assert (finding.kind, finding.severity, finding.step) == ("causal_leak", Severity.CRITICAL, 7)
    assert finding.evidence["first_position"] == 0
    assert finding.evidence["positions_changed"] == TINY["block_size"] - 1
    assert finding.evidence["max_abs_diff"] > 0
    assert "training loss will look excellent and generation will fail" in finding.message
    assert "position 0" in finding.message


def test_encoder_without_mask_leaks_from_position_0() -> None:
    [finding] = causal_self_check(EncoderLM(causal=False), ids())
    assert finding.evidence["first_position"] == 0


def test_first_leaking_position_is_reported() -> None:
    model = tiny_gpt(attention="manual")
    model.blocks[1].attn.mask[5:].fill_(True)  # queries from position 5 on see the future
    [finding] = causal_self_check(model, ids())
    assert finding.evidence["first_position"] == 5
    assert finding.evidence["positions_changed"] == TINY["block_size"] - 1 - 5


def test_modes_are_restored() -> None:
    model = tiny_gpt(dropout=0.1).train()
    model.blocks[0].eval()  # a module the user keeps in eval mode stays so
    causal_self_check(model, ids())
    assert model.training and model.blocks[1].training and model.blocks[1].attn.training
    assert not model.blocks[0].training and not model.blocks[0].mlp.training


@pytest.mark.parametrize(
    "wrap",
    [lambda t: {"logits": t}, lambda t: SimpleNamespace(logits=t), lambda t: [t, None]],
    ids=["mapping", "attribute", "list"],
)
def test_default_forward_finds_the_logits(wrap: Any) -> None:
    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = EncoderLM(causal=False)

        def forward(self, idx: Tensor) -> Any:
            return wrap(self.inner(idx))

    assert len(causal_self_check(Wrapped(), ids())) == 1


def test_custom_forward() -> None:
    model = EncoderLM(causal=False)
    calls: list[int] = []

    def forward(idx: Tensor) -> Tensor:
        calls.append(idx.size(1))
        out: Tensor = model(idx)
        return out

    assert len(causal_self_check(model, ids(), forward)) == 1
    assert calls == [TINY["block_size"]] * 2


@pytest.mark.parametrize("shape", [(12,), (2, 1), (1, 2, 3)], ids=["1d", "one-position", "3d"])
def test_causal_self_check_rejects_bad_input(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"`input_ids` must be \(B, T\) with T >= 2, got shape"):
        causal_self_check(tiny_gpt(), torch.zeros(shape, dtype=torch.long))


def test_unreadable_output_raises() -> None:
    class Texts(nn.Module):
        def forward(self, idx: Tensor) -> str:
            return "nope"

    with pytest.raises(TypeError, match="must hold a logits tensor, got str"):
        causal_self_check(Texts(), ids())


# -- config risks --------------------------------------------------------------------------------


def test_safe_config_has_no_risks() -> None:
    assert config_risks(tiny_gpt(), **SAFE) == []
    assert config_risks(EncoderLM(causal=True, norm_first=False), **SAFE) == []


@pytest.mark.parametrize(
    ("model", "warmup_steps", "fires"),
    [
        (lambda: tiny_gpt(norm_position="post"), 0, True),
        (lambda: tiny_gpt(norm_position="post"), 100, False),
        (lambda: tiny_gpt(norm_position="post"), None, False),
        (lambda: tiny_gpt(norm_position="pre"), 0, False),
        (lambda: EncoderLM(causal=True, norm_first=False), 0, True),
        (lambda: EncoderLM(causal=True, norm_first=True), 0, False),
    ],
    ids=["gpt-post-0", "gpt-post-100", "gpt-post-unknown", "gpt-pre-0", "enc-post-0", "enc-pre-0"],
)
def test_post_ln_without_warmup(model: Any, warmup_steps: int | None, fires: bool) -> None:
    findings = only(config_risks(model(), **{**SAFE, "warmup_steps": warmup_steps}), "lr_warmup")
    assert len(findings) == int(fires)
    if fires:
        [f] = findings
        assert (f.kind, f.severity, f.remedies) == (
            "config_risk",
            Severity.INFO,  # advice: configuration alone is no failure (#31)
            ("lr_warmup", "swap_to_pre_ln"),
        )
        assert f.evidence["post_ln_blocks"] == 2
        assert f.location in (("blocks.0", "blocks.1"), ("encoder.layers.0", "encoder.layers.1"))


@pytest.mark.parametrize(
    ("precision", "half", "softmax_fp32", "expected"),
    [
        ("16-true", False, False, (5, 2)),  # 2 blocks x 2 + ln_f; 2 attentions
        ("16-true", False, True, (5, 0)),
        ("32-true", True, False, (5, 2)),  # the weights are fp16 whatever the setting says
        ("16-mixed", False, False, None),  # autocast keeps LayerNorm and softmax in fp32
        ("bf16-true", False, False, None),
        ("32-true", False, False, None),
    ],
    ids=["16-true", "16-true-softmax-fp32", "half-weights", "16-mixed", "bf16-true", "32-true"],
)
def test_fp16_norms_and_softmax(
    precision: str, half: bool, softmax_fp32: bool, expected: tuple[int, int] | None
) -> None:
    model = tiny_gpt(softmax_fp32=softmax_fp32)
    if half:
        model.half()
    findings = only(config_risks(model, **{**SAFE, "precision": precision}), "upcast_to_fp32")
    if expected is None:
        assert findings == []
        return
    [f] = findings
    assert f.severity == Severity.INFO  # advice (#31)
    assert (f.evidence["fp16_norms"], f.evidence["fp16_softmax"]) == expected
    assert "blocks.0.ln_1" in f.location and "ln_f" in f.location
    assert ("blocks.1.attn" in f.location) == (expected[1] > 0)


def test_fp16_encoder_counts_its_attention() -> None:
    findings = only(
        config_risks(EncoderLM(causal=True), **{**SAFE, "precision": "16-true"}), "upcast_to_fp32"
    )
    assert (findings[0].evidence["fp16_norms"], findings[0].evidence["fp16_softmax"]) == (4, 2)


@pytest.mark.parametrize(("clip", "fires"), [(None, True), (0.0, True), (1.0, False)])
def test_no_gradient_clipping_is_info(clip: float | None, fires: bool) -> None:
    findings = only(
        config_risks(tiny_gpt(), **{**SAFE, "gradient_clip_val": clip}), "clip_gradients"
    )
    assert len(findings) == int(fires)
    if fires:
        assert (findings[0].kind, findings[0].severity) == ("config_risk", Severity.INFO)


@pytest.mark.parametrize(
    ("seq_len", "max_positions", "fires"),
    [(13, 12, True), (12, 12, False), (None, 12, False), (13, None, False)],
)
def test_sequence_longer_than_positions_is_critical(
    seq_len: int | None, max_positions: int | None, fires: bool
) -> None:
    args = {**SAFE, "seq_len": seq_len, "max_positions": max_positions}
    findings = [f for f in config_risks(tiny_gpt(), **args) if f.severity == Severity.CRITICAL]
    assert len(findings) == int(fires)
    if fires:
        assert findings[0].evidence == {"seq_len": 13.0, "max_positions": 12.0}
        assert "exceeds" in findings[0].message


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"warmup_steps": -1}, "`warmup_steps` must be >= 0 or None, got -1"),
        ({"gradient_clip_val": -0.5}, "`gradient_clip_val` must be >= 0 or None, got -0.5"),
        ({"seq_len": 0}, "`seq_len` must be >= 1 or None, got 0"),
        ({"max_positions": 0}, "`max_positions` must be >= 1 or None, got 0"),
    ],
    ids=["warmup", "clip", "seq_len", "max_positions"],
)
def test_config_risks_rejects_bad_arguments(override: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        config_risks(tiny_gpt(), **{**SAFE, **override})


def test_findings_serialise() -> None:
    findings = config_risks(
        tiny_gpt(norm_position="post"),
        warmup_steps=0,
        precision="16-true",
        gradient_clip_val=None,
        seq_len=20,
        max_positions=12,
    )
    assert len(findings) == 4
    assert [Finding.from_dict(f.to_dict()) for f in findings] == findings


def test_a_frozen_post_ln_stack_gets_no_warmup_advice() -> None:
    # A pretrained post-LN encoder fine-tuned with its blocks frozen: nothing to warm up.
    model = EncoderLM(causal=True, norm_first=False)
    for p in model.encoder.parameters():
        p.requires_grad_(False)
    assert only(config_risks(model, **{**SAFE, "warmup_steps": 0}), "lr_warmup") == []


# -- switching checks off one by one -------------------------------------------------------------

RISKY: dict[str, Any] = {
    "warmup_steps": 0,
    "precision": "16-true",
    "gradient_clip_val": None,
    "seq_len": 20,
    "max_positions": 12,
}
RULE_REMEDY = {  # each rule's finding, told apart by its first remedy (None: the positions rule)
    "post_ln_warmup": "lr_warmup",
    "fp16_norms": "upcast_to_fp32",
    "clipping": "clip_gradients",
    "positions": None,
}


@pytest.mark.parametrize("off", list(RULE_REMEDY))
def test_each_config_rule_can_be_switched_off_alone(off: str) -> None:
    model = tiny_gpt(norm_position="post")
    checks = [name for name, on in preflight_switches({off: False}).items() if on]
    found = config_risks(model, **RISKY, checks=checks)
    firsts = [(f.remedies[:1] or (None,))[0] for f in found]
    assert firsts == [remedy for name, remedy in RULE_REMEDY.items() if name != off]


@pytest.mark.parametrize(
    ("preflight", "on"),
    [
        (True, set(PREFLIGHT_CHECKS)),
        (False, set()),
        ({"causal": False}, set(PREFLIGHT_CHECKS) - {"causal"}),
        ({"clipping": False, "causal": True}, set(PREFLIGHT_CHECKS) - {"clipping"}),
    ],
    ids=["all", "none", "no-causal", "no-clipping"],
)
def test_preflight_switches(preflight: Any, on: set[str]) -> None:
    assert {name for name, wanted in preflight_switches(preflight).items() if wanted} == on


def test_preflight_switches_reject_unknown_names_and_types() -> None:
    with pytest.raises(
        ValueError, match=r"`preflight` keys must be among causal, .*got \['casual'\]"
    ):
        preflight_switches({"casual": False})
    with pytest.raises(TypeError, match="`preflight` must be a bool or a dict, got str"):
        preflight_switches("causal")  # type: ignore[arg-type]


# -- is the model meant to be causal? -------------------------------------------------------------


def _mlm_batch(seed: int = 0, vocab: int = 64, mask_id: int = 63) -> tuple[Tensor, Tensor]:
    """A BERT-style masked-LM batch: 15% of positions masked, the others' targets ignored."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab - 1, (4, 16), generator=g)
    chosen = torch.rand(tokens.shape, generator=g) < 0.15
    chosen[:, 3] = True  # at least one position per row
    inputs = torch.where(chosen, torch.full_like(tokens, mask_id), tokens)
    return inputs, torch.where(chosen, tokens, torch.full_like(tokens, -100))


def test_causal_by_design() -> None:
    tokens = ids()
    shifted = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], dim=1)
    assert causal_by_design(tokens, shifted) is True  # nanoGPT: y is x shifted by one
    assert causal_by_design(tokens, tokens.clone()) is True  # HF: the model shifts inside
    assert causal_by_design(*_mlm_batch()) is False  # masked LM
    assert causal_by_design(tokens, None) is None
    assert causal_by_design(tokens, torch.full_like(tokens, -100)) is None  # nothing scored
    assert causal_by_design(tokens, tokens[:, 0]) is None  # a label per sequence: not an LM


def test_a_bidirectional_model_by_design_gets_info_not_critical() -> None:
    [finding] = causal_self_check(EncoderLM(causal=False), ids(), bidirectional=True)
    assert (finding.kind, finding.severity) == ("causal_leak", Severity.INFO)
    assert "bidirectional model does by design" in finding.message
    assert finding.evidence["first_position"] == 0
    assert causal_self_check(EncoderLM(causal=True), ids(), bidirectional=True) == []


class MaskedLM(pl.LightningModule):
    """A BERT-style masked LM: a bidirectional encoder, batches ``{"input_ids", "labels"}``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = EncoderLM(causal=False)

    def forward(self, idx: Tensor) -> Tensor:
        out: Tensor = self.model(idx)
        return out

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        logits = self(batch["input_ids"])
        return nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), batch["labels"].reshape(-1), ignore_index=-100
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit_masked_lm(tmp_path: Path, **monitor: Any) -> StabilityMonitor:
    batches = [_mlm_batch(seed) for seed in range(3)]
    data = [{"input_ids": x, "labels": y} for x, y in batches]
    callback = StabilityMonitor(jsonl=False, **monitor)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        default_root_dir=str(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
        callbacks=[callback],
    )
    trainer.fit(MaskedLM(), DataLoader(data, batch_size=None))  # type: ignore[arg-type]
    return callback


def test_masked_lm_on_a_trainer_gets_an_info_not_a_critical(tmp_path: Path) -> None:
    """The regression: a BERT-style run got a critical causal_leak (a false alarm)."""
    [leak] = [f for f in _fit_masked_lm(tmp_path).findings if f.kind == "causal_leak"]
    assert leak.severity == Severity.INFO
    assert "masked-LM objective" in leak.message


def test_the_causal_check_switched_off_alone(tmp_path: Path) -> None:
    found = _fit_masked_lm(tmp_path, preflight={"causal": False}).findings
    assert not [f for f in found if f.kind == "causal_leak"]


class SequenceClassifier(nn.Module):
    """Bidirectional encoder pooled to (batch, classes): no positions in its output."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(64, 8), nn.Linear(8, 3)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.embed(ids).mean(dim=1))  # (B, classes)


def test_a_sequence_classifier_gets_no_causal_finding() -> None:
    ids = torch.randint(0, 64, (2, 8))
    assert causal_self_check(SequenceClassifier(), ids) == []


def test_adam_with_eps_zero_is_a_config_risk() -> None:
    from stabilizer.live.preflight import optimizer_risks

    layer = nn.Linear(2, 2)
    (risk,) = optimizer_risks([torch.optim.Adam(layer.parameters(), eps=0.0)])
    assert risk.kind == "config_risk" and risk.severity == Severity.WARNING
    assert "eps=0" in risk.message
    assert optimizer_risks([torch.optim.Adam(layer.parameters())]) == []
    assert optimizer_risks([torch.optim.SGD(layer.parameters(), lr=0.1)]) == []
