"""Fuzzing the layout.json, config.toml and cluster-registry readers (issue #13).

Whatever the bytes: arbitrary ones, arbitrary JSON or TOML documents, or a valid
file with a few bytes changed, a reader returns a value that obeys its documented
types or raises a :class:`RootstockError`, never another exception, and never
writes (the directory's listing and every byte in it stay as they were).

Each example runs in its own fresh directory under one module-scoped folder, and
the environment is set per example, so no function-scoped fixture is shared
across examples. Sized to finish in seconds (max_examples=200 each).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rootstock.errors import RootstockError
from rootstock.install.clusters import load_registry
from rootstock.install.config import load_config
from rootstock.install.layout import read_layout
from rootstock.install.machine import resolve_cache_root
from rootstock.names import StoredNameWarning, is_cluster_name

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(
    max_examples=200,
    deadline=None,
    # Inputs are built from bytes; large ones are the point, not a problem.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

VALID_LAYOUT = json.dumps(
    {
        "cache_root": "/scratch/rootstock-cache",
        "layout_version": 1,
        "written_at": "2025-03-01T09:00:00+00:00",
        "written_by": "rootstock 0.1.0",
    },
    indent=2,
).encode()
VALID_CONFIG = (
    b'root = "/shared/rootstock"\ncluster = "della"\nmaintainer_name = "Ada"\n'
    b'maintainer_email = "ada@example.org"\nis_maintainer = true\n'
    b'api_url = "https://dashboard.example.org"\napi_key = "k"\napi_secret = "s"\n'
)
VALID_REGISTRY = (
    b'[clusters.mybox]\nroot = "/shared/rootstock"\n\n'
    b'[clusters.della]\nroot = "/scratch/gpfs/X/rootstock"\ncache_root = "/scratch/c"\n'
)

LAYOUT_KEYS = ("layout_version", "cache_root", "written_by", "written_at")
CONFIG_KEYS = ("root", "cluster", "is_maintainer", "api_url", "api_key", "maintainer_name")
REGISTRY_KEYS = ("root", "cache_root")


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@contextmanager
def environment(**values: str | None) -> Iterator[None]:
    """Set (or, for None, unset) environment variables for one example; restore them after."""
    saved = {key: os.environ.get(key) for key in values}
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def snapshot(directory: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(directory)): None if p.is_dir() else p.read_bytes()
        for p in sorted(directory.rglob("*"))
    }


def read_cleanly(directory: Path, read: Callable[[], Any]) -> Any:
    """``read()``'s value, or None for a RootstockError; the directory must be unchanged."""
    before = snapshot(directory)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StoredNameWarning)
            value = read()
    except RootstockError:
        value = None
    assert snapshot(directory) == before
    return value


# --- inputs ---------------------------------------------------------------------------

# Text a file could hold; no lone surrogates, which no file can.
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=20)
PATHS = st.one_of(
    TEXT,
    st.sampled_from(["/", "/abs/dir", "rel/dir", "~/x", "", " ", "/a\0b", "/a/../b"]),
)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), TEXT, PATHS)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)


def mutated(valid: bytes) -> st.SearchStrategy[bytes]:
    """``valid`` with a few bytes flipped, inserted, removed or repeated."""

    @st.composite
    def build(draw: st.DrawFn) -> bytes:
        data = bytearray(valid)
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, len(data)))
            kind = draw(st.sampled_from(["flip", "insert", "delete", "repeat"]))
            if kind == "flip" and at < len(data):
                data[at] ^= draw(st.integers(1, 255))
            elif kind == "insert":
                data[at:at] = draw(st.binary(min_size=1, max_size=4))
            elif kind == "delete":
                del data[at : at + draw(st.integers(1, 8))]
            else:
                data[at:at] = data[at : at + draw(st.integers(1, 16))]
        return bytes(data)

    return build()


def layout_documents() -> st.SearchStrategy[bytes]:
    """JSON objects built from the known keys (any types), sometimes not objects at all."""
    known = st.fixed_dictionaries({}, optional={k: JSON_VALUES for k in LAYOUT_KEYS})
    value = st.one_of(known, known, JSON_VALUES)
    return value.map(lambda v: json.dumps(v).encode())


