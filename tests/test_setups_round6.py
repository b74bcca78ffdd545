"""Round 6: setups outside the suite, each as a user writes it (`setups_harness.check`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from setups_grads import GRADS
from setups_harness import NAN, check
from setups_hf import HF
from setups_lightning import LIGHTNING
from setups_loop import LOOP

MICRO = {
    "accumulate-nan-middle": 1,
    "fabric-accumulate-no_backward_sync": 1,
    "pl-accumulate-nan-middle": 1,
}
OPTIMIZERS = {
    "shared-parameter-two-optimizers": 2,
    "muon-and-adamw": 2,
    "pl-manual-two-optimizers-toggle": 2,
}
FITS = {"pl-resume-mid-epoch": 2}
SCALER_SKIPS = {"gradscaler-unscale-clip": 2}


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Tiny models: one torch thread (see conftest)."""


SETUPS = {**LOOP, **GRADS, **LIGHTNING, **HF}
SLOW = {  # (dynamo: 6-12 s each; inductor's C++ build ~90 s on a loaded machine)
    "compile-aot_eager",
    "compile-inductor",
    "hf-torch-compile",
    "fabric-compile-eager",
}
OWN_TEST = ("accumulate-across-blocks", "pl-manual-accumulation")  # (checked below, and more)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else [])
        for name in SETUPS
        if name not in OWN_TEST
    ],
)
def test_a_setup_holds(name: str, tmp_path: Path) -> None:
    """The healthy run as without the monitor, the NaN step skipped, every claim true
    (`setups_harness.check`); the names say the host (``pl-``: Lightning, ``hf-``: the HF
    Trainer, ``fabric-``: Fabric, the rest a plain loop)."""
    if name in HF:
        pytest.importorskip("transformers")
    if name == "compile-inductor" and not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("inductor builds C++ on the CPU: no compiler here")
    check(
        SETUPS[name], tmp_path, micro=MICRO.get(name, 0), optimizers=OPTIMIZERS.get(name, 1),
        scaler_skips=SCALER_SKIPS.get(name, 0), fits=FITS.get(name, 1),
    )  # fmt: skip


@pytest.mark.parametrize("name", OWN_TEST)
def test_a_backward_a_later_step_takes_is_part_of_that_step(name: str, tmp_path: Path) -> None:
    """Manual accumulation (Lightning's recipe: step every N batches; a loop stepping every
    second block): a block that stepped nothing is no abandoned step when its gradients are
    still there for the next one. Its loss is in that step's record, and a NaN input in it is
    named as the root cause, not called transient."""
    trained = check(SETUPS[name], tmp_path)
    healthy, nan = trained["healthy"], trained["nan"]
    for t in (healthy, nan):
        assert not [line for line in t.lines if "abandoned" in line], t.lines
    halves = healthy.ctx.losses
    losses = [r["values"]["loss"] for r in healthy.rows if r["type"] == "step"]
    sums = [a + b for a, b in zip(halves[::2], halves[1::2], strict=True)]
    assert losses == pytest.approx(sums, rel=1e-5)
    (cause,) = [f for f in nan.front.findings if f.kind == "root_cause"]
    assert "input batch holds NaN" in cause.seen and "micro-batch 1 of 2" in cause.seen


def test_a_block_whose_gradients_were_zeroed_in_place_is_abandoned(tmp_path: Path) -> None:
    """A loop that ``continue``s past its own NaN loss and zeroes with
    ``zero_grad(set_to_none=False)`` (the same gradient tensors, written in place): that block
    is abandoned, and the healthy step after it is neither withheld nor called NaN."""
    from setups_harness import Ctx, Net, mse, train

    from stabilizer.hosts.loop import Stabilizer

    def run(ctx: Ctx) -> Stabilizer:
        net = Net()
        ctx.nan(net.a)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        with Stabilizer(net, opt, jsonl=ctx.jsonl) as stab:
            for i, (x, y) in enumerate(ctx.batches()):
                ctx.begin(i, [net], [opt])
                with stab.step():
                    opt.zero_grad(set_to_none=False)
                    loss = mse(net(x), y)
                    stab.backward(loss)
                    if not torch.isfinite(loss):
                        continue
                    opt.step()
        return stab

    t = train(run, Ctx(tmp_path, monitored=True, nan_at=3))
    assert t.front.skipped_steps == 0 and t.front.host.step == 5
    assert not [f for f in t.front.findings if f.kind in NAN], t.front.findings
    assert [line for line in t.lines if "abandoned" in line]
