"""Train the reference GPT through one failure scenario with a plain Lightning ``Trainer``.

    python examples/train_scenario.py --scenario spike --steps 200

This spells out what ``stabilizer demo`` does through ``run_scenario``: a LightningModule, a
DataModule over the stdlib corpus, the scenario's fault injection, a Trainer, and the
`StabilityMonitor` that watches it (its lines on stderr, its log in
``LOG_DIR/SCENARIO/stability_logs/version_N/stability.jsonl``, under the scenario's name as the
demo's: ``stabilizer diagnose`` reads it back).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as pl

from stabilizer import StabilityMonitor
from stabilizer.callbacks import FaultInjector, LitGPT, StabilizerDataModule
from stabilizer.callbacks.demo.run import precision_args
from stabilizer.demo.scenarios import SCENARIOS, get_scenario


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=list(SCENARIOS), default="healthy")
    parser.add_argument("--steps", type=int, default=None, help="default: the scenario's")
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--policy", choices=["protect", "observe", "auto"], default="protect")
    parser.add_argument("--log-dir", default="runs", help="where the monitor's log goes")
    args = parser.parse_args(argv)

    sc = get_scenario(args.scenario)
    if args.steps is not None:
        sc = sc.with_steps(args.steps)
    pl.seed_everything(sc.seed)
    model = LitGPT(
        sc.model,
        lr=sc.lr,
        weight_decay=sc.weight_decay,
        eps=sc.adam_eps,
        warmup_steps=sc.warmup_steps,
        max_steps=sc.steps,
        optimizer=sc.optimizer,  # AdamW, or SGD with momentum (spike-sgd)
        momentum=sc.momentum,
    )
    data = StabilizerDataModule(
        block_size=sc.model.block_size,
        batch_size=sc.batch_size,
        max_steps=sc.steps,
        corrupt=sc.corrupted() or None,  # the bad batches (recurring ones too)
        corrupt_fill=sc.corrupt_fill,  # random bytes, or NUL bytes (a zero-filled shard)
    )
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_steps=sc.steps,
        callbacks=[
            FaultInjector(sc.lr_surge, sc.activation_fault, sc.lr_surge_until),
            StabilityMonitor(policy=args.policy),  # the monitor: detection, protection, logs
        ],
        log_every_n_steps=1,
        enable_checkpointing=False,
        logger=False,
        default_root_dir=str(Path(args.log_dir) / sc.name),  # runs/spike/..., as the demo's
        **precision_args(sc.precision, args.accelerator),
    )
    trainer.fit(model, datamodule=data)
    print(f"{sc.name}: final metrics {dict(trainer.callback_metrics)}")


if __name__ == "__main__":
    main()
