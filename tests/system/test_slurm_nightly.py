"""The shipped SLURM recipe, unedited, on a real single-node SLURM with EMT installs.

Needs the cluster from ``scripts/dev/slurm-up`` (skipped where SLURM is not installed,
failed where it is installed but not answering). The recipe runs as a maintainer would
submit it: ``KNOB=value sbatch scripts/nightly_smoke_test.sbatch``; the knobs
``SMOKE_TEST_ARGS="--device cpu"`` and ``ROOTSTOCK_VENV`` are what make it run here.
Each chain has a job name of its own, a private HOME and a private log directory, and
teardown cancels every job of it. Job times are read in the jobs' time zone
(``JOB_TZ``, not the machine's UTC), where the next run's date must be computed.
"""

from __future__ import annotations

import json
import os
import re
from datetime import date, timedelta
from pathlib import Path

import pytest

from tests.conftest import ENVIRONMENTS, installed_root, run_rootstock
from tests.system.slurm_chain import (
    DEV_VENV,
    NightlyChain,
    job_info,
    kill_workers_of,
    parse_slurm_time,
)

pytestmark = [pytest.mark.system, pytest.mark.timeout(420)]

CRASH_ENV = '''\
"""Test env: each checkpoint breaks verification a different way."""

# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "ase>=3.23",
#     "numpy>=1.24",
# ]
# ///

CHECKPOINTS = {
    "setup-raises": "setup() raises",
    "worker-killed": "the worker is SIGKILLed",
    "smoke-test-killed": "the smoke-test process itself is SIGKILLed",
}


def download(checkpoint, **kw):
    """Nothing to fetch."""
    return None


def setup(checkpoint, device="cuda", **kw):
    """Fail as the checkpoint's name says."""
    import os
    import signal

    if checkpoint == "worker-killed":
        os.kill(os.getpid(), signal.SIGKILL)
    if checkpoint == "smoke-test-killed":
        os.kill(os.getppid(), signal.SIGKILL)
    raise RuntimeError("broken on purpose: the weights file is missing")
'''

SLOW_ENV = '''\
"""Test env: ten EMT checkpoints whose setup() takes SLEEP_S seconds each."""

# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "ase>=3.23",
#     "numpy>=1.24",
# ]
# ///

CHECKPOINTS = {
    "slow-0": "EMT after a sleep",
    "slow-1": "EMT after a sleep",
    "slow-2": "EMT after a sleep",
    "slow-3": "EMT after a sleep",
    "slow-4": "EMT after a sleep",
    "slow-5": "EMT after a sleep",
    "slow-6": "EMT after a sleep",
    "slow-7": "EMT after a sleep",
    "slow-8": "EMT after a sleep",
    "slow-9": "EMT after a sleep",
}
SLEEP_S = 12


def download(checkpoint, **kw):
    """Nothing to fetch."""
    return None


def setup(checkpoint, device="cuda", **kw):
    """EMT, after a pause that stands in for loading a large model."""
    import time

    from ase.calculators.emt import EMT

    time.sleep(SLEEP_S)
    return EMT()
'''

# A stand-in for the `rootstock` command: records the token it was given, then runs
# the real CLI, so the recipe's own export is what the record shows.
ROOTSTOCK_RECORDER = """#!/bin/sh
printf '%s\\n%s\\n' "${HF_TOKEN-<unset>}" "${HUGGING_FACE_HUB_TOKEN-<unset>}" > "$HOME/token-seen"
exec @ROOTSTOCK@ "$@"
"""


def build_root(path: Path, uv_cache: Path, env_files: list[Path], ids: list[str]) -> Path:
    """An install root with ``env_files`` built (a copy of a root built so once per
    run) and ``ids`` fetched."""
    root = installed_root(path, uv_cache, env_files)
    for checkpoint in ids:
        run_rootstock("add", checkpoint, "--no-verify", "--root", root, timeout=120)
    return root


@pytest.fixture(scope="module")
def emt_chain_root(tmp_path_factory, shared_uv_cache: Path, slurm) -> Path:
    """A root with the sample EMT env, ``emt`` fetched; chains in this module stamp it."""
    path = tmp_path_factory.mktemp("nightly") / "emt-root"
    return build_root(path, shared_uv_cache, [ENVIRONMENTS / "emt.py"], ["emt"])


@pytest.fixture(scope="module")
def broken_root(tmp_path_factory, shared_uv_cache: Path, slurm) -> Path:
    """A root with the crashing env (three ids) and the ten-checkpoint slow env."""
    base = tmp_path_factory.mktemp("nightly-broken")
    src = base / "src"
    src.mkdir()
    (src / "crashing.py").write_text(CRASH_ENV)
    (src / "slow.py").write_text(SLOW_ENV)
    ids = ["setup-raises", "worker-killed", "smoke-test-killed"]
    ids += [f"slow-{i}" for i in range(10)]
    return build_root(base / "root", shared_uv_cache, [src / "crashing.py", src / "slow.py"], ids)


