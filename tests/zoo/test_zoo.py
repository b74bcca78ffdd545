"""The zoo: the monitor on models nobody here designed, each trained with a real ``Trainer``.

Every Hugging Face family that builds from a tiny config (`zoo_hf`) and the ``torch.nn`` idioms
of PyTorch's docs and common code (`zoo_torch`), each trained `STEPS` steps:

- without the monitor, twice: the runs are bit-identical (so comparing with the monitor's run
  is sound: same data order, init, dropout masks);
- healthy, under ``observe``, ``protect`` and ``auto``: no finding at WARNING or above, no
  step skipped, no stop, every step run and recorded in the JSONL; under ``observe`` and
  ``protect`` every parameter, buffer and optimizer-state tensor bit-identical to the run
  without the monitor;
- under ``protect`` with one module's output turned NaN at batch `FAULT`: that step skipped,
  leaving parameters, optimizer state and buffers bit-identical across it; the root cause names
  that module; the run goes on to the end, and nothing finite at the start is non-finite; and
  it ends bit-identical to the same run with ``root_cause=False`` (the replay leaves no trace).

When a model trips a detector, teach the detector; never loosen these assertions. A failure says
what the monitor did: the run's steps and stop, every finding at WARNING or above, the stop line.
Each run is trained once per session and shared by the assertions on it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from zoo_harness import FAULT, STEPS, Case, Outcome, outcome
from zoo_hf import HF_CASES
from zoo_tensors import differences, nonfinite_names
from zoo_torch import TORCH_CASES

pytestmark = pytest.mark.slow  # ~3 min on 2 cores in all; every test runs in CI

POLICIES = ("observe", "protect", "auto")


def _params(cases: list[Case], *packages: str) -> list[object]:
    """Cases as pytest params; skipped where an optional package is missing (never in CI,
    which installs them: there a missing package fails)."""
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    marks = [pytest.mark.skip(reason=f"needs {', '.join(missing)}")]
    skip = missing and not os.environ.get("CI")
    return [pytest.param(c, id=c.name, marks=marks if skip else []) for c in cases]


CASES = [
    *_params([c for c in HF_CASES if c.name != "llama_lora"], "transformers"),
    *_params([c for c in HF_CASES if c.name == "llama_lora"], "transformers", "peft"),
    *_params(TORCH_CASES),
]


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Tiny models: one torch thread (see conftest); also what makes the twins comparable."""


@pytest.fixture(scope="session")
def zoo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zoo")


def _report(run: Outcome, problems: list[str]) -> str:
    return "\n".join([*problems, run.account()])


@pytest.mark.parametrize("case", CASES)
def test_two_runs_without_the_monitor_are_bit_identical(case: Case, zoo_root: Path) -> None:
    first, second = outcome(case, None, zoo_root), outcome(case, None, zoo_root, twin=1)
    problems = [f"the fit raised {r.error}" for r in (first, second) if r.error]
    problems += [f"{r.steps}/{STEPS} steps" for r in (first, second) if r.steps != STEPS]
    problems += differences(first.end, second.end)
    assert not problems, _report(second, problems)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", CASES)
def test_a_healthy_run_ends_as_without_the_monitor(case: Case, policy: str, zoo_root: Path) -> None:
    run = outcome(case, policy, zoo_root)
    problems = [f"the fit raised {run.error}"] if run.error else []
    problems += [f"{f.severity.name} {f.kind}: {f.seen[:120]}" for f in run.loud()]
    if run.stopped or run.steps != STEPS:
        problems.append(f"stopped={run.stopped} after {run.steps}/{STEPS} steps")
    if run.skipped:
        problems.append(f"{run.skipped} healthy steps skipped")
    if run.measured != STEPS:  # a monitor that switched itself off would pass the rest
        problems.append(f"the monitor recorded {run.measured}/{STEPS} steps with a finite loss")
    if policy != "auto":
        changed = differences(outcome(case, None, zoo_root).end, run.end)
        problems += [f"not as without the monitor: {line}" for line in changed]
    assert not problems, _report(run, problems)


def _names_the_module(run: Outcome, case: Case) -> bool:
    """The first root cause's location is the module the NaN was put in (a name relative to
    the LightningModule, with or without the wrapper's ``model.``)."""
    causes = [f for f in run.findings if f.kind == "root_cause"]
    assert run.module is not None
    target = run.module.model.get_submodule(case.fault)
    for name in causes[0].location if causes else ():
        for owner in (run.module, run.module.model):
            try:
                if owner.get_submodule(name) is target:
                    return True
            except AttributeError:
                continue
    return False


@pytest.mark.parametrize("case", CASES)
def test_a_nan_in_one_module_is_skipped_and_named(case: Case, zoo_root: Path) -> None:
    run = outcome(case, "protect", zoo_root, fault=True)
    problems = [f"the fit raised {run.error}"] if run.error else []
    assert run.witness is not None
    if run.witness.changed is None:
        problems.append(f"the NaN step (batch {FAULT}) never ran")
    problems += [f"the NaN step changed {line}" for line in run.witness.changed or []]
    if run.skipped != 1:
        problems.append(f"{run.skipped} steps skipped, not exactly the NaN step")
    if not _names_the_module(run, case):
        said = [str(f) for f in run.findings if f.kind == "root_cause"] or ["no root_cause"]
        problems.append(f"the root cause does not name {case.fault}: {said[0]}")
    if run.stopped or run.steps != STEPS:
        problems.append(f"stopped={run.stopped} after {run.steps}/{STEPS} steps")
    new = sorted(nonfinite_names(run.end) - nonfinite_names(run.start))
    problems += [f"non-finite at the end: {name}" for name in new]
    assert not problems, _report(run, problems)


@pytest.mark.parametrize("case", CASES)
def test_the_root_cause_replay_leaves_no_trace(case: Case, zoo_root: Path) -> None:
    """The NaN run ends as the same run with ``root_cause=False``: replaying the bad step to
    name its module changed nothing the training goes on with."""
    run = outcome(case, "protect", zoo_root, fault=True)
    without = outcome(case, "protect", zoo_root, fault=True, root_cause=False)
    problems = [f"the fit raised {r.error}" for r in (run, without) if r.error]
    problems += [f"not as without the replay: {line}" for line in differences(without.end, run.end)]
    assert not problems, _report(run, problems)
