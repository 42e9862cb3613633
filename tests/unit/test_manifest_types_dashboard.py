"""The dashboard validates a push against the manifest's own TypedDicts, via pydantic.

In-process, through the same TypeAdapter FastAPI builds for ``PUT .../manifest``:
the derived types have the core types' fields, unknown keys are kept at every
level, values are never converted, and the dashboard's own limits still apply.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

pytest.importorskip("pydantic")

from pydantic import ValidationError  # after the importorskip

from rootstock.dashboard import schemas
from rootstock.install.manifest import types

T0 = "2026-11-28T10:00:00+00:00"
BUILD = {"build_id": "b1", "source_hash": "sha256:9b", "built_at": T0, "lock_hash": "sha256:47"}


def push(**record_extra: Any) -> dict[str, Any]:
    record = {
        "state": "verified",
        "at": T0,
        "device": "cuda:0",
        "device_kind": "gpu",
        "fingerprint": {"energy_per_atom": -3.9, "stress": [0.1, 0, 0, 0, 0, 0]},
        "build": BUILD,
        **record_extra,
    }
    return {
        "schema_version": 2,
        "clusters": ["alpha"],
        "envs": {
            "mace": {
                "built_at": T0,
                "checkpoints": {"m": {"verifications": {"alpha": {"gpu": record}}}},
            }
        },
    }


def validated(body: dict[str, Any]) -> dict[str, Any]:
    return dict(schemas.MANIFEST_ADAPTER.validate_python(copy.deepcopy(body)))


def _record(body: dict[str, Any]) -> dict[str, Any]:
    return body["envs"]["mace"]["checkpoints"]["m"]["verifications"]["alpha"]["gpu"]


def _error_locs(body: dict[str, Any]) -> list[tuple[Any, ...]]:
    with pytest.raises(ValidationError) as caught:
        validated(body)
    return [tuple(error["loc"]) for error in caught.value.errors()]


@pytest.mark.parametrize("core", types.RECORD_TYPES, ids=lambda t: t.__name__)
def test_each_derived_type_has_the_core_types_fields(core):
    derived = schemas._DERIVED[core]
    assert derived.__required_keys__ | derived.__optional_keys__ == (
        core.__required_keys__
        | core.__optional_keys__
        | schemas.PUSH_ONLY_FIELDS.get(core, frozenset())
    )
    assert derived.__pydantic_config__ == {"extra": "allow", "strict": True}


def test_only_a_checkpoint_s_info_is_push_only_and_it_is_optional():
    assert dict(schemas.PUSH_ONLY_FIELDS) == {types.CheckpointRecord: frozenset({"info"})}
    assert "info" in schemas._DERIVED[types.CheckpointRecord].__optional_keys__
    body = push()  # an older client: no info at all
    assert validated(body) == body
    entry = body["envs"]["mace"]["checkpoints"]["m"]
    entry["info"] = {"licence": "MIT", "gated": None, "citation": "10.1/x", "summary": "kept"}
    assert validated(body) == body
    entry["info"] = None
    assert validated(body) == body


@pytest.mark.parametrize(
    "info",
    [{"licence": 3}, {"gated": False}, {"citation": "x" * 501}, "MIT", ["MIT"]],
    ids=["licence-number", "gated-bool", "citation-too-long", "text", "list"],
)
def test_a_malformed_info_is_refused_where_it_is(info):
    body = push()
    body["envs"]["mace"]["checkpoints"]["m"]["info"] = info
    locs = _error_locs(body)
    assert locs and all(loc[:5] == ("envs", "mace", "checkpoints", "m", "info") for loc in locs)


def test_a_valid_push_comes_back_as_sent():
    body = push(checks={"ok": True, "forces": {"mode": "gradient", "ratio": 1.0}})
    assert validated(body) == body


def test_unknown_keys_are_kept_at_every_level():
    body = push(note={"why": "kept"}, checks={"ok": True, "forces": {"mode": "n/a", "new": 1}})
    body["site"] = "x"
    body["envs"]["mace"]["arch"] = "aarch64"
    body["envs"]["mace"]["checkpoints"]["m"]["size"] = 12
    record = _record(body)
    record["build"] = {**BUILD, "host": "n1"}
    record["fingerprint"]["natoms"] = 8
    record["fingerprint"]["virial"] = [1.0]
    record["reference"] = {"fingerprint": {"energy_per_atom": -3.9, "extra": True}, "x": 1}
    assert validated(body) == body


def test_a_field_of_the_core_types_is_checked_even_where_the_dashboard_had_no_model():
    body = push(references={"{}": {"fingerprint": {"force_norm": "big"}}})
    locs = _error_locs(body)
    assert locs and all(loc[-1] == "force_norm" and "references" in loc for loc in locs)
    assert _error_locs(push(reference={"at": T0}))[0][-1] == "fingerprint"


def test_values_are_never_converted():
    body = push()
    body["schema_version"] = "2"
    assert _error_locs(body) == [("schema_version",)]
    assert _error_locs(push(fingerprint={"energy_per_atom": "1.5"}))


def test_the_dashboards_limits_still_apply():
    late = push(at="2201-01-01T00:00:00+00:00")
    assert any(loc[-1] == "at" for loc in _error_locs(late))
    bad_cluster = push()
    bad_cluster["envs"]["mace"]["checkpoints"]["m"]["verifications"] = {"Bad Name!": {}}
    assert _error_locs(bad_cluster)
    long_kind = push()
    _record(long_kind)["device_kind"] = "k" * 21
    assert _error_locs(long_kind)
    nul = push(message="a\x00b")
    assert _error_locs(nul) == [()]


def test_looser_values_accepted_before_are_still_accepted():
    body = push(state="pending", checks={"ok": None, "forces": {"mode": None}})
    assert validated(body) == body
    no_envs = {"schema_version": 1, "clusters": ["alpha"]}
    assert validated(no_envs) == no_envs
