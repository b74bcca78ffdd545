"""Round 6's setups under Lightning's ``Trainer``, each as a user writes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from setups_harness import STEPS, Ctx, Net, mse
from setups_loop import Checkpointed
from torch import Tensor, nn
from torch.utils.data import DataLoader

from stabilizer.callbacks.monitor import StabilityMonitor


class Capture(pl.Callback):
    """Tells the context each micro-batch's step (the global step, or the batch's index under
    manual optimization, where every optimizer's step counts) and the state at the end."""

    def __init__(self, ctx: Ctx, by_batch: int = 0) -> None:
        self.ctx, self.by_batch = ctx, by_batch

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, i: int) -> None:
        step = i // self.by_batch if self.by_batch else trainer.global_step
        self.ctx.begin(step, [module], trainer.optimizers)

    def on_train_end(self, trainer: pl.Trainer, module: Any) -> None:
        self.ctx.finish([module], trainer.optimizers)


class Lit(pl.LightningModule):
    """The net, AdamW, MSE; `configure` replaces the optimizer set-up."""

    def __init__(self, ctx: Ctx, net: nn.Module | None = None, configure: Any = None) -> None:
        super().__init__()
        self.net = net if net is not None else Net()
        self._configure = configure
        if net is None:
            ctx.nan(self.net.a)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.net(x)
        return out

    def training_step(self, batch: tuple[Tensor, Tensor], i: int) -> Any:
        loss = mse(self(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return self._configure(opt) if self._configure is not None else opt


def fit(
    ctx: Ctx,
    lit: pl.LightningModule,
    data: Any = None,
    callbacks: tuple[pl.Callback, ...] = (),
    by_batch: int = 0,
    ckpt_path: str | None = None,
    **kwargs: Any,
) -> StabilityMonitor | None:
    monitor = StabilityMonitor(jsonl=ctx.jsonl) if ctx.monitored else None
    kwargs.setdefault("max_steps", STEPS)
    trainer = pl.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[Capture(ctx, by_batch), *([monitor] if monitor else []), *callbacks], **kwargs,
    )  # fmt: skip
    loader = DataLoader(data if data is not None else ctx.batches(), batch_size=None)
    trainer.fit(lit, loader, ckpt_path=ckpt_path)
    return monitor


# --- the setups ----------------------------------------------------------------------------


def accumulate(ctx: Ctx) -> Any:
    """``accumulate_grad_batches=3`` and clipping; the middle micro-batch NaN."""
    data = ctx.batches(accumulate=3)
    return fit(ctx, Lit(ctx), data, accumulate_grad_batches=3, gradient_clip_val=1.0)


def epoch_ends_mid_accumulation(ctx: Ctx) -> Any:
    """7 batches, ``accumulate_grad_batches=2``: the epoch's last step has one micro-batch
    (Lightning steps it at the epoch's end); that step is NaN."""
    data = ctx.batches(steps=7)
    return fit(ctx, Lit(ctx), data, accumulate_grad_batches=2, max_steps=-1, max_epochs=1)


class TwoOptimizers(pl.LightningModule):
    """Manual optimization: two optimizers, each with its own loss, ``toggle_optimizer``."""

    def __init__(self, ctx: Ctx) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = Net()
        ctx.nan(self.net.a)

    def training_step(self, batch: tuple[Tensor, Tensor], i: int) -> None:
        first, second = self.optimizers()  # type: ignore[misc]
        for opt in (first, second):
            self.toggle_optimizer(opt)
            loss = mse(self.net(batch[0]), batch[1])
            self.manual_backward(loss)
            opt.step()
            opt.zero_grad()
            self.untoggle_optimizer(opt)

    def configure_optimizers(self) -> Any:
        net = self.net
        first = torch.optim.AdamW([*net.a.parameters(), *net.norm.parameters()], lr=1e-2)
        return first, torch.optim.SGD(net.b.parameters(), lr=1e-2)


def two_optimizers_toggled(ctx: Ctx) -> Any:
    return fit(ctx, TwoOptimizers(ctx), by_batch=1, max_steps=-1, max_epochs=1)


class ManualAccumulation(pl.LightningModule):
    """Manual optimization that accumulates two batches per step (Lightning's documented
    recipe: step every N batches), with a scheduler it steps itself."""

    def __init__(self, ctx: Ctx) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = Net()
        self.losses: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], i: int) -> None:
        opt: Any = self.optimizers()
        loss = mse(self.net(batch[0]), batch[1]) / 2
        self.losses.append(float(loss))
        self.manual_backward(loss)
        if (i + 1) % 2 == 0:
            self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
            self.lr_schedulers().step()  # type: ignore[union-attr]

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 2)]


