"""The Stabilizer in a Lightning Fabric loop: the loop of ``plain_loop.py``, Fabric's way.

    python examples/fabric.py --steps 40 --nan-at 20 [--devices 2]

Fabric sets up the model, the optimizer and the data (``--devices 2``: DDP over two CPU
processes); ``Stabilizer(..., fabric=fabric)`` takes Fabric's backward, precision, grad scaler
and loggers. The lines marked ``# +`` are the Stabilizer's. With ``--nan-at`` block 1's MLP
outputs NaN at that step (on the last rank): the step is skipped on every rank and the module
is named.
"""

from __future__ import annotations

import argparse

import torch
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch.utils.data import DataLoader

from stabilizer import Stabilizer
from stabilizer.demo.data import RandomWindows, load_corpus
from stabilizer.demo.model import GPT, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--nan-at", type=int, default=-1, help="step whose block-1 MLP goes NaN")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--log-dir", default="runs/fabric")
    args = parser.parse_args()
    fabric = Fabric(accelerator="cpu", devices=args.devices)
    fabric.launch()
    torch.manual_seed(0)  # the same initial weights on every rank
    count = args.steps * args.accumulate * args.devices  # each rank reads its share
    windows = RandomWindows(load_corpus().train, 64, 8, count, seed=0)
    loader = fabric.setup_dataloaders(DataLoader(windows, batch_size=None))
    gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64))
    at = {"step": 0}

    def fault(module: nn.Module, inputs: object, out: Tensor) -> Tensor | None:
        hit = at["step"] == args.nan_at and fabric.global_rank == fabric.world_size - 1
        return out * float("nan") if module.training and hit else None

    gpt.get_submodule("blocks.1.mlp").register_forward_hook(fault)
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-3, weight_decay=0.1)
    model, optimizer = fabric.setup(gpt, optimizer)
    stab = Stabilizer(model, optimizer, clip=1.0, fabric=fabric, log_dir=args.log_dir)  # +
    batches = iter(loader)
    for step in range(len(loader) // args.accumulate):
        at["step"] = step
        with stab.step():  # +
            for micro in range(args.accumulate):
                accumulating = micro < args.accumulate - 1
                with fabric.no_backward_sync(model, enabled=accumulating):
                    x, y = next(batches)
                    _, loss = model(x, y)
                    stab.backward(loss / args.accumulate)  # + (was: fabric.backward(loss))
            optimizer.step()
            optimizer.zero_grad()
        if stab.should_stop:  # +
            break
    stab.close()  # +


if __name__ == "__main__":
    main()
