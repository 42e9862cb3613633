"""A usage spool in a temp dir, and the records and commands the usage tests use."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import strategies as st

from rootstock.cli.main import main
from rootstock.install.layout import InstallLayout

DAY = 24 * 3600


def make_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> InstallLayout:
    """An install whose spool exists (mode 1777, as setup-perms makes it)."""
    monkeypatch.setenv("ROOTSTOCK_CONFIG", str(tmp_path / "config.toml"))
    layout = InstallLayout(root=tmp_path / "root", cache_root=tmp_path / "root")
    layout.usage_dir.mkdir(parents=True)
    os.chmod(layout.usage_dir, 0o1777)
    return layout


def record(month: str = "2026-11", env: str = "emt", user: str = "u1", calls=3) -> dict:
    """A record as a session writes it."""
    return {
        "version": 1,
        "env": env,
        "checkpoint": env,
        "device": "cpu",
        "entry_point": "calculator",
        "start": f"{month}-05T10:00:00Z",
        "duration_s": 1.5,
        "force_calls": calls,
        "user": user,
    }


def drop(spool: Path, name: str, rec: dict | str) -> Path:
    """Put a record (a dict, or raw text) into the spool."""
    path = spool / name
    path.write_text(rec if isinstance(rec, str) else json.dumps(rec))
    return path


def rollup_file(layout: InstallLayout, month: str = "2026-11") -> Path:
    return layout.usage_dir / "rollups" / f"{month}.json"


def numbers(report: dict) -> tuple:
    """What a report says: its rows and totals."""
    return report["rows"], report["totals"]


def run_usage(capsys: pytest.CaptureFixture, layout: InstallLayout, *argv: str) -> tuple[int, str]:
    """Run ``rootstock usage ARGV`` through the real CLI in-process: (exit code, output)."""
    roots = ("--root", str(layout.root), "--cache-root", str(layout.cache_root))
    code = main(["usage", *argv, *roots])
    out = capsys.readouterr()
    return code, out.out + out.err


def spool_bytes(spool: Path) -> dict[str, bytes]:
    """Every file under the spool but compact's lock, by relative path."""
    return {
        str(p.relative_to(spool)): p.read_bytes()
        for p in sorted(spool.rglob("*"))
        if p.is_file() and p.name != ".compact.lock"
    }


# Any JSON value, small: for fuzzing the readers.
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 10)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
