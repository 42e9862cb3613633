"""The manifest schema on read and on write: corrupt variants, NaN, stored names.

Every corrupt variant is refused three ways with the file left byte for byte:
``load_manifest`` (naming the field's JSON path), ``rootstock status`` (``error:``,
no traceback) and a write (``update_manifest``).
"""

from __future__ import annotations

import copy
import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest

from rootstock.cli.main import main
from rootstock.errors import ManifestError, RootstockError, UnstorableValue, UsageError
from rootstock.install.layout import InstallLayout, write_layout
from rootstock.install.machine import resolve_cluster
from rootstock.install.manifest import (
    MANIFEST_VERSION,
    ensure_manifest,
    load_manifest,
    parse_manifest,
    record_fetch,
    record_verification,
    update_manifest,
)
from rootstock.install.manifest.store import serialize_manifest
from rootstock.names import StoredNameWarning

pytestmark = pytest.mark.timeout(120)

T0 = "2025-03-01T09:00:00+00:00"
T1 = "2025-03-08T02:14:51+00:00"
BUILD = {
    "build_id": "5f0c2a9e41d7b3c8",
    "source_hash": "sha256:9b1e",
    "built_at": T0,
    "lock_hash": "sha256:47aa",
}
FP = {
    "energy_per_atom": -3.91274,
    "force_norm": 1.23452,
    "stress": [0.1012, 0.0987, 0.1003, 0.0021, -0.0004, 0.0],
    "natoms": 8,
    "device_kind": "cpu",
    "torch": "2.4.0",
    "env_versions": {"ase": "3.23.0"},
}
REFERENCE = {"fingerprint": FP, "at": T0, "build": BUILD, "kwargs": {}}
CHECKS = {
    "ok": True,
    "dtype": "float64",
    "step": 0.01,
    "forces": {"mode": "gradient", "ok": True, "ratio": 1.0021, "tol": {"ratio": 0.02}},
}
RECORD = {
    "state": "verified",
    "at": T1,
    "device": "cpu",
    "device_kind": "cpu",
    "message": None,
    "kwargs": {},
    "fingerprint": FP,
    "reference": REFERENCE,
    "references": {"{}": REFERENCE},
    "drift": None,
    "checks": CHECKS,
    "build": BUILD,
}
V3: dict[str, Any] = {
    "schema_version": MANIFEST_VERSION,
    "clusters": ["alpha", "beta"],
    "created_at": T0,
    "updated_at": T1,
    "written_by": "rootstock 0.1.0",
    "envs": {
        "emt": {
            **BUILD,
            "python": "3.11.9",
            "python_path": "/opt/python3.11",
            "torch": None,
            "rootstock": "0.1.0",
            "image": {
                "file": ".rootstock-image.sqfs",
                "sha256": "3f" * 32,
                "size": 2147483648,
                "compression": "zstd-3",
            },
            "checkpoints": {
                "emt-a": {
                    "fetched_at": T0,
                    "verifications": {
                        "alpha": {
                            "cpu": RECORD,
                            "gpu": {
                                **RECORD,
                                "state": "failed",
                                "device": "cuda:0",
                                "device_kind": "gpu",
                                "message": "CUDA OOM",
                                "fingerprint": None,
                                "checks": None,
                            },
                        }
                    },
                },
                "emt-b": {"fetched_at": None, "verifications": {}},
            },
        }
    },
}
ENV = ("envs", "emt")
CK = (*ENV, "checkpoints", "emt-a")
REC = (*CK, "verifications", "alpha", "cpu")
REC_PATH = 'envs["emt"].checkpoints["emt-a"].verifications["alpha"]["cpu"]'
CK_PATH = 'envs["emt"].checkpoints["emt-a"]'


def with_value(path: tuple[str, ...], value: Any, base: dict | None = None) -> bytes:
    """``base`` (default V3) with the value at ``path`` replaced, as file bytes."""
    data = copy.deepcopy(base if base is not None else V3)
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return json.dumps(data).encode()


