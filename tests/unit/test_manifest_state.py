"""Fingerprint comparison, verified-vs-drifted decisions, and derived display states."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest

from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import (
    DISPLAY_STATES,
    FingerprintTolerance,
    checkpoint_state,
    cluster_view,
    compare_fingerprints,
    device_kind,
    load_manifest,
    record_env_build,
    record_fetch,
    record_verification,
)

FP = {
    "energy_per_atom": -3.9127,
    "force_norm": 1.2345,
    "stress": [0.1012, 0.0987, 0.1003, 0.0021, -0.0004, 0.0],
    "device_kind": "gpu",
    "torch": "2.4.0",
    "env_versions": {"mace-torch": "0.3.6"},
}
BUILT = "2025-01-01T00:00:00+00:00"


@pytest.fixture(autouse=True)
def _no_site_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROOTSTOCK_CLUSTERS_FILE", raising=False)


@pytest.fixture
def layout(tmp_path: Path) -> InstallLayout:
    lay = InstallLayout(tmp_path, tmp_path)
    record_env_build(lay, "mace", {"source_hash": "sha256:v1", "built_at": BUILT})
    return lay


def scaled(fp: dict, factor: float, *quantities: str) -> dict:
    out = dict(fp)
    for q in quantities or ("energy_per_atom", "force_norm", "stress"):
        value = fp[q]
        out[q] = [v * factor for v in value] if isinstance(value, list) else value * factor
    return out


def passed(fp: dict, device: str = "cuda", **extra: object) -> dict:
    return {"passed": True, "device": device, "fingerprint": fp, **extra}


# -- compare_fingerprints ----------------------------------------------------------


def test_float32_noise_never_drifts() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        ref = {
            "energy_per_atom": rng.uniform(-9, 9),
            "force_norm": rng.uniform(0, 20),
            "stress": [rng.uniform(-0.5, 0.5) for _ in range(6)],
        }
        # float32 rounding plus GPU-reduction-order noise of a few ulps, relative 1e-6
        noisy = {
            "energy_per_atom": float(np.float32(ref["energy_per_atom"] * (1 + rng.gauss(0, 1e-6)))),
            "force_norm": float(np.float32(ref["force_norm"] * (1 + rng.gauss(0, 1e-6)))),
            "stress": [float(np.float32(s + rng.gauss(0, 1e-7))) for s in ref["stress"]],
        }
        result = compare_fingerprints(ref, noisy)
        assert result.within, result.message


@pytest.mark.parametrize("quantity", ["energy_per_atom", "force_norm", "stress"])
def test_a_tenth_of_a_percent_is_caught(quantity: str) -> None:
    result = compare_fingerprints(FP, scaled(FP, 1.001, quantity))
    assert not result.within
    assert [d.quantity for d in result.drifts] == [quantity]
    drift = result.drifts[0]
    assert drift.rel_diff == pytest.approx(1e-3, rel=0.05)
    assert quantity in result.message and "relative" in result.message
    json.dumps(result.to_dict())


def test_floors_keep_near_zero_quantities_quiet() -> None:
    ref = {"energy_per_atom": 0.004, "force_norm": 0.0, "stress": [0.0] * 6}
    new = {"energy_per_atom": 0.004004, "force_norm": 5e-5, "stress": [5e-7] * 6}
    assert compare_fingerprints(ref, new).within
    assert not compare_fingerprints(ref, {**new, "force_norm": 2e-4}).within


def test_missing_or_non_finite_quantities_drift() -> None:
    assert compare_fingerprints(FP, {**FP, "stress": None}).drifts[0].reason == "stress now missing"
    assert compare_fingerprints({**FP, "stress": None}, {**FP, "stress": None}).within
    bad = compare_fingerprints(FP, {**FP, "energy_per_atom": float("nan")})
    assert not bad.within
    json.dumps(bad.to_dict(), allow_nan=False)
    assert not compare_fingerprints(FP, {**FP, "stress": [0.1] * 9}).within


def test_tolerance_is_configurable() -> None:
    loose = FingerprintTolerance.from_dict({"rtol": 2e-3})
    assert compare_fingerprints(FP, scaled(FP, 1.001), loose).within
    with pytest.raises(ValueError, match="unknown"):
        FingerprintTolerance.from_dict({"rtoll": 1})


def test_device_kinds() -> None:
    assert [device_kind(d) for d in ("cpu", "cuda", "cuda:3", "xpu:0", "mps")] == [
        "cpu",
        "gpu",
        "gpu",
        "xpu",
        "gpu",
    ]


# -- record_verification: verified vs drifted ----------------------------------------


def test_first_pass_sets_reference_then_drift_is_judged_against_it(layout) -> None:
    first = record_verification(layout, "mace", "small", "della", passed(FP))
    assert first["state"] == "verified" and first["reference"]["fingerprint"] == FP
    noise = scaled(FP, 1 + 3e-7)
    assert record_verification(layout, "mace", "small", "della", passed(noise))["state"] == (
        "verified"
    )
    drifted = record_verification(layout, "mace", "small", "della", passed(scaled(FP, 1.001)))
    assert drifted["state"] == "drifted"
    assert drifted["reference"]["fingerprint"] == FP  # the reference does not creep
    assert {d["quantity"] for d in drifted["drift"]["drifts"]} == {
        "energy_per_atom",
        "force_norm",
        "stress",
    }
    assert "energy_per_atom drifted" in drifted["message"]
    back = record_verification(layout, "mace", "small", "della", passed(FP))
    assert back["state"] == "verified" and back["drift"] is None
    accepted = record_verification(
        layout, "mace", "small", "della", passed(scaled(FP, 1.001)), accept_drift=True
    )
    assert accepted["state"] == "verified"
    assert accepted["reference"]["fingerprint"] == scaled(FP, 1.001)


def test_failure_keeps_the_reference_and_a_one_line_reason(layout) -> None:
    record_verification(layout, "mace", "small", "della", passed(FP))
    failed = record_verification(
        layout,
        "mace",
        "small",
        "della",
        {"passed": False, "device": "cuda", "message": "\n setup() needs task\nTraceback ..."},
    )
    assert failed["state"] == "failed" and failed["message"] == "setup() needs task"
    assert failed["fingerprint"] is None and failed["reference"]["fingerprint"] == FP


CHECKS = {
    "ok": True,
    "dtype": "float32",
    "step": 0.01,
    "energy": "smooth",
    "forces": {"mode": "gradient", "ok": True, "ratio": 1.002},
    "stress": {"mode": "gradient", "ok": True, "ratio": 0.999},
}


def test_checks_are_stored_and_shown_in_the_cell(layout) -> None:
    stored = record_verification(layout, "mace", "small", "della", passed(FP, checks=CHECKS))
    assert stored["checks"] == CHECKS
    cell = state(layout)
    assert cell.state == "verified" and cell.to_dict()["checks"] == CHECKS


def test_a_physics_failure_keeps_the_reference(layout) -> None:
    record_verification(layout, "mace", "small", "della", passed(FP, checks=CHECKS))
    bad = dict(CHECKS, ok=False, stress={"mode": "gradient", "ok": False, "ratio": 160.2})
    message = "stress is 160.2× the strain derivative of the energy: a unit error"
    failed = record_verification(
        layout,
        "mace",
        "small",
        "della",
        # The fingerprint of a pass whose physics failed: never a reference.
        {"passed": False, "device": "cuda", "fingerprint": scaled(FP, 2.0), "checks": bad,
         "message": message},
    )  # fmt: skip
    assert failed["state"] == "failed" and failed["message"] == message
    assert failed["checks"]["stress"]["ratio"] == 160.2 and failed["fingerprint"] is None
    assert failed["reference"]["fingerprint"] == FP
    again = record_verification(
        layout, "mace", "small", "della",
        {"passed": False, "device": "cuda", "fingerprint": FP, "checks": bad, "message": message},
        accept_drift=True,
    )  # fmt: skip
    assert again["reference"]["fingerprint"] == FP, "--accept-drift never accepts a failure"
    assert state(layout).checks["stress"]["ok"] is False


def test_records_without_checks_stay_valid(layout) -> None:
    record_verification(layout, "mace", "small", "della", passed(FP))
    data = load_manifest(layout)
    record = data["envs"]["mace"]["checkpoints"]["small"]["verifications"]["della"]["gpu"]
    assert record["checks"] is None
    del record["checks"]  # as a record written before the checks existed
    cell = checkpoint_state(data, "mace", "small", "della")
    assert cell.state == "verified" and cell.checks is None
    with pytest.raises(ValueError, match="checks"):
        record_verification(layout, "mace", "small", "della", passed(FP, checks=[1.0]))


def test_references_are_per_cluster_and_per_device_kind(layout) -> None:
    record_verification(layout, "mace", "small", "sophia", passed(FP, "cuda"))
    cpu = record_verification(layout, "mace", "small", "sophia", passed(scaled(FP, 1.01), "cpu"))
    other = record_verification(layout, "mace", "small", "polaris", passed(scaled(FP, 1.02)))
    assert cpu["state"] == "verified" and other["state"] == "verified"
    by_kind = load_manifest(layout)["envs"]["mace"]["checkpoints"]["small"]["verifications"]
    assert set(by_kind) == {"sophia", "polaris"} and set(by_kind["sophia"]) == {"gpu", "cpu"}
    assert load_manifest(layout)["clusters"] == ["sophia", "polaris"]


def test_bad_results_are_programming_errors(layout) -> None:
    with pytest.raises(ValueError, match="passed"):
        record_verification(layout, "mace", "small", "della", {"device": "cpu"})
    with pytest.raises(ValueError, match="fingerprint"):
        record_verification(layout, "mace", "small", "della", {"passed": True})


# -- checkpoint_state --------------------------------------------------------------


def state(layout, **kwargs: object):
    return checkpoint_state(load_manifest(layout), "mace", "small", "della", **kwargs)


def test_not_fetched_then_fetched(layout) -> None:
    assert state(layout).state == "not fetched"
    record_fetch(layout, "mace", "small")
    assert state(layout).state == "fetched"
    assert checkpoint_state(load_manifest(layout), "gone", "x", "della").state == "not fetched"


def test_verified_with_age_and_failed_with_reason(layout) -> None:
    at = datetime(2025, 3, 1, tzinfo=UTC)
    record_verification(layout, "mace", "small", "della", passed(FP, at=at.isoformat()))
    cell = state(layout, now=at + timedelta(days=2))
    assert (cell.state, cell.age_s, cell.device_kind) == ("verified", 172800.0, "gpu")
    assert state(layout, device_kind="cpu").state == "fetched"  # a GPU pass is not a CPU pass
    record_verification(layout, "mace", "small", "della", {"passed": False, "message": "OOM"})
    assert (state(layout).state, state(layout).message) == ("failed", "OOM")  # latest kind
    assert state(layout, device_kind="gpu").state == "verified"
    assert set(state(layout).to_dict()) >= {"state", "cluster", "age_s", "message"}
    assert state(layout).state in DISPLAY_STATES


def test_rebuild_makes_stale_and_reverification_resolves_it(layout) -> None:
    record_verification(layout, "mace", "small", "della", passed(FP))
    record_env_build(layout, "mace", {"source_hash": "sha256:v1"})  # install --force
    cell = state(layout)
    assert (cell.state, cell.recorded_state) == ("stale", "verified")
    assert "rebuilt" in cell.message
    record_verification(layout, "mace", "small", "della", passed(scaled(FP, 1 + 1e-7)))
    assert state(layout).state == "verified"
    record_env_build(layout, "mace", {"source_hash": "sha256:v1"})
    assert state(layout).state == "stale"
    record_verification(layout, "mace", "small", "della", passed(scaled(FP, 1.001)))
    assert state(layout).state == "drifted"


def test_hotfix_makes_stale_until_verified_with_the_live_source(layout) -> None:
    record_verification(layout, "mace", "small", "della", passed(FP))
    record_verification(layout, "mace", "large", "della", passed(FP))
    assert state(layout, current_source_hash="sha256:v1").state == "verified"
    hot = state(layout, current_source_hash="sha256:v2")
    assert (hot.state, "hotfix" in hot.message) == ("stale", True)
    record_verification(
        layout, "mace", "small", "della", passed(FP, build={"source_hash": "sha256:v2"})
    )
    data = load_manifest(layout)
    assert data["envs"]["mace"]["source_hash"] == "sha256:v2"  # the hotfix is now recorded
    assert state(layout, current_source_hash="sha256:v2").state == "verified"
    large = checkpoint_state(data, "mace", "large", "della")  # not yet re-verified
    assert large.state == "stale"


def test_cluster_view_keeps_only_that_clusters_results(layout) -> None:
    record_verification(layout, "mace", "small", "sophia", passed(FP))
    record_verification(layout, "mace", "small", "polaris", {"passed": False, "message": "x"})
    record_fetch(layout, "mace", "large")
    data = load_manifest(layout)
    view = cluster_view(data, "Polaris")
    assert view["clusters"] == ["polaris"]
    ck = view["envs"]["mace"]["checkpoints"]
    assert set(ck["small"]["verifications"]) == {"polaris"}
    assert ck["large"]["verifications"] == {} and ck["large"]["fetched_at"]
    assert set(data["envs"]["mace"]["checkpoints"]["small"]["verifications"]) == {
        "sophia",
        "polaris",
    }