def toml_string(text: str) -> str:
    # JSON's escapes are TOML's too; TOML also refuses a literal DEL.
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def toml_value(value: Any) -> str:
    """A TOML rendering of ``value`` (floats as TOML writes nan/inf), independent of the code."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return (
            "{" + ", ".join(f"{toml_string(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
        )
    return '""'  # None has no TOML form


TOML_VALUES = st.recursive(
    st.one_of(st.booleans(), st.integers(), st.floats(), TEXT, PATHS),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=10,
)


# Paths half the time: the readers' checks are about path strings.
VALUES_OR_PATHS = st.one_of(PATHS, TOML_VALUES)


def config_documents() -> st.SearchStrategy[bytes]:
    """TOML documents whose keys are mostly the known ones, with values of any type."""
    known = st.fixed_dictionaries({}, optional={k: VALUES_OR_PATHS for k in CONFIG_KEYS})
    other = st.dictionaries(TEXT, TOML_VALUES, max_size=2)
    pairs = st.tuples(known, other).map(lambda kv: {**kv[1], **kv[0]})
    return pairs.map(
        lambda d: "".join(f"{toml_string(k)} = {toml_value(v)}\n" for k, v in d.items()).encode()
    )


def registry_documents() -> st.SearchStrategy[bytes]:
    """``[clusters.NAME]`` tables with known keys of any type, and odd names."""
    names = st.one_of(st.sampled_from(["mybox", "Della", "Bad Name!", ""]), TEXT)
    entry = st.fixed_dictionaries(
        {}, optional={k: VALUES_OR_PATHS for k in REGISTRY_KEYS}
    ) | st.dictionaries(TEXT, TOML_VALUES, max_size=2)
    tables = st.dictionaries(names, st.one_of(entry, entry, TOML_VALUES), max_size=4)

    def render(clusters: dict[str, Any]) -> bytes:
        text = "[clusters]\n" + "".join(
            f"{toml_string(k)} = {toml_value(v)}\n" for k, v in clusters.items()
        )
        return text.encode()

    return tables.map(render)


# --- layout.json ----------------------------------------------------------------------


def check_layout(scratch: Path, raw: bytes) -> None:
    root = Path(tempfile.mkdtemp(dir=scratch))
    (root / "layout.json").write_bytes(raw)
    with environment(ROOTSTOCK_CONFIG=str(root / "no-config.toml"), ROOTSTOCK_CLUSTERS_FILE=None):
        layout = read_cleanly(root, lambda: read_layout(root))
        cache = read_cleanly(root, lambda: resolve_cache_root(root))
    if layout is not None:
        version = layout["layout_version"]
        assert type(version) is int and 0 <= version <= 1
        declared = layout.get("cache_root")
        assert declared is None or (
            isinstance(declared, str) and os.path.isabs(declared) and "\0" not in declared
        )
        assert cache == (Path(declared) if declared else root)
    else:
        assert cache is None  # both readers refuse the same files


@FUZZ
@given(st.binary(max_size=400))
def test_layout_from_arbitrary_bytes(scratch, raw):
    check_layout(scratch, raw)


@FUZZ
@given(layout_documents())
def test_layout_from_arbitrary_json_documents(scratch, raw):
    check_layout(scratch, raw)


@FUZZ
@given(mutated(VALID_LAYOUT))
def test_layout_from_mutations_of_a_valid_file(scratch, raw):
    check_layout(scratch, raw)


# --- config.toml ----------------------------------------------------------------------


def check_config(scratch: Path, raw: bytes) -> None:
    home = Path(tempfile.mkdtemp(dir=scratch))
    path = home / "config.toml"
    path.write_bytes(raw)
    with environment(ROOTSTOCK_CONFIG=str(path)):
        config = read_cleanly(home, load_config)
    if config is None:
        return
    assert isinstance(config, dict)
    if "root" in config:
        root = config["root"]
        assert isinstance(root, str) and "\0" not in root
        assert os.path.isabs(os.path.expanduser(root))
    if "cluster" in config:
        assert isinstance(config["cluster"], str)
    if "is_maintainer" in config:
        assert isinstance(config["is_maintainer"], bool)
    for key in ("maintainer_name", "maintainer_email", "api_url", "api_key", "api_secret"):
        if key in config:
            assert isinstance(config[key], str)


@FUZZ
@given(st.binary(max_size=400))
def test_config_from_arbitrary_bytes(scratch, raw):
    check_config(scratch, raw)


@FUZZ
@given(config_documents())
def test_config_from_arbitrary_toml_documents(scratch, raw):
    check_config(scratch, raw)


@FUZZ
@given(mutated(VALID_CONFIG))
def test_config_from_mutations_of_a_valid_file(scratch, raw):
    check_config(scratch, raw)


# --- the cluster registry -------------------------------------------------------------


def check_registry(scratch: Path, raw: bytes) -> None:
    site = Path(tempfile.mkdtemp(dir=scratch))
    path = site / "clusters.toml"
    path.write_bytes(raw)
    with environment(ROOTSTOCK_CLUSTERS_FILE=str(path)):
        registry = read_cleanly(site, load_registry)
    if registry is None:
        return
    for name, cluster in registry.items():
        assert is_cluster_name(name) and cluster.name == name
        assert cluster.root.is_absolute()
        assert cluster.cache_root is None or cluster.cache_root.is_absolute()


@FUZZ
@given(st.binary(max_size=400))
def test_registry_from_arbitrary_bytes(scratch, raw):
    check_registry(scratch, raw)


@FUZZ
@given(registry_documents())
def test_registry_from_arbitrary_toml_documents(scratch, raw):
    check_registry(scratch, raw)


@FUZZ
@given(mutated(VALID_REGISTRY))
def test_registry_from_mutations_of_a_valid_file(scratch, raw):
    check_registry(scratch, raw)
