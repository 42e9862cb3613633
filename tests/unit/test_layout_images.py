"""Whether builds pack an image: layout.json's ``images``, and ``$ROOTSTOCK_IMAGES``."""

from __future__ import annotations

import json

import pytest

from rootstock.errors import LayoutError, UsageError
from rootstock.install.layout import (
    IMAGES_ENV,
    InstallLayout,
    images_enabled,
    read_layout,
    set_layout_images,
    write_layout,
)


@pytest.fixture
def layout(tmp_path, monkeypatch) -> InstallLayout:
    monkeypatch.delenv(IMAGES_ENV, raising=False)
    return InstallLayout(tmp_path, tmp_path)


def test_images_are_on_unless_the_root_or_the_variable_says_otherwise(layout, monkeypatch):
    assert images_enabled(layout)  # no layout.json at all
    write_layout(layout.root, None)
    assert images_enabled(layout)
    set_layout_images(layout.root, False)
    assert not images_enabled(layout)
    assert read_layout(layout.root)["cache_root"] is None  # the rest is kept
    monkeypatch.setenv(IMAGES_ENV, "on")
    assert images_enabled(layout)
    monkeypatch.setenv(IMAGES_ENV, "0")
    set_layout_images(layout.root, True)
    assert not images_enabled(layout)


def test_a_bad_variable_or_layout_value_is_refused_with_the_fix(layout, monkeypatch):
    monkeypatch.setenv(IMAGES_ENV, "maybe")
    with pytest.raises(UsageError) as caught:
        images_enabled(layout)
    assert "ROOTSTOCK_IMAGES must be 0 or 1" in caught.value.message
    monkeypatch.delenv(IMAGES_ENV)
    (layout.root / "layout.json").write_text(
        json.dumps({"layout_version": 1, "cache_root": None, "images": "yes"})
    )
    with pytest.raises(LayoutError) as refused:
        images_enabled(layout)
    assert "images must be true or false" in refused.value.message
    assert "--images" in (refused.value.hint or "")