def make_chain(tmp_path: Path, root: Path):
    chain = NightlyChain(tmp_path, root)
    try:
        yield chain
    finally:
        chain.cancel_all()
        chain.stop_file.unlink(missing_ok=True)
        kill_workers_of(root)


@pytest.fixture
def chain(tmp_path: Path, emt_chain_root: Path):
    """A chain on the EMT root; teardown cancels all its jobs and removes the stop file."""
    yield from make_chain(tmp_path, emt_chain_root)


@pytest.fixture
def broken_chain(tmp_path: Path, broken_root: Path):
    """A chain on the broken root; teardown as for ``chain``."""
    yield from make_chain(tmp_path, broken_root)


def cpu_stamp(root: Path, env: str, checkpoint: str) -> dict | None:
    """The manifest's CPU verification record of ``checkpoint`` on testbox, if any."""
    data = json.loads((root / "manifest.json").read_text())
    record = data["envs"][env]["checkpoints"][checkpoint]
    return record.get("verifications", {}).get("testbox", {}).get("cpu")


def stamp_epoch(stamp: dict) -> float:
    """Epoch seconds of a manifest ``at`` (ISO-8601 UTC)."""
    from datetime import datetime

    return datetime.fromisoformat(stamp["at"]).timestamp()


def expected_begin(start_time: str, cadence_days: int, run_hour: int) -> str:
    """The drift-free next start: the run's local calendar date + cadence, at the hour."""
    run_date = date.fromisoformat(start_time[:10])
    return f"{run_date + timedelta(days=cadence_days)}T{run_hour:02d}:00:00"


def test_generation_one_hands_over_to_generation_two(chain: NightlyChain):
    root = chain.root
    gen1 = chain.kickoff(RESCHEDULE_BEGIN="now+5seconds", CADENCE_DAYS="3", RUN_HOUR="5")
    info1 = chain.wait_done(gen1)
    assert info1.state == "COMPLETED", chain.report()

    # Generation 1 queued generation 2 with the override: about 5 s after its own submit.
    gen2, begin = chain.queued_by(gen1)
    assert begin == "now+5seconds"
    log1 = chain.log(gen1)
    assert "one-shot override RESCHEDULE_BEGIN=now+5seconds" in log1
    # Resubmit first: the next run was queued before the smoke-test started.
    assert log1.index("resubmit: queued job") < log1.index("running: rootstock smoke-test")
    info2 = chain.wait_done(gen2, timeout=120)
    assert info2.state == "COMPLETED", chain.report()
    submitted2 = parse_slurm_time(info2.submit_time)
    assert parse_slurm_time(info2.eligible_time) - submitted2 == pytest.approx(5, abs=1)
    assert parse_slurm_time(info2.start_time) - submitted2 < 20

    # Generation 2 ran the smoke-test: the manifest has a fresh stamp from it.
    stamp = cpu_stamp(root, "emt", "emt")
    assert stamp["state"] == "verified"
    assert stamp_epoch(stamp) >= parse_slurm_time(info2.start_time)

    # The override did not propagate; CADENCE_DAYS and RUN_HOUR did.
    log2 = chain.log(gen2)
    assert "RESCHEDULE_BEGIN=(unset)" in log2 and "CADENCE_DAYS=3 RUN_HOUR=5" in log2
    assert "one-shot override" not in log2
    gen3, begin3 = chain.queued_by(gen2)
    expected = expected_begin(info2.start_time, cadence_days=3, run_hour=5)
    assert begin3 == expected
    assert chain.pending() == [gen3]
    assert chain.begin_time(gen3) == expected
    assert job_info(gen3).eligible_time == expected
    # No token anywhere in the private HOME: a warning, not a failure.
    assert "WARNING: no Hugging Face token" in log2


def test_a_stray_kickoff_does_not_fork_the_chain(chain: NightlyChain):
    first = chain.kickoff(RESCHEDULE_BEGIN="now+25seconds")
    assert chain.wait_done(first).state == "COMPLETED", chain.report()
    nxt, _ = chain.queued_by(first)
    assert chain.pending() == [nxt]

    stray = chain.kickoff()
    assert chain.wait_done(stray).state == "COMPLETED", chain.report()
    log = chain.log(stray)
    assert f"resubmit: skipped: job {nxt} ({chain.name}) is already pending" in log
    assert "resubmit: queued job" not in log
    assert "smoke-test exit code 0" in log
    assert chain.pending() == [nxt]

    # The pending run still runs and queues the one next run; nothing else is left.
    assert chain.wait_done(nxt, timeout=90).state == "COMPLETED", chain.report()
    last, _ = chain.queued_by(nxt)
    assert chain.pending() == [last]
    live = [j for j, state in chain.jobs() if state not in ("COMPLETED",)]
    assert live == [last], chain.report()


