"""``uv --version`` run for real, through the build supervisor.

The first test asks the real uv; the second points rootstock at FAKE_UV, a
three-line shell script that writes the environment it was really started with,
to show that the version call gets the scrubbed build environment and not the
caller's.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from rootstock.install import uv
from rootstock.install.layout import InstallLayout

pytestmark = pytest.mark.timeout(120)

FAKE_UV = """#!/bin/sh
env > "$FAKE_UV_REPORT"
echo "uv 0.0.0-fake (FAKE_UV)"
"""


def test_uv_version_matches_the_real_uv(tmp_path: Path):
    direct = subprocess.run(
        [uv.uv_binary(), "--version"], capture_output=True, text=True, timeout=60, check=True
    )
    assert uv.uv_version(InstallLayout(tmp_path, tmp_path)) == direct.stdout.split()[1]


def test_uv_version_gets_the_scrubbed_environment(tmp_path: Path, monkeypatch):
    fake = tmp_path / "fake-uv"
    fake.write_text(FAKE_UV)
    fake.chmod(0o755)
    report = tmp_path / "fake-uv-env.txt"
    monkeypatch.setattr(uv, "uv_binary", lambda: str(fake))
    monkeypatch.setenv("FAKE_UV_REPORT", str(report))  # uv's own settings pass through
    monkeypatch.setenv("VIRTUAL_ENV", "/from/the/user/venv")
    monkeypatch.setenv("UV_PYTHON", "/from/the/user/python")
    monkeypatch.setenv("PYTHONPATH", "/from/the/user/lib")
    layout = InstallLayout(tmp_path / "root", tmp_path / "cache")

    assert uv.uv_version(layout) == "0.0.0-fake"

    seen = dict(line.split("=", 1) for line in report.read_text().splitlines() if "=" in line)
    assert "VIRTUAL_ENV" not in seen
    assert "UV_PYTHON" not in seen
    assert "PYTHONPATH" not in seen
    assert seen["UV_CACHE_DIR"] == str(layout.uv_cache_dir)
    assert seen["HOME"] == str(layout.home_dir)
    assert seen["PYTHONNOUSERSITE"] == "1"
    assert os.environ["VIRTUAL_ENV"] == "/from/the/user/venv"  # the caller's is untouched
