"""The Stabilizer in a plain PyTorch loop: nanoGPT's training loop, a few lines added.

    python examples/plain_loop.py --steps 40 --nan-at 20
    torchrun --standalone --nproc-per-node 2 examples/plain_loop.py --nan-at 10   # DDP (gloo)

The reference GPT (`stabilizer.demo.model`) trained on the byte-level stdlib corpus (nothing to
download), in the loop nanoGPT's ``train.py`` writes: micro-batches accumulated into each step,
DDP's gradient sync only on the last of them. The Stabilizer adds five lines (marked ``# +``):
it guards the optimizer, clips the gradient norm at 1.0 after measuring it, and writes
``stability.jsonl`` to ``--log-dir``. With ``--nan-at`` block 1's MLP outputs NaN at that step
(on rank ``--nan-rank`` only, under torchrun): the step is skipped on every rank, the module is
named, and each rank prints a checksum of its weights at the end: under DDP they match.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sys

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from stabilizer import Stabilizer
from stabilizer.demo.data import RandomWindows, load_corpus
from stabilizer.demo.model import GPT, GPTConfig


def inject_nan(model: GPT, at: dict[str, int], rank: int) -> None:
    """Block 1's MLP outputs NaN at step ``at["nan"]`` on rank `rank` (a fault on one device)."""

    def hook(module: nn.Module, args: object, out: Tensor) -> Tensor | None:
        hit = at["step"] == at["nan"] and rank == at["rank"]
        return out * float("nan") if module.training and hit else None

    model.get_submodule("blocks.1.mlp").register_forward_hook(hook)


def weights_digest(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--nan-at", type=int, default=-1, help="step whose block-1 MLP goes NaN")
    parser.add_argument("--nan-rank", type=int, default=-1, help="only on this rank (torchrun)")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--log-dir", default="runs/plain_loop")
    args = parser.parse_args()
    ddp = "RANK" in os.environ  # started by torchrun
    if ddp:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
    torch.manual_seed(0)  # the same initial weights on every rank
    corpus = load_corpus()
    data = RandomWindows(corpus.train, 64, 8, args.steps * args.accumulate * world, seed=0)
    at = {"step": 0, "nan": args.nan_at, "rank": args.nan_rank if ddp else rank}
    gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64))
    inject_nan(gpt, at, rank)
    ddp_model = DistributedDataParallel(gpt) if ddp else None
    model = ddp_model or gpt
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    stab = Stabilizer(model, optimizer, clip=1.0, log_dir=args.log_dir)  # +
    for step in range(args.steps):
        at["step"] = step
        with stab.step():  # +
            for micro in range(args.accumulate):
                last = micro == args.accumulate - 1
                # DDP averages the gradients across ranks at the last micro-batch only
                sync = ddp_model.no_sync() if ddp_model and not last else contextlib.nullcontext()
                x, y = data[(step * args.accumulate + micro) * world + rank]
                with sync:
                    _, loss = model(x, y)
                    stab.backward(loss / args.accumulate)  # + (was: loss.backward())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if stab.should_stop:  # +
            break
    stab.close()  # +
    if ddp:  # one write per line: every rank prints to the same terminal (print writes twice)
        line = f"rank {rank}: step {stab.host.step}, {stab.skipped_steps} skipped, "
        sys.stdout.write(line + f"weights {weights_digest(gpt)}\n")
        sys.stdout.flush()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
