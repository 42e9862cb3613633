"""The sample env files, found from a checkout and read without importing them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rootstock.install.samples import (
    path_to_pass,
    sample_declaring,
    sample_env_files,
    sample_envs_dir,
)

REPO = Path(__file__).resolve().parents[2]


def test_a_checkout_reads_its_own_environments_dir() -> None:
    assert sample_envs_dir() == REPO / "environments"
    assert [p.name for p in sample_env_files()] == sorted(
        p.name for p in (REPO / "environments").glob("*.py")
    )


def test_the_file_that_declares_an_id_is_found_without_importing_it() -> None:
    before = set(sys.modules)
    env = sample_declaring("mace-mp-0-small")
    assert env is not None and env.name == "mace"
    assert env.path == REPO / "environments" / "mace.py"
    assert sample_declaring("emtt") is None
    assert not {m for m in set(sys.modules) - before if m.startswith(("mace", "torch"))}


def test_a_path_below_the_working_directory_is_shown_relative(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    mace = REPO / "environments" / "mace.py"
    monkeypatch.chdir(REPO)
    assert path_to_pass(mace) == "environments/mace.py"
    monkeypatch.chdir(tmp_path)
    assert path_to_pass(mace) == str(mace)
