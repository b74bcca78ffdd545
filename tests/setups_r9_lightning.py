"""Round 9's setups under Lightning's ``Trainer``, each as a user writes it: an overridden
``optimizer_step`` (the docs' manual warm-up), a hook logging ``grad_norm``, the Trainer's
run-length flags, ``detect_anomaly``, the usual callbacks beside the monitor, pure fp16."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from setups_harness import STEPS, Ctx
from setups_lightning import Capture, Lit, fit
from torch import Tensor
from torch.utils.data import DataLoader

from stabilizer.callbacks.monitor import StabilityMonitor


class Warmup(Lit):
    """The docs' recipe: ``optimizer_step`` overridden to warm the LR up by hand."""

    def optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: Any, closure: Any = None
    ) -> None:
        optimizer.step(closure=closure)
        if self.trainer.global_step < 4:
            scale = min(1.0, float(self.trainer.global_step + 1) / 4)
            for group in optimizer.param_groups:
                group["lr"] = scale * 1e-2


def manual_warmup(ctx: Ctx) -> Any:
    return fit(ctx, Warmup(ctx))


class LogsGradNorm(Lit):
    """``on_before_optimizer_step`` logging Lightning's ``grad_norm`` (its docs' recipe)."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        from lightning.pytorch.utilities import grad_norm

        self.log_dict(grad_norm(self.net, norm_type=2))


def logs_grad_norm(ctx: Ctx) -> Any:
    return fit(ctx, LogsGradNorm(ctx), gradient_clip_val=1.0)


def fast_dev_run(ctx: Ctx) -> Any:
    return fit(ctx, Lit(ctx), fast_dev_run=STEPS, max_steps=-1)


def overfit_batches(ctx: Ctx) -> Any:
    """``overfit_batches=2``: the same two batches over and over (epochs of 2 steps)."""
    return fit(ctx, Lit(ctx), overfit_batches=2, max_epochs=3, max_steps=-1)


def limit_batches(ctx: Ctx) -> Any:
    return fit(ctx, Lit(ctx), ctx.batches(steps=5), limit_train_batches=3, max_epochs=2,
               max_steps=-1)  # fmt: skip


def max_time(ctx: Ctx) -> Any:
    return fit(ctx, Lit(ctx), max_time={"minutes": 5})


def detect_anomaly(ctx: Ctx) -> Any:
    """``Trainer(detect_anomaly=True)`` beside the monitor; the NaN is a NaN input (a forward
    hook's NaN would make anomaly mode raise in the backward, with or without the monitor)."""
    return fit(ctx, Lit(ctx), ctx.batches(nan_input=True), detect_anomaly=True)


class Validated(Lit):
    def validation_step(self, batch: tuple[Tensor, Tensor], i: int) -> None:
        self.log("val_loss", ((self(batch[0]) - batch[1]) ** 2).mean())

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, 2)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def callbacks_beside(ctx: Ctx) -> Any:
    """``ModelCheckpoint`` + ``EarlyStopping`` + ``LearningRateMonitor`` with a CSV logger,
    validation at half-epochs (``val_check_interval=0.5``)."""
    from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    lit = Validated(ctx)
    monitor = StabilityMonitor(jsonl=ctx.jsonl) if ctx.monitored else None
    trainer = pl.Trainer(
        accelerator="cpu", logger=CSVLogger(ctx.tmp / "logs"), enable_progress_bar=False,
        enable_model_summary=False, max_steps=STEPS, val_check_interval=0.5,
        num_sanity_val_steps=0, default_root_dir=str(ctx.tmp), log_every_n_steps=1,
        callbacks=[
            Capture(ctx), *([monitor] if monitor else []),
            ModelCheckpoint(monitor="val_loss", dirpath=ctx.tmp / "ckpt", save_top_k=2),
            EarlyStopping(monitor="val_loss", patience=10),
            LearningRateMonitor(logging_interval="step"),
        ],
    )  # fmt: skip
    val = DataLoader(ctx.batches(steps=2), batch_size=None)
    trainer.fit(lit, DataLoader(ctx.batches(), batch_size=None), val)
    return monitor


def swa_callback(ctx: Ctx) -> Any:
    """``StochasticWeightAveraging`` from epoch 1 (2 epochs of 3 batches)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    swa = StochasticWeightAveraging(swa_lrs=5e-3, swa_epoch_start=1, annealing_epochs=1)
    return fit(ctx, Lit(ctx), ctx.batches(steps=3), callbacks=(swa,), max_epochs=2, max_steps=-1)


def sixteen_true(ctx: Ctx) -> Any:
    """Pure fp16 weights with an eps fp16 can hold (AdamW's default 1e-8 is 0 there: that
    run's weights turn NaN without the monitor, and it undoes each such step)."""

    def configure(opt: Any) -> Any:
        return torch.optim.AdamW([p for g in opt.param_groups for p in g["params"]], lr=1e-2,
                                 eps=1e-4)  # fmt: skip

    return fit(ctx, Lit(ctx, configure=configure), precision="16-true")


def bf16_true(ctx: Ctx) -> Any:
    return fit(ctx, Lit(ctx), precision="bf16-true")


class Cyclic(Lit):
    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9)
        sched = torch.optim.lr_scheduler.CyclicLR(opt, 1e-3, 1e-2, step_size_up=2)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def cyclic(ctx: Ctx) -> Any:
    return fit(ctx, Cyclic(ctx))