def manual_accumulation(ctx: Ctx) -> Any:
    """A NaN input in the first batch of step 3's two (batch 6)."""
    lit = ManualAccumulation(ctx)
    data = ctx.batches(accumulate=2, nan_input=True)
    monitor = fit(ctx, lit, data, max_steps=-1, max_epochs=1, by_batch=2)
    ctx.losses = lit.losses
    return monitor


def plateau(ctx: Ctx) -> Any:
    def configure(opt: torch.optim.Optimizer) -> Any:
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        schedule = {"scheduler": sched, "monitor": "train_loss", "interval": "step"}
        return {"optimizer": opt, "lr_scheduler": schedule}

    return fit(ctx, Lit(ctx, configure=configure))


def onecycle(ctx: Ctx) -> Any:
    def configure(opt: torch.optim.Optimizer) -> Any:
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=STEPS)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return fit(ctx, Lit(ctx, configure=configure))


class DictOut(Lit):
    def training_step(self, batch: tuple[Tensor, Tensor], i: int) -> Any:
        out = self(batch[0])
        return {"loss": mse(out, batch[1]), "pred": out.detach()}


def dict_loss(ctx: Ctx) -> Any:
    return fit(ctx, DictOut(ctx))


def checkpointed(ctx: Ctx) -> Any:
    net = Checkpointed(reentrant=False)
    ctx.nan(net.a)
    return fit(ctx, Lit(ctx, net))


def compiled(ctx: Ctx) -> Any:
    torch._dynamo.reset()
    net = Net()
    lit = Lit(ctx, torch.compile(net, backend="eager"))  # type: ignore[arg-type]
    return fit(ctx, lit, ctx.batches(nan_input=True))


def clip_by_value(ctx: Ctx) -> Any:
    return fit(ctx, Lit(ctx), gradient_clip_val=0.1, gradient_clip_algorithm="value")


def ema_weight_averaging(ctx: Ctx) -> Any:
    """Lightning's ``EMAWeightAveraging`` callback (an EMA copy updated after each step)."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    return fit(ctx, Lit(ctx), callbacks=(EMAWeightAveraging(decay=0.9),))


class Backbone(Lit):
    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx)
        self.backbone = self.net.a  # (BackboneFinetuning freezes ``backbone``)

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=1e-2)


def backbone_finetuning(ctx: Ctx) -> Any:
    """``BackboneFinetuning``: the backbone frozen in epoch 0, unfrozen (a param group added)
    at epoch 1; the NaN at epoch 1's first step."""
    from lightning.pytorch.callbacks import BackboneFinetuning

    unfreeze = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.1)
    return fit(ctx, Backbone(ctx), ctx.batches(steps=3), callbacks=(unfreeze,), max_epochs=2)


class Validated(Lit):
    def validation_step(self, batch: tuple[Tensor, Tensor], i: int) -> None:
        self.log("val_loss", mse(self(batch[0]), batch[1]))


def validate_mid_epoch(ctx: Ctx) -> Any:
    """Validation every 2 training batches (a forward of the model outside any step)."""
    lit = Validated(ctx)
    loader = DataLoader(ctx.batches(steps=2), batch_size=None)
    monitor = StabilityMonitor(jsonl=ctx.jsonl) if ctx.monitored else None
    trainer = pl.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, max_steps=STEPS, val_check_interval=2,
        callbacks=[Capture(ctx), *([monitor] if monitor else [])],
    )  # fmt: skip
    trainer.fit(lit, DataLoader(ctx.batches(), batch_size=None), loader)
    return monitor