def nested(depth: int, kind: str) -> str:
    return "[" * depth + "]" * depth if kind == "array" else '{"a":' * depth + "1" + "}" * depth


GOOD_TEXT = json.dumps(V3)
ENERGY = '"energy_per_atom": -3.91274'

# id -> (file bytes, the JSON path the message names, or None where there is none)
CORRUPT: dict[str, tuple[bytes, str | None]] = {
    "build not an object": (with_value((*REC, "build"), "b1"), f"{REC_PATH}.build"),
    "reference not an object": (with_value((*REC, "reference"), 5), f"{REC_PATH}.reference"),
    "references not an object": (
        with_value((*REC, "references"), ["{}"]),
        f"{REC_PATH}.references",
    ),
    "references entry not an object": (
        with_value((*REC, "references"), {"{}": "x"}),
        f'{REC_PATH}.references["{{}}"]',
    ),
    "reference without fingerprint": (
        with_value((*REC, "reference"), {"at": T0}),
        f"{REC_PATH}.reference.fingerprint",
    ),
    "reference at bogus": (
        with_value((*REC, "references"), {"{}": {**REFERENCE, "at": "then"}}),
        f'{REC_PATH}.references["{{}}"].at',
    ),
    "state 5": (with_value((*REC, "state"), 5), f"{REC_PATH}.state"),
    "state bogus": (with_value((*REC, "state"), "bogus"), f"{REC_PATH}.state"),
    "state missing": (
        json.dumps(V3).replace('"state": "verified", ', "", 1).encode(),
        f"{REC_PATH}.state",
    ),
    "at yesterday": (with_value((*REC, "at"), "yesterday"), f"{REC_PATH}.at"),
    "at 5": (with_value((*REC, "at"), 5), f"{REC_PATH}.at"),
    "at a list": (with_value((*REC, "at"), [T0]), f"{REC_PATH}.at"),
    "fetched_at soon": (with_value((*CK, "fetched_at"), "soon"), f"{CK_PATH}.fetched_at"),
    "files a string": (with_value((*CK, "files"), "cache/w.pt"), f"{CK_PATH}.files"),
    "files an object": (with_value((*CK, "files"), {"cache/w.pt": 1}), f"{CK_PATH}.files"),
    "files holds 5": (with_value((*CK, "files"), ["cache/a", 5]), f"{CK_PATH}.files[1]"),
    "files holds null": (with_value((*CK, "files"), [None]), f"{CK_PATH}.files[0]"),
    "files absolute": (with_value((*CK, "files"), ["/etc/passwd"]), f"{CK_PATH}.files[0]"),
    "files climbs out": (
        with_value((*CK, "files"), ["cache/../../etc/passwd"]),
        f"{CK_PATH}.files[0]",
    ),
    "files empty path": (with_value((*CK, "files"), [""]), f"{CK_PATH}.files[0]"),
    "files NUL": (with_value((*CK, "files"), ["cache/a\u0000b"]), f"{CK_PATH}.files[0]"),
    "files ./ part": (with_value((*CK, "files"), ["cache/./a"]), f"{CK_PATH}.files[0]"),
    "files // part": (with_value((*CK, "files"), ["cache//a"]), f"{CK_PATH}.files[0]"),
    "files too many": (
        with_value((*CK, "files"), [f"cache/{i}" for i in range(100_001)]),
        f"{CK_PATH}.files",
    ),
    "NaN in a fingerprint": (GOOD_TEXT.replace(ENERGY, '"energy_per_atom": NaN').encode(), None),
    "Infinity in a fingerprint": (
        GOOD_TEXT.replace(ENERGY, '"energy_per_atom": -Infinity').encode(),
        None,
    ),
    "1e999 in a fingerprint": (
        GOOD_TEXT.replace(ENERGY, '"energy_per_atom": 1e999').encode(),
        f"{REC_PATH}.fingerprint.energy_per_atom",
    ),
    "1e999 in checks": (
        GOOD_TEXT.replace('"ratio": 1.0021', '"ratio": 1e999').encode(),
        f"{REC_PATH}.checks",
    ),
    "1e999 in an unknown key": (
        GOOD_TEXT.replace('"clusters"', '"extra": [1E+400], "clusters"').encode(),
        "extra",
    ),
    "stress holds text": (
        with_value((*REC, "fingerprint", "stress"), ["0.1"]),
        f"{REC_PATH}.fingerprint.stress",
    ),
    "fingerprint a string": (with_value((*REC, "fingerprint"), "fp"), f"{REC_PATH}.fingerprint"),
    "1e5-deep arrays": (nested(100_000, "array").encode(), None),
    "1e5-deep objects": (nested(100_000, "object").encode(), None),
    "200-deep kwargs": (
        GOOD_TEXT.replace(
            '"kwargs": {}', '"kwargs": {"x": ' + nested(200, "array") + "}", 1
        ).encode(),
        f"{REC_PATH}.kwargs",
    ),
    "clusters not a list": (with_value(("clusters",), "alpha"), "clusters"),
    "clusters [5]": (with_value(("clusters",), [5]), "clusters[0]"),
    "envs a list": (with_value(("envs",), []), "envs"),
    "env not an object": (with_value(ENV, 3), 'envs["emt"]'),
    "checkpoints a list": (with_value((*ENV, "checkpoints"), []), 'envs["emt"].checkpoints'),
    "checkpoint a string": (with_value(CK, "emt-a"), CK_PATH),
    "verifications a list": (with_value((*CK, "verifications"), []), f"{CK_PATH}.verifications"),
    "cluster records a list": (
        with_value((*CK, "verifications", "alpha"), []),
        f'{CK_PATH}.verifications["alpha"]',
    ),
    "kind record a string": (with_value(REC, "verified"), REC_PATH),
    "kwargs a list": (with_value((*REC, "kwargs"), ["modal"]), f"{REC_PATH}.kwargs"),
    "checks a string": (with_value((*REC, "checks"), "ok"), f"{REC_PATH}.checks"),
    "drift a list": (with_value((*REC, "drift"), []), f"{REC_PATH}.drift"),
    "device 5": (with_value((*REC, "device"), 5), f"{REC_PATH}.device"),
    "device_kind 5": (with_value((*REC, "device_kind"), 5), f"{REC_PATH}.device_kind"),
    "message 5": (with_value((*REC, "message"), 5), f"{REC_PATH}.message"),
    "schema_version '2'": (with_value(("schema_version",), "2"), "schema_version"),
    "schema_version -1": (with_value(("schema_version",), -1), "schema_version"),
    "schema_version true": (with_value(("schema_version",), True), "schema_version"),
    "built_at never": (with_value((*ENV, "built_at"), "never"), 'envs["emt"].built_at'),
    "build built_at never": (
        with_value((*REC, "build"), {**BUILD, "built_at": "never"}),
        f"{REC_PATH}.build.built_at",
    ),
    "python 3.11 as a number": (with_value((*ENV, "python"), 3.11), 'envs["emt"].python'),
    "created_at 0": (with_value(("created_at",), 0), "created_at"),
    "written_by 5": (with_value(("written_by",), 5), "written_by"),
    "top-level array": (b"[1, 2, 3]", None),
    "top-level string": (b'"manifest"', None),
    "not UTF-8": (b'{"schema_version": 2, "clusters": ["\xff"], "envs": {}}', None),
    "truncated JSON": (GOOD_TEXT[: len(GOOD_TEXT) // 2].encode(), None),
    "empty file": (b"", None),
    "huge integer": (b'{"schema_version": ' + b"9" * 5000 + b"}", None),
    "v1 record at bogus": (
        json.dumps(
            {
                "schema_version": 1,
                "clusters": ["alpha"],
                "envs": {
                    "emt": {
                        "checkpoints": {
                            "emt-a": {
                                "verifications": {
                                    "alpha": {
                                        "cpu": {
                                            "state": "verified",
                                            "at": "last week",
                                            "reference": None,
                                        }
                                    }
                                }
                            }
                        }
                    }
                },
            }
        ).encode(),
        f"{REC_PATH}.at",
    ),
}


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROOTSTOCK_CONFIG", str(tmp_path / "user" / "config.toml"))
    monkeypatch.delenv("ROOTSTOCK_ROOT", raising=False)
    monkeypatch.delenv("ROOTSTOCK_CLUSTERS_FILE", raising=False)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """An install root with nothing built: layout.json and the usual folders."""
    path = tmp_path / "root"
    path.mkdir()
    write_layout(path, None)
    for sub in ("home", "cache", "envs", "environments", ".locks"):
        (path / sub).mkdir()
    return path


@pytest.fixture
def layout(root: Path) -> InstallLayout:
    return InstallLayout(root, root)


def test_there_are_at_least_27_corrupt_variants() -> None:
    assert len(CORRUPT) >= 27


@pytest.mark.parametrize(("content", "where"), CORRUPT.values(), ids=CORRUPT.keys())
def test_load_refuses_naming_the_field(
    layout: InstallLayout, content: bytes, where: str | None
) -> None:
    layout.manifest_file.write_bytes(content)
    with pytest.raises(ManifestError) as info:
        load_manifest(layout)
    message = info.value.message
    assert message.startswith(f"{layout.manifest_file} ")
    assert "is corrupt" in message or "could not be migrated" in message
    if where is not None:
        assert f"is corrupt: {where}: " in message
    assert "left untouched" in (info.value.hint or "")
    assert layout.manifest_file.read_bytes() == content


@pytest.mark.parametrize(("content", "where"), CORRUPT.values(), ids=CORRUPT.keys())
def test_status_prints_an_error_not_a_traceback(
    root: Path, content: bytes, where: str | None, capsys: pytest.CaptureFixture
) -> None:
    (root / "manifest.json").write_bytes(content)
    code = main(["status", "--root", str(root)])
    captured = capsys.readouterr()
    assert code == 1
    assert captured.err.startswith("error: ")
    assert "hint: " in captured.err
    assert "Traceback" not in captured.err + captured.out
    if where is not None:
        assert where in captured.err
    assert (root / "manifest.json").read_bytes() == content


@pytest.mark.parametrize(("content", "where"), CORRUPT.values(), ids=CORRUPT.keys())
def test_every_write_refuses_and_leaves_the_bytes(
    layout: InstallLayout, content: bytes, where: str | None
) -> None:
    layout.manifest_file.write_bytes(content)
    writes = [
        lambda: update_manifest(layout, lambda d: d["clusters"].append("gamma")),
        lambda: ensure_manifest(layout, ["alpha"]),
        lambda: record_fetch(layout, "emt", "emt-c"),
        lambda: record_verification(layout, "emt", "emt-c", "alpha", {"passed": False}),
    ]
    for write in writes:
        with pytest.raises(ManifestError):
            write()
        assert layout.manifest_file.read_bytes() == content
    assert sorted(p.name for p in layout.root.iterdir()) == [
        ".locks",
        "cache",
        "environments",
        "envs",
        "home",
        "layout.json",
        "manifest.json",
    ]


# --- what still loads ------------------------------------------------------------

V1 = {
    "schema_version": 1,
    "clusters": ["della"],
    "created_at": T0,
    "updated_at": None,
    "written_by": "rootstock 0.0.9",
    "envs": {
        "mace": {
            **BUILD,
            "python": "3.11",
            "python_path": None,
            "torch": "2.2.0",
            "rootstock": "0.0.9",
            "checkpoints": {
                "small": {
                    "fetched_at": T0,
                    "verifications": {
                        "della": {
                            "gpu": {
                                "state": "drifted",
                                "at": T1,
                                "device": "cuda",
                                "device_kind": "gpu",
                                "message": "energy_per_atom drifted",
                                "fingerprint": FP,
                                "reference": {"fingerprint": FP, "at": T0, "build": BUILD},
                                "drift": {"within": False, "drifts": [], "message": "x"},
                                "build": BUILD,
                            }
                        }
                    },
                }
            },
        }
    },
}
V0 = {
    "cluster": "Della",
    "updated_at": "2024-05-01T00:00:00+00:00",
    "environments": {
        "mace": {
            "source_hash": "sha256:old",
            "python_version": "3.11",
            "checkpoints": {
                "small": {"verified_at": "2024-04-02T00:00:00+00:00", "device": "cuda"},
                "large": {"fetched": True, "device": "cpu", "error": "\n  CUDA OOM\nTrace"},
                "blank": {"verified_at": "2024-04-02T00:00:00+00:00", "error": " \n "},
            },
        }
    },
}


def test_real_looking_v3_loads_as_written(layout: InstallLayout) -> None:
    layout.manifest_file.write_text(GOOD_TEXT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no stored-name warning for good names
        assert load_manifest(layout) == V3
    before = layout.manifest_file.read_bytes()
    record_fetch(layout, "emt", "emt-b", at=T1)
    after = load_manifest(layout)
    assert after["envs"]["emt"]["checkpoints"]["emt-a"] == V3["envs"]["emt"]["checkpoints"]["emt-a"]
    assert before != layout.manifest_file.read_bytes()


def test_v1_and_v0_files_still_load(layout: InstallLayout) -> None:
    v1 = parse_manifest(json.dumps(V1))
    record = v1["envs"]["mace"]["checkpoints"]["small"]["verifications"]["della"]["gpu"]
    assert record["kwargs"] is None and record["references"]["unrecorded"]["fingerprint"] == FP
    v0 = parse_manifest(json.dumps(V0))
    large = v0["envs"]["mace"]["checkpoints"]["large"]["verifications"]["della"]["cpu"]
    assert large["state"] == "failed" and large["message"] == "CUDA OOM"
    blank = v0["envs"]["mace"]["checkpoints"]["blank"]["verifications"]["della"]["cpu"]
    assert blank["state"] == "failed" and blank["message"] is None


def test_unknown_keys_are_tolerated_at_every_level(layout: InstallLayout) -> None:
    data = copy.deepcopy(V3)
    data["future"] = {"nested": [1, 2.5, None, "x"]}
    env = data["envs"]["emt"]
    env["future"] = 1
    env["checkpoints"]["emt-a"]["future"] = [True]
    record = env["checkpoints"]["emt-a"]["verifications"]["alpha"]["cpu"]
    record["future"] = "x"
    record["reference"]["future"] = {}
    record["build"]["future"] = None
    record["fingerprint"]["future"] = {"a": [1.5]}
    assert parse_manifest(json.dumps(data)) == data


def test_a_deep_but_parseable_file_is_refused_by_the_walk() -> None:
    # Deep enough to parse (below the recursion limit) yet deeper than any field.
    text = GOOD_TEXT.replace('"clusters"', '"extra": ' + nested(500, "object") + ', "clusters"')
    with pytest.raises(ManifestError, match=r"is corrupt: extra: nested deeper than"):
        parse_manifest(text)


# --- never write NaN ---------------------------------------------------------------


def passed(**changes: Any) -> dict[str, Any]:
    return {"passed": True, "device": "cpu", "fingerprint": dict(FP), **changes}


@pytest.mark.parametrize(
    "result",
    [
        passed(fingerprint={**FP, "energy_per_atom": math.nan}),
        passed(fingerprint={**FP, "stress": [math.inf, 0, 0, 0, 0, 0]}),
        passed(checks={"ok": True, "forces": {"ratio": -math.inf}}),
        passed(kwargs={"scale": math.nan}),
        passed(kwargs={"grid": [[1.0, math.inf]]}),
        passed(checks={"ok": True, "seconds": Path("/tmp")}),
    ],
    ids=["nan energy", "inf stress", "inf in checks", "nan kwarg", "nested inf kwarg", "a Path"],
)
def test_a_record_helper_refuses_nan_and_writes_nothing(
    layout: InstallLayout, result: dict[str, Any]
) -> None:
    layout.manifest_file.write_text(GOOD_TEXT)
    with pytest.raises(UnstorableValue) as info:
        record_verification(layout, "emt", "emt-a", "alpha", result)
    assert isinstance(info.value, RootstockError)
    assert "refusing to record" in info.value.message
    assert "nothing was written" in (info.value.hint or "")
    assert layout.manifest_file.read_text() == GOOD_TEXT


def test_a_kwarg_json_cannot_hold_is_still_stored_as_its_text(layout: InstallLayout) -> None:
    stored = record_verification(layout, "e", "c", "alpha", passed(kwargs={"where": Path("/x")}))
    assert stored["kwargs"] == {"where": "/x"}


def test_no_write_ever_stores_nan_or_a_bad_field(layout: InstallLayout) -> None:
    layout.manifest_file.write_text(GOOD_TEXT)
    for mutate in (
        lambda d: d.update(extra=math.nan),
        lambda d: d["envs"]["emt"].update(built_at="never"),
        lambda d: d["clusters"].append(5),
    ):
        with pytest.raises(UnstorableValue, match="refusing to write"):
            update_manifest(layout, mutate)
        assert layout.manifest_file.read_text() == GOOD_TEXT
    with pytest.raises(UnstorableValue, match="fetched_at"):
        record_fetch(layout, "emt", "emt-a", at="soon")
    assert layout.manifest_file.read_text() == GOOD_TEXT
    with pytest.raises(UnstorableValue, match="Out of range float"):
        serialize_manifest({"x": math.inf})
    # Absent stays absent.
    layout.manifest_file.unlink()
    with pytest.raises(UnstorableValue):
        record_verification(layout, "e", "c", "alpha", passed(kwargs={"x": math.inf}))
    assert not layout.manifest_file.exists()


# --- names the rule now refuses -------------------------------------------------------


def stored_bad_names() -> dict[str, Any]:
    data = copy.deepcopy(V3)
    data["clusters"] = ["alpha", "bad name!"]
    verifications = data["envs"]["emt"]["checkpoints"]["emt-a"]["verifications"]
    verifications["bad name!"] = {"tpu": {**RECORD, "device": "../../etc", "device_kind": "tpu"}}
    return data


def test_a_stored_invalid_name_reads_with_a_warning_naming_the_fix(
    layout: InstallLayout,
) -> None:
    layout.manifest_file.write_text(json.dumps(stored_bad_names()))
    with pytest.warns(StoredNameWarning) as caught:
        data = load_manifest(layout)
    assert data == stored_bad_names()
    messages = [str(w.message) for w in caught]
    [cluster] = [m for m in messages if "'bad name!'" in m]  # one per name, not per place
    assert "clusters[1] (and 1 more places)" in cluster and "rename it by hand" in cluster
    assert any("'../../etc'" in m and "re-verify on a valid device" in m for m in messages)
    assert any("'tpu'" in m and "device kinds are cpu, gpu and xpu" in m for m in messages)


def test_writing_an_invalid_name_again_is_refused(layout: InstallLayout) -> None:
    content = json.dumps(stored_bad_names()).encode()
    layout.manifest_file.write_bytes(content)
    refused = [
        lambda: record_verification(layout, "emt", "emt-a", "bad name!", passed()),
        lambda: record_verification(layout, "emt", "emt-a", "alpha", passed(device="../../etc")),
        lambda: record_verification(layout, "emt", "emt-a", "alpha", passed(device="cuda 0")),
        lambda: record_verification(
            layout, "emt", "emt-a", "alpha", passed(device="cpu", device_kind="tpu")
        ),
        lambda: ensure_manifest(layout, ["Bad Name!"]),
        lambda: resolve_cluster(layout, "Bad Name!"),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoredNameWarning)
        for call in refused:
            with pytest.raises(UsageError):
                call()
            assert layout.manifest_file.read_bytes() == content
        # An unrelated write keeps the stored names as they were.
        record_fetch(layout, "emt", "emt-b", at=T1)
        after = load_manifest(layout)
    expected = stored_bad_names()
    assert after["clusters"] == expected["clusters"]
    assert (
        after["envs"]["emt"]["checkpoints"]["emt-a"]
        == expected["envs"]["emt"]["checkpoints"]["emt-a"]
    )
    assert after["envs"]["emt"]["checkpoints"]["emt-b"]["fetched_at"] == T1


# --- the files a download brought ------------------------------------------------------


def test_files_load_and_each_problem_names_its_entry(layout: InstallLayout) -> None:
    files = ["cache/huggingface/hub/models--x/blobs/abc", "home/.cache/mace/model.pt"]
    layout.manifest_file.write_bytes(with_value((*CK, "files"), files))
    assert load_manifest(layout)["envs"]["emt"]["checkpoints"]["emt-a"]["files"] == files
    layout.manifest_file.write_bytes(with_value((*CK, "files"), [*files, "../x"]))
    with pytest.raises(ManifestError, match=r"files\[2\]: must be a clean relative path"):
        load_manifest(layout)


def test_record_fetch_merges_files_with_those_still_on_disk(
    layout: InstallLayout, root: Path
) -> None:
    (root / "cache" / "old").mkdir()
    (root / "cache" / "old" / "kept.bin").write_text("k")
    (root / "cache" / "old" / "gone.bin").write_text("g")
    first = record_fetch(
        layout, "emt", "emt-a", at=T0, files=["cache/old/kept.bin", "cache/old/gone.bin"]
    )
    assert first["files"] == ["cache/old/gone.bin", "cache/old/kept.bin"]
    (root / "cache" / "old" / "gone.bin").unlink()
    again = record_fetch(
        layout, "emt", "emt-a", at=T1, files=["home/.cache/new.pt", "cache/old/kept.bin"]
    )
    # Sorted, unique, the vanished file dropped, the kept one kept.
    assert again["files"] == ["cache/old/kept.bin", "home/.cache/new.pt"]
    assert again["fetched_at"] == T1
    # No files given: the list stays as it is.
    assert record_fetch(layout, "emt", "emt-a")["files"] == again["files"]
    # A record fetched without any stays unattributed (no key at all).
    assert "files" not in record_fetch(layout, "emt", "emt-b")
    stored = load_manifest(layout)["envs"]["emt"]["checkpoints"]
    assert stored["emt-a"]["files"] == again["files"] and "files" not in stored["emt-b"]


def test_record_fetch_refuses_an_unclean_path_before_the_lock(layout: InstallLayout) -> None:
    layout.manifest_file.write_text(GOOD_TEXT)
    for bad in ("/abs/path", "cache/../x", "", "cache/a\0b"):
        with pytest.raises(ValueError, match="files"):
            record_fetch(layout, "emt", "emt-a", files=["cache/ok", bad])
    assert layout.manifest_file.read_text() == GOOD_TEXT


def test_record_fetch_over_the_limit_leaves_the_record_unattributed(
    layout: InstallLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rootstock.install.manifest import records

    monkeypatch.setattr(records, "MAX_CHECKPOINT_FILES", 2)
    (layout.cache_dir / "a").write_text("a")
    assert record_fetch(layout, "emt", "emt-a", files=["cache/a"])["files"] == ["cache/a"]
    record = record_fetch(layout, "emt", "emt-a", files=["cache/b", "cache/c"])
    assert "files" not in record
    assert "files" not in load_manifest(layout)["envs"]["emt"]["checkpoints"]["emt-a"]
