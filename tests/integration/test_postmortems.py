"""Post-mortems that tell the truth: where a worker died, who killed it, the model's
message once. Real workers of the ``malformed-results`` test env (EMT broken on
request; see tests/envs/malformed_results.py)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from ase.calculators.emt import EMT

from rootstock import RootstockCalculator
from rootstock.errors import WorkerDiedError
from rootstock.install.envs import load_installed_env
from rootstock.install.machine import resolve_layout
from rootstock.ops.verify import run_verification
from tests.integration.killing import is_running
from tests.integration.structures import cu

pytestmark = pytest.mark.timeout(600)  # the first test waits for the session's env build

CHECKPOINT = "malformed-results"


@pytest.fixture(autouse=True)
def _isolated_worker(monkeypatch, tmp_path_factory):
    """Private compiler caches and captured worker output (no fake_built_root needed)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "user-cache"))
    monkeypatch.delenv("ROOTSTOCK_WORKER_LOG", raising=False)
    monkeypatch.delenv("ROOTSTOCK_ROOT", raising=False)


def test_a_segfault_in_setup_is_reported_as_loading_the_model(malformed_root: Path):
    with RootstockCalculator(
        root=malformed_root,
        checkpoint=CHECKPOINT,
        device="cpu",
        setup_kwargs={"segfault_in_setup": True},
        timeout=60,
    ) as calc:
        atoms = cu(seed=5)
        atoms.calc = calc
        with pytest.raises(WorkerDiedError) as caught:
            atoms.get_potential_energy()
    err = caught.value
    assert err.worker_exit_code == -signal.SIGSEGV
    assert "while starting up and loading the model (setup)" in err.message
    assert "during a calculation" not in err.message
    assert "Segmentation fault" in err.output_tail  # faulthandler's dump, with the frames


@pytest.mark.parametrize("slow_kill", [False, True], ids=["kill", "slow-kill"])
def test_a_worker_rootstock_killed_itself_is_not_blamed_on_the_oom_killer(
    malformed_root: Path, monkeypatch: pytest.MonkeyPatch, slow_kill: bool
):
    """The model exits, but a thread it started keeps the closed worker alive.

    ``slow-kill`` stands for a loaded machine, where the killer is descheduled right
    before its SIGKILL: the worker must still die of that SIGKILL, not of its
    lifeline's end-of-file (``STARTER_GONE_EXIT``), which would come first if the
    lifeline were cut before the kill.
    """
    if slow_kill:
        killpg = os.killpg

        def descheduled_killpg(pgid: int, sig: int) -> None:
            time.sleep(0.5)
            killpg(pgid, sig)

        monkeypatch.setattr(os, "killpg", descheduled_killpg)
    atoms = cu(seed=5)
    with RootstockCalculator(
        root=malformed_root, checkpoint=CHECKPOINT, device="cpu", timeout=60
    ) as calc:
        atoms.calc = calc
        atoms.get_potential_energy()
        pid = calc.worker_pid
        atoms.info["malformed"] = {"exit_leaving_thread": True}
        started = time.monotonic()
        with pytest.raises(WorkerDiedError) as caught:
            atoms.get_potential_energy()
        assert time.monotonic() - started < 20
        err = caught.value
        assert "out-of-memory" not in str(err)
        assert "rootstock killed it" in err.message
        assert "during a calculation" in err.message
        assert err.worker_exit_code == -signal.SIGKILL
        assert not is_running(pid)
        del atoms.info["malformed"]
        ref = atoms.copy()
        ref.calc = EMT()
        assert atoms.get_potential_energy() == pytest.approx(ref.get_potential_energy(), abs=1e-10)


def test_a_dead_worker_is_still_described_by_its_own_exit(malformed_root: Path):
    """A SIGKILL that rootstock did not send keeps its usual explanation."""
    import threading

    atoms = cu(seed=5)
    with RootstockCalculator(
        root=malformed_root, checkpoint=CHECKPOINT, device="cpu", timeout=60
    ) as calc:
        atoms.calc = calc
        atoms.get_potential_energy()
        atoms.info["malformed"] = {"sleep": 30}
        killer = threading.Timer(1.0, os.kill, args=(calc.worker_pid, signal.SIGKILL))
        killer.start()
        try:
            with pytest.raises(WorkerDiedError) as caught:
                atoms.get_potential_energy()
        finally:
            killer.cancel()
    assert "was killed by SIGKILL" in caught.value.message
    assert "during a calculation" in caught.value.message


def test_the_model_error_text_appears_once_in_a_verification_failure(malformed_root: Path):
    layout = resolve_layout(malformed_root)
    env = load_installed_env(layout, CHECKPOINT)
    text = "modal is required for this checkpoint"
    outcome = run_verification(
        layout, env, CHECKPOINT, device="cpu", kwargs={"setup_error": text}, timeout=60
    )
    assert not outcome.passed
    assert outcome.message.count(text) == 1, outcome.message
    assert "ValueError" in outcome.message and "setup()" in outcome.message