def reload_each_epoch(ctx: Ctx) -> Any:
    """``reload_dataloaders_every_n_epochs=1``: a new loader each epoch, 3 batches each."""

    class Reloads(Lit):
        def train_dataloader(self) -> Any:
            return DataLoader(ctx.batches(steps=3), batch_size=None)

    monitor = StabilityMonitor(jsonl=ctx.jsonl) if ctx.monitored else None
    trainer = pl.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, max_epochs=2, reload_dataloaders_every_n_epochs=1,
        callbacks=[Capture(ctx), *([monitor] if monitor else [])],
    )  # fmt: skip
    trainer.fit(Reloads(ctx))
    return monitor


def bf16_accumulate_clip(ctx: Ctx) -> Any:
    return fit(
        ctx, Lit(ctx), ctx.batches(accumulate=2), precision="bf16-mixed",
        accumulate_grad_batches=2, gradient_clip_val=1.0,
    )  # fmt: skip


def resume_mid_epoch(ctx: Ctx) -> Any:
    """Trained to step 2 with a checkpoint, then a new Trainer resumes it (``ckpt_path=``)
    mid-epoch and trains to step 6; the NaN at step 3, after the resume."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def once(max_steps: int, ckpt: str | None) -> Any:
        save = ModelCheckpoint(dirpath=ctx.tmp / "ckpt", every_n_train_steps=2, save_top_k=-1)
        monitor = StabilityMonitor(jsonl=ctx.jsonl) if ctx.monitored else None
        trainer = pl.Trainer(
            accelerator="cpu", logger=False, enable_progress_bar=False,
            enable_model_summary=False, max_steps=max_steps, default_root_dir=str(ctx.tmp),
            callbacks=[Capture(ctx), *([monitor] if monitor else []), save],
        )  # fmt: skip
        lit = Lit(ctx)
        trainer.fit(lit, DataLoader(ctx.batches(steps=8), batch_size=None), ckpt_path=ckpt)
        return monitor

    once(2, None)
    return once(STEPS, str(ctx.tmp / "ckpt" / "epoch=0-step=2.ckpt"))


def lr_find_first(ctx: Ctx) -> Any:
    """``Tuner.lr_find`` before the fit, the monitor among the Trainer's callbacks."""
    from lightning.pytorch.tuner import Tuner

    monitor = StabilityMonitor(jsonl=ctx.jsonl) if ctx.monitored else None
    trainer = pl.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, max_steps=STEPS, default_root_dir=str(ctx.tmp),
        callbacks=[Capture(ctx), *([monitor] if monitor else [])],
    )  # fmt: skip
    lit = Lit(ctx)
    lit.lr = 1e-2
    loader = DataLoader(ctx.batches(steps=8), batch_size=None)
    ctx.nan_at, at = -1, ctx.nan_at  # (no NaN inside the search)
    Tuner(trainer).lr_find(lit, loader, num_training=5, min_lr=1e-4, max_lr=1e-2)
    ctx.nan_at, ctx.now = at, -1
    trainer.fit(lit, DataLoader(ctx.batches(), batch_size=None))
    return monitor


LIGHTNING = {
    "pl-accumulate-nan-middle": accumulate,
    "pl-epoch-ends-mid-accumulation": epoch_ends_mid_accumulation,
    "pl-manual-two-optimizers-toggle": two_optimizers_toggled,
    "pl-manual-accumulation": manual_accumulation,
    "pl-reduce-on-plateau-per-step": plateau,
    "pl-onecycle-per-step": onecycle,
    "pl-loss-as-dict": dict_loss,
    "pl-gradient-checkpointing": checkpointed,
    "pl-compile-eager": compiled,
    "pl-clip-by-value": clip_by_value,
    "pl-ema-weight-averaging": ema_weight_averaging,
    "pl-backbone-finetuning": backbone_finetuning,
    "pl-validate-mid-epoch": validate_mid_epoch,
    "pl-reload-dataloaders": reload_each_epoch,
    "pl-bf16-mixed-accumulate-clip": bf16_accumulate_clip,
    "pl-resume-mid-epoch": resume_mid_epoch,
    "pl-lr-find-first": lr_find_first,
}
del Path