class Restarts(Lit):
    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        lr = torch.optim.lr_scheduler
        sched = lr.SequentialLR(
            opt,
            [lr.LinearLR(opt, 0.1, total_iters=2), lr.CosineAnnealingWarmRestarts(opt, 2)],
            milestones=[2],
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def sequential_restarts(ctx: Ctx) -> Any:
    return fit(ctx, Restarts(ctx))


class SkipsOwnNan(Lit):
    """``training_step`` returning None on a non-finite loss (the user skips it: Lightning's
    way to skip a batch)."""

    def training_step(self, batch: tuple[Tensor, Tensor], i: int) -> Any:
        loss = ((self(batch[0]) - batch[1]) ** 2).mean()
        return loss if torch.isfinite(loss) else None


def skips_own_nan(ctx: Ctx) -> Any:
    return fit(ctx, SkipsOwnNan(ctx))


LIGHTNING9 = {
    "pl-optimizer_step-manual-warmup": manual_warmup,
    "pl-on_before_optimizer_step-grad_norm": logs_grad_norm,
    "pl-fast_dev_run": fast_dev_run,
    "pl-overfit_batches": overfit_batches,
    "pl-limit_train_batches": limit_batches,
    "pl-max_time": max_time,
    "pl-detect_anomaly": detect_anomaly,
    "pl-checkpoint-earlystop-lrmonitor": callbacks_beside,
    "pl-stochastic-weight-averaging": swa_callback,
    "pl-16-true": sixteen_true,
    "pl-bf16-true": bf16_true,
    "pl-cyclic-lr-momentum": cyclic,
    "pl-sequential-warm-restarts": sequential_restarts,
    "pl-training_step-returns-None-on-nan": skips_own_nan,
}


class ManualSam(Lit):
    """SAM under manual optimization (its README's recipe): two forward-backward passes,
    ``first_step`` and ``second_step``; the base optimizer steps inside the second."""

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx)
        self.automatic_optimization = False

    def training_step(self, batch: tuple[Tensor, Tensor], i: int) -> None:
        opt: Any = self.optimizers()
        x, y = batch
        self.manual_backward(((self(x) - y) ** 2).mean())
        opt.first_step(zero_grad=True)
        self.manual_backward(((self(x) - y) ** 2).mean())
        opt.second_step(zero_grad=True)

    def configure_optimizers(self) -> Any:
        from setups_r9_loop import SAM

        return SAM(self.parameters(), torch.optim.SGD, lr=1e-2, momentum=0.9)


def manual_sam(ctx: Ctx) -> Any:
    return fit(ctx, ManualSam(ctx), by_batch=1, max_steps=-1, max_epochs=1)


def sixteen_mixed(ctx: Ctx) -> Any:
    """``precision="16-mixed"`` on the CPU (fp16 autocast, torch's CPU grad scaler)."""
    return fit(ctx, Lit(ctx), precision="16-mixed", gradient_clip_val=1.0)


def accumulation_scheduler(ctx: Ctx) -> Any:
    """``GradientAccumulationScheduler({0: 1, 1: 2})``: one batch a step in epoch 0, two
    from epoch 1 (4 batches an epoch); the NaN at step 3, epoch 1's second step."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    sched = GradientAccumulationScheduler({0: 1, 1: 2})
    return fit(ctx, Lit(ctx), ctx.batches(steps=4), callbacks=(sched,), max_epochs=2,
               max_steps=-1)  # fmt: skip


LIGHTNING9.update({
    "pl-manual-sam": manual_sam,
    "pl-16-mixed-cpu": sixteen_mixed,
    "pl-accumulation-scheduler": accumulation_scheduler,
})  # fmt: skip


def lookahead(ctx: Ctx) -> Any:
    """A Lookahead wrapper (timm's shape) under automatic optimization: Lightning calls the
    wrapper's ``step(closure)``, which steps the base optimizer."""
    from setups_r9_loop import Lookahead

    return fit(ctx, Lit(ctx, configure=Lookahead), gradient_clip_val=1.0)


LIGHTNING9["pl-lookahead-wrapper"] = lookahead


class ManualClosure(Lit):
    """Manual optimization with a closure (Lightning's docs: ``opt.step(closure=closure)``,
    the closure doing ``zero_grad`` and ``manual_backward``)."""

    def __init__(self, ctx: Ctx, lbfgs: bool = False) -> None:
        super().__init__(ctx)
        self.automatic_optimization, self.lbfgs = False, lbfgs

    def training_step(self, batch: tuple[Tensor, Tensor], i: int) -> None:
        opt: Any = self.optimizers()

        def closure() -> Tensor:
            loss = ((self(batch[0]) - batch[1]) ** 2).mean()
            opt.zero_grad()
            self.manual_backward(loss)
            return loss

        opt.step(closure=closure)

    def configure_optimizers(self) -> Any:
        if self.lbfgs:
            return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def manual_closure(ctx: Ctx) -> Any:
    return fit(ctx, ManualClosure(ctx))


def manual_lbfgs(ctx: Ctx) -> Any:
    return fit(ctx, ManualClosure(ctx, lbfgs=True))


LIGHTNING9.update({
    "pl-manual-closure": manual_closure,
    "pl-manual-lbfgs-closure": manual_lbfgs,
})  # fmt: skip
