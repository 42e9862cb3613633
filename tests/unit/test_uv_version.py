"""``uv --version`` goes through the one uv chokepoint, with the build's environment.

In-process: the supervised runner is replaced by one that records what it was asked
to run and answers like uv would, so no subprocess starts. The same call with the
real uv, and a fake uv that reports the environment it really got, is in
``tests/integration/test_uv_version.py``.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from rootstock.install import uv
from rootstock.install.layout import InstallLayout

#: Variables the user's shell may hold that uv must never see (uv.py scrubs them).
USER_ONLY = ("VIRTUAL_ENV", "PYTHONPATH", "UV_PYTHON", "CONDA_PREFIX")


class RecordingRunner:
    """Stands in for ``run_supervised``: records each call, answers with ``reply``."""

    def __init__(self, reply: str, returncode: int = 0) -> None:
        self.reply = reply
        self.returncode = returncode
        self.calls: list[tuple[list[str], dict[str, str]]] = []

    def __call__(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append((list(cmd), dict(kwargs["env"])))
        return subprocess.CompletedProcess(list(cmd), self.returncode, self.reply, None)


@pytest.fixture
def layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> InstallLayout:
    for name in USER_ONLY:
        monkeypatch.setenv(name, f"/from/the/user/{name}")
    return InstallLayout(tmp_path / "root", tmp_path / "cache")


def test_uv_version_runs_with_the_scrubbed_build_environment(layout, monkeypatch):
    runner = RecordingRunner("uv 0.13.9 (x86_64-unknown-linux-gnu)\n")
    monkeypatch.setattr(uv, "run_supervised", runner)

    assert uv.uv_version(layout) == "0.13.9"

    [(cmd, env)] = runner.calls
    assert cmd == [uv.uv_binary(), "--version"]
    assert not set(USER_ONLY) & set(env), "the user's venv/Python settings reached uv"
    assert env == uv.uv_environment(layout)
    assert env["UV_CACHE_DIR"] == str(layout.uv_cache_dir)
    assert env["HOME"] == str(layout.home_dir)
    assert env["PYTHONNOUSERSITE"] == "1"


def test_uv_version_skips_a_warning_printed_before_it(layout, monkeypatch):
    # stdout and stderr come back merged; a config warning may come first.
    reply = "warning: Failed to parse `uv.toml`\nuv 0.13.9 (x86_64-unknown-linux-gnu)\n"
    monkeypatch.setattr(uv, "run_supervised", RecordingRunner(reply))
    assert uv.uv_version(layout) == "0.13.9"


@pytest.mark.parametrize(
    ("reply", "returncode"),
    [("error: unexpected argument\n", 2), ("", 0), ("something else entirely\n", 0)],
)
def test_uv_version_is_none_when_uv_cannot_say(layout, monkeypatch, reply, returncode):
    monkeypatch.setattr(uv, "run_supervised", RecordingRunner(reply, returncode))
    assert uv.uv_version(layout) is None


def test_uv_version_is_none_when_uv_cannot_start(layout, monkeypatch):
    def cannot_start(cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        raise PermissionError(13, "Permission denied", cmd[0])

    monkeypatch.setattr(uv, "run_supervised", cannot_start)
    assert uv.uv_version(layout) is None
