"""Fuzzing the manifest reader: any input is a manifest or a RootstockError, never a write.

Three sources of input: arbitrary bytes, arbitrary JSON values, and a real-looking
manifest with one leaf or subtree replaced by arbitrary JSON (or removed). Each
example gets its own install root (a temporary directory, not a pytest fixture,
so Hypothesis can rerun it), and its listing and bytes are compared after every
read. A read that refuses is followed by a write, which must refuse too; a
manifest that loads is used as status and push use it, and then written to.
"""

from __future__ import annotations

import contextlib
import copy
import json
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rootstock.errors import RootstockError
from rootstock.install.layout import InstallLayout
from rootstock.install.manifest import (
    checkpoint_state,
    cluster_view,
    load_manifest,
    parse_manifest,
    record_verification,
    update_manifest,
)
from rootstock.names import StoredNameWarning
from tests.unit.test_manifest_validation import FP, V3

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(max_examples=200, deadline=None)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**20), max_value=10**20)
    | st.floats()  # NaN and infinities included: json.dumps writes them, the reader refuses
    | st.text(max_size=20)
    | st.sampled_from(["2025-03-01T09:00:00+00:00", "verified", "cpu", "cuda:0", "yesterday"])
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a node of ``value`` (the root excluded)."""
    if not isinstance(value, dict | list):
        return []
    found = []
    for key, child in value.items() if isinstance(value, dict) else enumerate(value):
        found.append((*prefix, key))
        found.extend(paths(child, (*prefix, key)))
    return found


V3_PATHS = paths(V3)
PASS = {"passed": True, "device": "cpu", "fingerprint": FP}


def read_in_a_fresh_root(content: bytes) -> None:
    """Load ``content`` as a root's manifest: a dict or a RootstockError, and no write."""
    with tempfile.TemporaryDirectory(prefix="rootstock-fuzz-") as tmp:
        root = Path(tmp)
        (root / ".locks").mkdir()
        layout = InstallLayout(root, root)
        layout.manifest_file.write_bytes(content)
        before = sorted(p.name for p in root.iterdir())
        loaded = False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StoredNameWarning)
            try:
                data = load_manifest(layout)
                loaded = True
            except RootstockError:
                with pytest.raises(RootstockError):
                    update_manifest(layout, lambda d: d.setdefault("fuzzed", True))
            else:
                assert isinstance(data, dict)
                use_as_the_commands_do(data)
        assert sorted(p.name for p in root.iterdir()) == before
        assert layout.manifest_file.read_bytes() == content
        if loaded:
            # What was accepted must also be writable: a record lands or is refused.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", StoredNameWarning)
                with contextlib.suppress(RootstockError):
                    record_verification(layout, "emt", "emt-a", "alpha", PASS)


def use_as_the_commands_do(data: dict[str, Any]) -> None:
    """What status, push and the dashboard do with a manifest that loaded."""
    json.dumps(data, allow_nan=False)
    for env_name, env in data["envs"].items():
        for checkpoint in env.get("checkpoints", {}):
            for cluster in {*data["clusters"], "alpha"}:
                checkpoint_state(data, env_name, checkpoint, cluster).to_dict()
                for kind in ("cpu", "gpu"):
                    checkpoint_state(data, env_name, checkpoint, cluster, kind)
    for cluster in data["clusters"]:
        cluster_view(data, cluster)


@FUZZ
@given(st.binary(max_size=400))
def test_arbitrary_bytes(content: bytes) -> None:
    read_in_a_fresh_root(content)


@FUZZ
@given(json_values)
def test_arbitrary_json_values(value: Any) -> None:
    text = json.dumps(value)  # NaN and Infinity where the floats hold them
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoredNameWarning)
        try:
            data = parse_manifest(text)
        except RootstockError:
            return
    assert isinstance(data, dict)
    use_as_the_commands_do(data)


@FUZZ
@given(st.sampled_from(V3_PATHS), json_values | st.just(KeyError), st.booleans())
def test_a_valid_manifest_with_one_part_replaced(path: tuple, value: Any, as_v1: bool) -> None:
    data = copy.deepcopy(V3)
    if as_v1:  # the same shape, read through the migrations from v1
        data["schema_version"] = 1
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    if value is KeyError:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    read_in_a_fresh_root(json.dumps(data).encode())


@FUZZ
@given(st.sampled_from(V3_PATHS), st.integers(min_value=60, max_value=2000))
def test_a_deep_subtree_anywhere(path: tuple, depth: int) -> None:
    data = copy.deepcopy(V3)
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = "DEEP"
    text = json.dumps(data).replace('"DEEP"', "[" * depth + "]" * depth, 1)
    read_in_a_fresh_root(text.encode())