def test_the_stop_file_ends_the_chain(chain: NightlyChain):
    first = chain.kickoff(RESCHEDULE_BEGIN="now+20seconds")
    assert chain.wait_done(first).state == "COMPLETED", chain.report()
    nxt, _ = chain.queued_by(first)
    chain.stop_file.touch()

    assert chain.wait_done(nxt, timeout=90).state == "COMPLETED", chain.report()
    log = chain.log(nxt)
    assert f"resubmit: skipped: stop file {chain.stop_file} exists" in log
    assert "resubmit: queued job" not in log
    # The last run still smoke-tests; it only does not reschedule.
    assert "smoke-test exit code 0" in log
    assert chain.pending() == []


@pytest.mark.parametrize("checkpoint", ["setup-raises", "worker-killed", "smoke-test-killed"])
def test_a_crashing_smoke_test_still_leaves_the_next_run_queued(
    broken_chain: NightlyChain, checkpoint: str
):
    job = broken_chain.kickoff(SMOKE_TEST_ARGS=f"--device cpu --checkpoint {checkpoint}")
    info = broken_chain.wait_done(job)
    assert info.state == "FAILED", broken_chain.report()
    log = broken_chain.log(job)
    nxt, begin = broken_chain.queued_by(job)
    assert broken_chain.pending() == [nxt]
    assert begin == expected_begin(info.start_time, cadence_days=7, run_hour=2)
    code = re.search(r"smoke-test exit code (\d+)", log)
    if checkpoint == "smoke-test-killed":
        assert code.group(1) == "137", log  # 128 + SIGKILL
    else:
        assert code.group(1) == "1", log
        assert f"FAIL {checkpoint}" in log
        assert cpu_stamp(broken_chain.root, "crashing", checkpoint)["state"] == "failed"


def test_a_wall_time_kill_keeps_the_stamps_it_reached(broken_chain: NightlyChain):
    """About two minutes: a 1-minute limit, checked by slurmctld every 30 s."""
    root = broken_chain.root
    job = broken_chain.kickoff(
        "--time=1", SMOKE_TEST_ARGS="--device cpu --env slow", PUSH_EVERY="5"
    )
    info = broken_chain.wait_done(job, timeout=240)
    assert info.state == "TIMEOUT", broken_chain.report()
    log = broken_chain.log(job)
    # A chain's first run re-hashes the weights (--rehash): it has no stamp yet.
    assert "--push-every 5 --rehash --device cpu --env slow" in log
    # Resubmit first: the chain survives the kill.
    nxt, _ = broken_chain.queued_by(job)
    assert broken_chain.pending() == [nxt]

    started = parse_slurm_time(info.start_time)
    printed = set(re.findall(r"\] ok +(slow-\d) \(slow\) verified", log))
    stamped = set()
    for i in range(10):
        stamp = cpu_stamp(root, "slow", f"slow-{i}")
        if stamp is not None and stamp_epoch(stamp) >= started:
            assert stamp["state"] == "verified"
            stamped.add(f"slow-{i}")
    # Every result the job printed is on disk; at most one was stamped and not printed.
    assert printed <= stamped, (printed, stamped)
    assert len(stamped - printed) <= 1
    assert 1 <= len(stamped) < 10, broken_chain.report()


def test_the_token_from_hf_token_file_reaches_the_smoke_test(chain: NightlyChain, tmp_path):
    token_file = tmp_path / "hf-token"
    token_file.write_text("  file-token-123\n")
    (chain.home / ".hf_token").write_text("home-token-456\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    recorder = bin_dir / "rootstock"
    recorder.write_text(
        ROOTSTOCK_RECORDER.replace("@ROOTSTOCK@", str(DEV_VENV / "bin" / "rootstock"))
    )
    recorder.chmod(0o755)

    # No ROOTSTOCK_VENV: the recorder on PATH is the `rootstock` the recipe finds.
    job = chain.kickoff(
        HF_TOKEN_FILE=str(token_file),
        ROOTSTOCK_VENV="",
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
    )
    assert chain.wait_done(job).state == "COMPLETED", chain.report()
    log = chain.log(job)
    assert f"HF token: from {token_file}" in log
    assert "file-token-123" not in log and "home-token-456" not in log
    assert (chain.home / "token-seen").read_text().splitlines() == [
        "file-token-123",
        "file-token-123",
    ]
