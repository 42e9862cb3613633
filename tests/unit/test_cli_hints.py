"""``next:`` hints are for people: ``rootstock --quiet`` and ``$ROOTSTOCK_NO_HINTS`` silence
every one of them (issue 31), in-process.

The commands that print one (``init`` and ``dashboard add-cluster``) run for real,
on a temporary root and a temporary SQLite dashboard; only the hint line changes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rootstock.cli.main import main

pytestmark = pytest.mark.timeout(120)

# How each command is silenced: (global options, $ROOTSTOCK_NO_HINTS).
SILENCED = [(["--quiet"], None), (["-q"], None), ([], "1"), ([], "yes")]


@pytest.fixture(autouse=True)
def private_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROOTSTOCK_CONFIG", str(tmp_path / "user" / "config.toml"))
    monkeypatch.delenv("ROOTSTOCK_ROOT", raising=False)
    monkeypatch.delenv("ROOTSTOCK_CLUSTERS_FILE", raising=False)
    monkeypatch.delenv("ROOTSTOCK_NO_HINTS", raising=False)


def run(capsys, argv: list[str]) -> tuple[int, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def init_argv(tmp_path: Path, name: str) -> list[str]:
    return ["init", "--root", str(tmp_path / name), "--cluster", "box", "--yes", "--no-images"]


def add_cluster_argv(tmp_path: Path, name: str) -> list[str]:
    return ["dashboard", "add-cluster", name, "--db", str(tmp_path / "dashboard.sqlite3")]


COMMANDS = {"init": init_argv, "add-cluster": add_cluster_argv}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_person_gets_the_next_hint(tmp_path, capsys, command):
    code, out = run(capsys, COMMANDS[command](tmp_path, "shown"))
    assert code == 0, out
    assert "\nnext: rootstock " in "\n" + out, out


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize(("options", "env"), SILENCED)
def test_a_script_silences_every_next_hint(tmp_path, capsys, monkeypatch, command, options, env):
    if env is not None:
        monkeypatch.setenv("ROOTSTOCK_NO_HINTS", env)
    code, out = run(capsys, [*options, *COMMANDS[command](tmp_path, "quiet")])
    assert code == 0, out
    assert "next:" not in out, out
    # Only the hint goes: what the command did is still said.
    assert ("install root:" if command == "init" else "added cluster quiet") in out


def test_no_hints_set_to_a_false_value_keeps_them(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ROOTSTOCK_NO_HINTS", "0")
    code, out = run(capsys, add_cluster_argv(tmp_path, "kept"))
    assert code == 0, out
    assert "next: rootstock dashboard issue-key --cluster kept" in out


def test_help_lists_the_quiet_option(capsys):
    assert main(["--help"]) == 0
    assert "-q, --quiet" in capsys.readouterr().out
