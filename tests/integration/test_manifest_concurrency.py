"""Many processes writing one manifest: no lost updates, and SIGKILL never corrupts it.

Every process a test starts runs in its own session with a deadline; teardown kills
the whole group. ``PYTHONFAULTHANDLER`` makes a hung writer dump its stack.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import load_manifest, update_manifest

WRITER = Path(__file__).with_name("manifest_writer.py")
DEADLINE_S = 90


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator:
    """Start writer processes; kill every one of them (and its group) at teardown."""
    started: list[subprocess.Popen] = []

    def start(root: Path, prefix: str, count: int, *extra: str) -> subprocess.Popen:
        env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
        env.pop("ROOTSTOCK_CLUSTERS_FILE", None)
        out = open(tmp_path / f"{prefix}.out", "wb")  # noqa: SIM115 - closed at teardown
        proc = subprocess.Popen(
            [sys.executable, str(WRITER), str(root), prefix, str(count), *extra],
            stdout=out,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        proc.out_path = tmp_path / f"{prefix}.out"  # type: ignore[attr-defined]
        proc.out_file = out  # type: ignore[attr-defined]
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        proc.out_file.close()
        if proc.stderr:
            proc.stderr.close()


def done_ids(proc: subprocess.Popen) -> list[str]:
    """Checkpoint ids the writer promised were on disk (complete lines only)."""
    text = proc.out_path.read_text()  # type: ignore[attr-defined]
    lines = text.split("\n")[:-1]  # a torn last line promised nothing
    return [line.split(" ", 1)[1] for line in lines if line.startswith("done ")]


def wait_all(procs: list[subprocess.Popen], deadline_s: float = DEADLINE_S) -> None:
    """Wait for every writer to exit 0 before the deadline."""
    deadline = time.monotonic() + deadline_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"writer {proc.args[3]} still running after {deadline_s} s")
        stderr = proc.stderr.read().decode() if proc.stderr else ""
        assert proc.returncode == 0, f"writer {proc.args[3]} failed:\n{stderr}"


def stamped(layout: InstallLayout) -> dict[str, dict]:
    """The checkpoint records the writers made."""
    return load_manifest(layout)["envs"].get("stamps", {}).get("checkpoints", {})


def assert_stamp_present(records: dict[str, dict], checkpoint: str) -> None:
    """A writer's stamp is present: a fetch, or (odd indices) a verification."""
    assert checkpoint in records, f"stamp {checkpoint} was reported done but is missing"
    index = int(checkpoint.rsplit("-", 1)[1])
    record = records[checkpoint]
    if index % 2:
        assert record["verifications"]["testbox"]["cpu"]["state"] == "verified"
    else:
        assert record["fetched_at"]


def run_writers(root: Path, spawn, writers: int, each: int, *extra: str) -> list[str]:
    """Start ``writers`` processes together, each writing ``each`` stamps; return all ids."""
    go = root / "go"
    procs = [spawn(root, f"w{n}", each, "--go", str(go), *extra) for n in range(writers)]
    time.sleep(0.3)  # let them import and reach the start line, then release together
    go.touch()
    wait_all(procs)
    return [cid for proc in procs for cid in done_ids(proc)]


def test_eight_writers_lose_no_stamps(tmp_path: Path, spawn) -> None:
    layout = InstallLayout(tmp_path, tmp_path)
    ids = run_writers(tmp_path, spawn, writers=8, each=25)
    assert len(ids) == 200
    records = stamped(layout)
    for cid in ids:
        assert_stamp_present(records, cid)
    assert len(records) == 200
    assert load_manifest(layout)["test_counter"] == 200


def test_mkdir_fallback_serialises_writers(tmp_path: Path, spawn) -> None:
    """With fcntl refusing locks (ENOLCK), the mkdir fallback keeps writers apart."""
    layout = InstallLayout(tmp_path, tmp_path)
    ids = run_writers(tmp_path, spawn, 6, 15, "--no-fcntl")
    assert len(ids) == 90
    records = stamped(layout)
    for cid in ids:
        assert_stamp_present(records, cid)
    # The slow counter increment loses counts unless every RMW is serialised.
    assert load_manifest(layout)["test_counter"] == 90
    # The fallback was really used, and released: no lock directory is left behind.
    assert not (layout.locks_dir / "manifest.lock.d").exists()


def test_sigkilled_writer_never_corrupts_or_loses_reported_stamps(tmp_path: Path, spawn) -> None:
    layout = InstallLayout(tmp_path, tmp_path)
    rng = random.Random(20240601)
    reported: list[str] = []
    for run in range(20):
        proc = spawn(tmp_path, f"k{run}", 0)
        deadline = time.monotonic() + 30
        while not proc.out_path.read_bytes():  # type: ignore[attr-defined]
            if proc.poll() is not None:
                pytest.fail(f"writer exited early: {proc.stderr.read().decode()}")
            if time.monotonic() > deadline:
                pytest.fail("writer wrote nothing within 30 s")
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.25))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        reported += done_ids(proc)
        records = stamped(layout)  # parses, or raises ManifestError and fails the test
        for cid in reported:
            assert_stamp_present(records, cid)
    assert len(reported) >= 20
    # The next ordinary write proceeds (no stuck lock) and sweeps up the temp files
    # that killed writers left mid-write, once they are old enough to be orphans.
    for orphan in tmp_path.glob(".manifest.json.tmp-*"):
        os.utime(orphan, (time.time() - 3600, time.time() - 3600))
    update_manifest(layout, lambda data: data.__setitem__("after_kills", True), timeout=10)
    assert not list(tmp_path.glob(".manifest.json.tmp-*"))
    assert load_manifest(layout)["after_kills"] is True
