"""Atomic writes: modes that honour the umask, no temp files left, no torn reads."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest

from rootstock.install.atomic import (
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    current_umask,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def umask():
    """Set the process umask for one test, restoring it afterwards."""
    saved = os.umask(0o022)
    os.umask(saved)

    def set_mask(mask: int) -> None:
        os.umask(mask)

    yield set_mask
    os.umask(saved)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize(("mask", "expected"), [(0o002, 0o664), (0o022, 0o644), (0o077, 0o600)])
def test_mode_follows_the_umask(tmp_path, umask, mask, expected):
    umask(mask)
    target = tmp_path / "manifest.json"
    atomic_write_text(target, "x")
    assert mode_of(target) == expected


def test_overwrite_takes_the_umask_mode_not_a_temp_file_mode(tmp_path, umask):
    umask(0o002)
    target = tmp_path / "layout.json"
    target.write_text("old")
    target.chmod(0o600)
    atomic_write_text(target, "new")
    assert target.read_text() == "new"
    assert mode_of(target) == 0o664


def test_explicit_mode_wins_over_the_umask(tmp_path, umask):
    umask(0o000)
    target = tmp_path / "config.toml"
    atomic_write_text(target, "api_secret = 'x'\n", mode=0o600)
    assert mode_of(target) == 0o600


def test_no_temp_files_are_left(tmp_path):
    target = tmp_path / "manifest.json"
    for i in range(5):
        atomic_write_json(target, {"i": i})
    assert os.listdir(tmp_path) == ["manifest.json"]


def test_a_failed_rename_leaves_no_temp_file(tmp_path):
    target = tmp_path / "in-the-way"
    target.mkdir()
    with pytest.raises(OSError):
        atomic_write_bytes(target, b"data")
    assert os.listdir(tmp_path) == ["in-the-way"]
    assert target.is_dir()


def test_unserialisable_json_leaves_the_old_file(tmp_path):
    target = tmp_path / "manifest.json"
    atomic_write_json(target, {"ok": True})
    with pytest.raises(TypeError):
        atomic_write_json(target, {"bad": object()})
    assert json.loads(target.read_text()) == {"ok": True}
    assert os.listdir(tmp_path) == ["manifest.json"]


def test_json_is_sorted_indented_and_newline_terminated(tmp_path):
    target = tmp_path / "x.json"
    atomic_write_json(target, {"b": 1, "a": [1, 2]})
    text = target.read_text()
    assert text.endswith("}\n")
    assert text.index('"a"') < text.index('"b"')
    assert json.loads(text) == {"a": [1, 2], "b": 1}


def test_text_is_utf8(tmp_path):
    target = tmp_path / "name.txt"
    atomic_write_text(target, "Ångström")
    assert target.read_bytes() == "Ångström".encode()


def test_current_umask_does_not_change_it(umask):
    umask(0o027)
    assert current_umask() == 0o027
    assert current_umask() == 0o027


def test_readers_never_see_a_torn_file(tmp_path):
    target = tmp_path / "manifest.json"
    payloads = [{"n": n, "pad": "x" * (n * 5000)} for n in range(1, 6)]
    atomic_write_json(target, payloads[0])
    stop = threading.Event()
    bad: list[str] = []

    def read_forever() -> None:
        while not stop.is_set():
            text = target.read_text()
            try:
                json.loads(text)
            except ValueError:
                bad.append(text[:80])

    reader = threading.Thread(target=read_forever)
    reader.start()
    try:
        for i in range(100):
            atomic_write_json(target, payloads[i % len(payloads)])
    finally:
        stop.set()
        reader.join(timeout=10)
    assert bad == []
    assert os.listdir(tmp_path) == ["manifest.json"]
