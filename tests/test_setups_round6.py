"""Round 6: setups outside the suite, each as a user writes it (`setups_harness.check`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from setups_harness import check
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


@pytest.mark.parametrize("name", list(LOOP))
def test_a_loop_setup_holds(name: str, tmp_path: Path) -> None:
    check(
        LOOP[name], tmp_path, micro=MICRO.get(name, 0), optimizers=OPTIMIZERS.get(name, 1),
        scaler_skips=SCALER_SKIPS.get(name, 0),
    )  # fmt: skip


@pytest.mark.parametrize("name", list(LIGHTNING))
def test_a_lightning_setup_holds(name: str, tmp_path: Path) -> None:
    check(
        LIGHTNING[name], tmp_path, micro=MICRO.get(name, 0), optimizers=OPTIMIZERS.get(name, 1),
        fits=FITS.get(name, 1),
    )  # fmt: skip


@pytest.mark.parametrize("name", list(HF))
def test_an_hf_trainer_setup_holds(name: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    check(HF[name], tmp_path, micro=MICRO.get(name, 0))
