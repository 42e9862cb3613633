"""The bytes are the bytes that were verified: weight files hashed at ``add`` and
re-checked before each verification (docs/checkpoints.md, issue 33 item 3).

One real env (``tests/envs/weights_emt.py``, built once per run and copied per
test) whose ``download()`` writes a 64 KiB file into the cache root. Each test adds
it, changes the file the way a test names, and runs the real CLI or calculator.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path

import pytest

from rootstock.install.layout import InstallLayout
from tests.conftest import run_rootstock
from tests.integration.checkpoint_envs import reap_workers, smoke_json
from tests.integration.conftest import TEST_CLUSTER, TEST_ENVS, build_real_root

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("private_config")]

ENV = "weights-emt"
CHECKPOINT = "weights-emt"
WEIGHT = f"cache/{ENV}/{CHECKPOINT}.bin"


@pytest.fixture
def root(tmp_path: Path, shared_uv_cache: Path):
    path = build_real_root(tmp_path / "root", {ENV: TEST_ENVS / "weights_emt.py"}, shared_uv_cache)
    yield path
    reap_workers(path, grace_s=5)


def add(root: Path, *extra: str) -> dict:
    proc = run_rootstock(
        "add", CHECKPOINT, "--device", "cpu", "--json", "--root", root, *extra, timeout=300
    )
    return json.loads(proc.stdout)


def checkpoint_record(root: Path) -> dict:
    return json.loads((root / "manifest.json").read_text())["envs"][ENV]["checkpoints"][CHECKPOINT]


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def flip_one_byte(path: Path, offset: int = 1000) -> None:
    """Change one byte in place, keeping the size and the mtime (to the nanosecond)."""
    before = os.stat(path)
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == before.st_mtime_ns


def smoke(root: Path, *extra: str) -> tuple[int, dict]:
    return smoke_json(root, "--no-push", *extra)


def only_result(summary: dict) -> dict:
    (result,) = summary["results"]
    return result


def test_add_records_each_weight_file_with_size_sha256_and_mtime(root: Path):
    added = add(root)
    assert added["state"] == "verified"
    record = checkpoint_record(root)
    assert WEIGHT in record["files"]
    path = root / WEIGHT
    info = os.stat(path)
    assert record["weights"] == {
        WEIGHT: {"size": 64 * 1024, "sha256": sha256_of(path), "mtime": info.st_mtime}
    }
    # A default smoke-test of unchanged files passes.
    code, summary = smoke(root)
    assert code == 0 and only_result(summary)["state"] == "verified"


def test_a_flipped_byte_is_caught_by_rehash_only_and_named_then_add_accepts_it(root: Path):
    add(root)
    path = root / WEIGHT
    recorded = sha256_of(path)
    flip_one_byte(path)
    flipped = sha256_of(path)
    assert flipped != recorded

    # Size and mtime as recorded: the default check is a stat, so it does not see it.
    code, summary = smoke(root)
    assert code == 0 and only_result(summary)["state"] == "verified"

    # --rehash reads the bytes: tampered, naming the file and both hashes, exit 1.
    code, summary = smoke(root, "--rehash")
    result = only_result(summary)
    assert code == 1 and result["state"] == "tampered"
    assert summary["counts"] == {"tampered": 1}
    message = result["message"]
    assert message.startswith(f"weights of {CHECKPOINT} changed since add: {WEIGHT} ")
    assert f"sha256 {recorded[:16]}… ≠ {flipped[:16]}…" in message
    assert "(size 66 kB → 66 kB)" in message
    assert message.endswith(f"re-run rootstock add {CHECKPOINT} to accept the new file")
    stored = checkpoint_record(root)["verifications"][TEST_CLUSTER]["cpu"]
    assert stored["state"] == "tampered" and stored["message"] == message
    # The recorded hash is still the old one: nothing accepted the new bytes.
    assert checkpoint_record(root)["weights"][WEIGHT]["sha256"] == recorded

    # status shows it, in text and JSON.
    status = json.loads(run_rootstock("status", "--json", "--root", root, timeout=60).stdout)
    (env,) = [e for e in status["envs"] if e["name"] == ENV]
    (row,) = env["checkpoints"]
    assert row["states"][TEST_CLUSTER]["state"] == "tampered"
    text = run_rootstock("status", "--root", root, timeout=60).stdout
    assert "tampered" in text

    # A re-run of add accepts the new file: its hash is recorded, and --rehash passes.
    added = add(root)
    assert added["state"] == "verified" and added["downloaded"] is False
    assert checkpoint_record(root)["weights"][WEIGHT]["sha256"] == flipped
    code, summary = smoke(root, "--rehash")
    assert code == 0 and only_result(summary)["state"] == "verified"


def test_a_changed_size_is_caught_without_rehash(root: Path):
    add(root)
    path = root / WEIGHT
    with open(path, "ab") as fh:
        fh.write(b"x")
    proc = run_rootstock(
        "smoke-test", "--device", "cpu", "--no-push", "--root", root, check=False, timeout=300
    )
    assert proc.returncode == 1, proc.stderr
    assert "FAIL weights-emt" in proc.stdout and "tampered" in proc.stdout
    assert f"{WEIGHT} sha256" in proc.stdout and "(size 66 kB → 66 kB)" in proc.stdout
    record = checkpoint_record(root)["verifications"][TEST_CLUSTER]["cpu"]
    assert record["state"] == "tampered"
    assert record["fingerprint"] is None and record["checks"] is None  # no model ran


def test_a_touched_but_unchanged_file_passes_and_its_new_mtime_is_recorded(root: Path):
    add(root)
    path = root / WEIGHT
    os.utime(path, (1_700_000_000, 1_700_000_000))
    code, summary = smoke(root)
    assert code == 0 and only_result(summary)["state"] == "verified"
    assert checkpoint_record(root)["weights"][WEIGHT]["mtime"] == 1_700_000_000.0


def test_a_missing_file_is_tampered(root: Path):
    add(root)
    (root / WEIGHT).unlink()
    code, summary = smoke(root)
    assert code == 1
    assert only_result(summary)["state"] == "tampered"
    assert f"{WEIGHT} is gone or unreadable" in only_result(summary)["message"]


def _calculate(root: Path) -> float:
    from ase.build import bulk

    from rootstock import RootstockCalculator

    atoms = bulk("Cu", "fcc", a=3.6)
    with RootstockCalculator(
        CHECKPOINT, root=root, device="cpu", shared=False, pool=False, stage="off"
    ) as calc:
        atoms.calc = calc
        return float(atoms.get_potential_energy())


def test_a_worker_start_with_a_changed_file_warns_marks_and_still_computes(
    root: Path, caplog: pytest.LogCaptureFixture
):
    add(root)
    path = root / WEIGHT
    recorded = os.stat(path)
    flip_one_byte(path)
    os.utime(path, (recorded.st_atime + 60, recorded.st_mtime + 60))
    layout = InstallLayout(root, root)
    marker = layout.reverify_marker(ENV, CHECKPOINT)
    manifest_before = (root / "manifest.json").read_bytes()

    with caplog.at_level(logging.WARNING, logger="rootstock.runtime"):
        energy = _calculate(root)
    assert energy == pytest.approx(energy) and abs(energy) > 0  # it computed
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        f"weights of {CHECKPOINT} changed since add ({WEIGHT}" in w and "starting anyway" in w
        for w in warnings
    ), warnings
    assert marker.is_file()
    # The start never writes the manifest.
    assert (root / "manifest.json").read_bytes() == manifest_before

    # Put the mtime back: stat now matches, so only the marker makes the next
    # default smoke-test re-hash, and it catches the flipped byte.
    os.utime(path, ns=(recorded.st_atime_ns, recorded.st_mtime_ns))
    code, summary = smoke(root)
    assert code == 1 and only_result(summary)["state"] == "tampered"
    assert not marker.exists()  # cleared once re-checked


def test_a_worker_start_that_cannot_mark_still_computes(
    root: Path, caplog: pytest.LogCaptureFixture
):
    add(root)
    path = root / WEIGHT
    with open(path, "ab") as fh:
        fh.write(b"x")
    # A plain file where the marker directory goes: nothing can be created under it
    # (this holds for root too, unlike a permission).
    (root / ".reverify").write_text("in the way")
    with caplog.at_level(logging.WARNING, logger="rootstock.runtime"):
        energy = _calculate(root)
    assert abs(energy) > 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("not marked for re-verification" in w for w in warnings), warnings


def test_sync_rehash_plans_and_fails_a_flipped_file(root: Path):
    add(root)
    flip_one_byte(root / WEIGHT)
    base = ("sync", "--root", root, "--device", "cpu", "--no-push", "--json")
    # Converged by size and mtime: nothing to verify.
    quiet = json.loads(run_rootstock(*base, "--dry-run", timeout=300).stdout)
    assert not [i for i in quiet["plan"]["items"] if i["phase"] == "verify"]
    proc = run_rootstock(*base, "--rehash", check=False, timeout=300)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    (verify,) = [r for r in report["results"] if r["phase"] == "verify"]
    assert verify["status"] == "failed"
    assert verify["message"].startswith(f"tampered: weights of {CHECKPOINT} changed since add")


def test_two_smoke_tests_at_once_leave_a_valid_manifest(root: Path):
    add(root)
    with open(root / WEIGHT, "ab") as fh:
        fh.write(b"x")
    codes: list[int] = []

    def run() -> None:
        proc = run_rootstock(
            "smoke-test", "--device", "cpu", "--no-push", "--rehash", "--root", root,
            check=False, timeout=300,
        )  # fmt: skip
        codes.append(proc.returncode)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=320)
    assert codes == [1, 1]
    show = run_rootstock("manifest", "show", "--json", "--root", root, timeout=60)
    data = json.loads(show.stdout)
    record = data["envs"][ENV]["checkpoints"][CHECKPOINT]
    assert record["verifications"][TEST_CLUSTER]["cpu"]["state"] == "tampered"
