"""``add``, ``smoke-test`` and drift on real CHGNet and SevenNet envs, on the CPU.

Every test here changes its root (checkpoint records, a rebuild, hotfixed sources), so
the module works on a root of its own: copies of the CHGNet and SevenNet envs that the
run's shared family root holds (tests/mlip/private_root.py). Other processes of the
run use the shared root at the same time; a hotfix there reached their workers. Within
the module every hotfix is still undone (the original ``env_source.py`` moved back
into place, then re-verified or re-accepted), so each test finds the root built,
and verified where an earlier test verified it. Each worker spawn costs 10-40 s on a
small CPU box, so the tests stay few.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import run_rootstock
from tests.mlip.private_root import private_family_root

pytestmark = [pytest.mark.mlip, pytest.mark.timeout(1800)]

CLUSTER = "testbox"

# Appended to chgnet's env_source.py: the same model, energy and forces x 1.001.
DRIFTED_SETUP = '''

def setup(checkpoint, device="cuda", **kw):
    """The original setup(), with energy and forces scaled by 1.001 (a test hotfix)."""
    calc = _undrifted_setup(checkpoint, device=device, **kw)
    base = type(calc)

    class DriftedCalculator(base):
        def calculate(self, *args, **kwargs):
            base.calculate(self, *args, **kwargs)
            for key in ("energy", "free_energy", "forces"):
                if key in self.results:
                    self.results[key] = self.results[key] * 1.001

    calc.__class__ = DriftedCalculator
    return calc
'''


def rs(root: Path, *args: str, check: bool = True, timeout: float = 900):
    """Run ``rootstock ARGS --root ROOT``."""
    return run_rootstock(*args, "--root", root, check=check, timeout=timeout)


def add_json(root: Path, *args: str, check: bool = True) -> dict:
    """``add ARGS --json`` as a dict."""
    return json.loads(rs(root, "add", *args, "--json", check=check).stdout)


def smoke_json(root: Path, *args: str) -> tuple[int, dict]:
    """``smoke-test --json --device cpu ARGS``: (exit code, summary)."""
    proc = rs(root, "smoke-test", "--json", "--device", "cpu", *args, check=False)
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def state_of(root: Path, env: str, checkpoint: str) -> dict:
    """The ``status --json`` cell of ``checkpoint`` on the test cluster."""
    doc = json.loads(rs(root, "status", "--json", timeout=120).stdout)
    rows = {(e["name"], r["id"]): r["states"] for e in doc["envs"] for r in e["checkpoints"]}
    return rows[(env, checkpoint)][CLUSTER]


def cpu_record(root: Path, env: str, checkpoint: str) -> dict:
    """The stored CPU verification record of ``checkpoint``."""
    data = json.loads((root / "manifest.json").read_text())
    return data["envs"][env]["checkpoints"][checkpoint]["verifications"][CLUSTER]["cpu"]


def ensure_verified(root: Path, env: str, checkpoint: str) -> None:
    """Verify ``checkpoint`` on the CPU unless status already says verified."""
    if state_of(root, env, checkpoint)["state"] != "verified":
        assert add_json(root, checkpoint, "--device", "cpu")["state"] == "verified"


@pytest.fixture(scope="module")
def own_root(mlip_root: Path, user_uv_cache: Path, tmp_path_factory) -> Path:
    """The module's own root with the CHGNet and SevenNet envs of the shared ``mlip_root``."""
    path = tmp_path_factory.mktemp("checkpoints") / "root"
    return private_family_root(mlip_root, path, ("chgnet", "sevennet"), user_uv_cache)


@pytest.fixture
def live_sources(own_root: Path) -> Iterator[dict[str, Path]]:
    """The built envs' ``env_source.py``; any left edited is restored at teardown."""
    paths = {name: own_root / "envs" / name / "env_source.py" for name in ("chgnet", "sevennet")}
    originals = {name: path.read_bytes() for name, path in paths.items()}
    yield paths
    for name, path in paths.items():
        if path.read_bytes() != originals[name]:
            replace_source(path, originals[name])


def replace_source(path: Path, source: bytes) -> None:
    """Move a new ``env_source.py`` into place, the way a maintainer hotfixes."""
    copy = path.with_name(".env_source.py.hotfix")
    copy.write_bytes(source)
    os.replace(copy, path)


