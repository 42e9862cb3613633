"""Fixtures for the model-family tests: each family env is built once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import install_family


@pytest.fixture(scope="session")
def family_env(family_root: Path, torch_pin) -> Callable[[str], Path]:
    """``family_env(name)`` builds ``environments/<name>.py`` into the family root
    (once per session) and returns the root."""

    def build(name: str) -> Path:
        install_family(family_root, name, torch_pin)
        return family_root

    return build
