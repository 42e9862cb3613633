"""Fixtures for the model-family tests: each family env is built once per session."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import install_family
from tests.mlip.family import THREADS


@pytest.fixture(scope="session")
def family_env(family_root: Path, torch_pin) -> Callable[[str], Path]:
    """``family_env(name)`` builds ``environments/<name>.py`` into the family root
    (once per session) and returns the root."""

    def build(name: str) -> Path:
        install_family(family_root, name, torch_pin)
        return family_root

    return build


@pytest.fixture(scope="module", autouse=True)
def same_threads() -> Iterator[None]:
    """Workers get the thread count that ``in_process`` runs use, so the two agree.

    Per module: a pytest process that runs other tests after these (an xdist worker)
    gets its own environment back."""
    with pytest.MonkeyPatch.context() as patch:
        for key, value in THREADS.items():
            patch.setenv(key, value)
        yield