def test_chgnet_maintainer_flow_on_cpu(own_root: Path, torch_pin: dict[str, str]):
    fetched = add_json(own_root, "chgnet-0.3.0", "--no-verify")
    assert fetched["state"] == "fetched" and fetched["env"] == "chgnet"
    assert state_of(own_root, "chgnet", "chgnet-0.3.0")["state"] in ("fetched", "verified")

    verified = add_json(own_root, "chgnet-0.3.0", "--device", "cpu")
    assert verified["downloaded"] is False and verified["state"] == "verified", verified
    state = state_of(own_root, "chgnet", "chgnet-0.3.0")
    assert (state["state"], state["device_kind"]) == ("verified", "cpu")

    code, summary = smoke_json(own_root, "--env", "chgnet")
    assert code == 0 and summary["ok"] is True
    by_id = {r["checkpoint"]: r for r in summary["results"]}
    assert by_id["chgnet-0.3.0"]["state"] == "verified"
    assert {r["env"] for r in summary["results"]} == {"chgnet"}
    fingerprint = cpu_record(own_root, "chgnet", "chgnet-0.3.0")["fingerprint"]
    assert math.isfinite(fingerprint["energy_per_atom"]) and fingerprint["energy_per_atom"] < 0
    assert math.isfinite(fingerprint["force_norm"]) and len(fingerprint["stress"]) == 6
    assert fingerprint["device_kind"] == "cpu" and fingerprint["torch"]

    # A rebuild (from the lockfile, same local torch wheel) makes the pass stale...
    run_rootstock("install", "chgnet", "--force", "--root", own_root, env=torch_pin, timeout=1800)
    state = state_of(own_root, "chgnet", "chgnet-0.3.0")
    assert state["state"] == "stale" and "rebuilt" in state["message"]
    # ...and re-verifying it to the same fingerprint clears it.
    code, summary = smoke_json(own_root, "--checkpoint", "chgnet-0.3.0")
    assert code == 0 and summary["counts"] == {"verified": 1}, summary
    assert state_of(own_root, "chgnet", "chgnet-0.3.0")["state"] == "verified"


def test_sevennet_mf_0_needs_its_verify_kwargs(own_root: Path, live_sources):
    verified = add_json(own_root, "sevennet-mf-0", "--device", "cpu")
    assert verified["state"] == "verified", verified
    assert verified["kwargs"] == {"modal": "PBE"}, "VERIFY_KWARGS supplied the head"

    path = live_sources["sevennet"]
    original = path.read_bytes()
    stripped, count = re.subn(rb"(?ms)^VERIFY_KWARGS = \{.*?^\}\n", b"", original)
    assert count == 1
    try:
        replace_source(path, stripped)
        code, summary = smoke_json(own_root, "--checkpoint", "sevennet-mf-0")
        assert code == 1
        (result,) = summary["results"]
        assert result["state"] == "failed"
        assert "modal" in result["message"]
        assert "declare it in VERIFY_KWARGS" in result["message"]
    finally:
        replace_source(path, original)
        # Leave the shared root verified again (the failure ran a hotfixed source).
        assert add_json(own_root, "sevennet-mf-0", "--device", "cpu")["state"] == "verified"


def test_chgnet_drift_is_caught_and_accepted(own_root: Path, live_sources):
    ensure_verified(own_root, "chgnet", "chgnet-0.3.0")
    reference = cpu_record(own_root, "chgnet", "chgnet-0.3.0")["reference"]["fingerprint"]

    path = live_sources["chgnet"]
    original = path.read_bytes()
    source = original.decode()
    assert source.count("\ndef setup(") == 1
    drifted = source.replace("\ndef setup(", "\ndef _undrifted_setup(") + DRIFTED_SETUP
    try:
        replace_source(path, drifted.encode())
        code, summary = smoke_json(own_root, "--checkpoint", "chgnet-0.3.0")
        assert code == 1 and summary["counts"] == {"drifted": 1}, summary
        assert "energy_per_atom" in summary["results"][0]["message"]
        assert state_of(own_root, "chgnet", "chgnet-0.3.0")["state"] == "drifted"

        accepted = add_json(own_root, "chgnet-0.3.0", "--accept-drift", "--device", "cpu")
        assert accepted["state"] == "verified"
        new = cpu_record(own_root, "chgnet", "chgnet-0.3.0")["reference"]["fingerprint"]
        assert new["energy_per_atom"] == pytest.approx(1.001 * reference["energy_per_atom"], 1e-5)
    finally:
        replace_source(path, original)
        # The original physics is now the drift: accept it back so the root stays verified.
        restored = add_json(own_root, "chgnet-0.3.0", "--accept-drift", "--device", "cpu")
        assert restored["state"] == "verified"
    assert state_of(own_root, "chgnet", "chgnet-0.3.0")["state"] == "verified"
